"""How long one optimizer step takes on a device: FLOPs counted on fake tensors, and a step-time model.

The model, per rank and per optimizer step (every number below is an assumption until calibrated):

- **FLOPs** = forward + backward FLOPs of the step's samples (``FlopCounterMode`` on fake tensors:
  matmuls, convolutions, attention), plus the forward FLOPs of the checkpointed modules again (the
  recompute), plus the optimizer's elementwise update (:data:`OPTIMIZER_FLOPS_PER_PARAM`).
- **compute** = FLOPs ÷ (the device's dense peak for the precision's matmul dtype × ``efficiency``).
  ``efficiency`` defaults to :data:`DEFAULT_EFFICIENCY` = 0.40: large-model training reaches 30-46%
  model-FLOPs utilisation (PaLM paper, Chowdhery et al. 2022, table 3: PaLM 46.2%, MT-NLG 30.2%,
  Gopher 32.5%); tuned runs reach more (llm-foundry's MPT table, commit 8c8dd48: median 47% on
  A100/H100), small models far less. A monitored run replaces it (:class:`Calibration`).
- **memory bound**: the step is never faster than the bytes it must move ÷ memory bandwidth: weights
  read in forward and backward (again for the recompute), saved activations written and read back,
  gradients accumulated, and the optimizer reading parameters, gradients and state and writing
  parameters and state.
- **communication** over a stated :class:`Interconnect`, not overlapped with compute (an upper
  bound): DDP all-reduces the gradients once per step (ring: ``2 (N-1)/N`` bytes per rank); FSDP
  all-gathers the parameters in forward and backward and reduce-scatters the gradients every
  micro-step (``3 (N-1)/N``). Across nodes the collective is hierarchical: inside a node over the
  intra-node link, then each GPU exchanges its ``1/gpus_per_node`` share over its inter-node link.

- **launch bound**: eager PyTorch spends host time on every operator it launches, ~5 µs on a CUDA/ROCm
  GPU (:data:`LAUNCH_S_PER_KERNEL`; Horace He, "Making Deep Learning Go Brrrr From First Principles",
  2022: overhead-bound below a few hundred µs of work per op), so a small model's step is never shorter
  than its operators (counted on the fake trace, views excluded) × that time. ``torch.compile`` and CUDA
  graphs lower it; the measured calibration of such a run takes that in.

step = max(compute, memory bound, launch bound) + communication.

Example:
    >>> from resource_guard.devices import load_catalog
    >>> a100 = load_catalog().get("a100-40gb")
    >>> t = step_time(a100, "bf16-mixed", flops=312e12 * 0.4, bytes_moved=0.0)
    >>> round(t.step_s, 3), t.bound
    (1.0, 'compute')
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from resource_guard.devices import Catalog, DeviceSpec
from resource_guard.errors import ConfigurationError
from resource_guard.step.precision import parse_precision
from resource_guard.step.training import LossFn, batch_size_of, call_loss_fn, iter_tensors

__all__ = [
    "DEFAULT_EFFICIENCY",
    "LAUNCH_S_PER_KERNEL",
    "OPTIMIZER_FLOPS_PER_PARAM",
    "Calibration",
    "Interconnect",
    "StepFlops",
    "StepTime",
    "count_step_flops",
    "peak_flops",
    "step_time",
    "tokens_per_sample",
]

DEFAULT_EFFICIENCY = 0.40
LAUNCH_S_PER_KERNEL = {"cuda": 5e-6, "rocm": 5e-6, "mps": 10e-6}  # host time per eager operator
# elementwise FLOPs per parameter of one update (read off the update rules): SGD 2, with momentum 4;
# Adam/AdamW ~12 (two moment updates, bias corrections, sqrt, divide, weight decay, add)
OPTIMIZER_FLOPS_PER_PARAM = {"SGD": 4, "Adam": 12, "AdamW": 12, "Adagrad": 6, "RMSprop": 8}
_DEFAULT_OPTIMIZER_FLOPS = 12
_PEAK_KEY = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}

# per-GPU, one-direction link bandwidth inside a node, GB/s (NVLink: the datasheet total ÷ 2)
_NVLINK_GBPS = {
    "a100-40gb": 300.0,  # NVLink 3, 600 GB/s
    "a100-80gb": 300.0,
    "h100-sxm": 450.0,  # NVLink 4, 900 GB/s
    "h200": 450.0,
    "v100-16gb": 150.0,  # NVLink 2, 300 GB/s
    "v100-32gb": 150.0,
    "mi300x": 448.0,  # Infinity Fabric, 7 x 128 GB/s
}
_PCIE_GBPS = 32.0  # PCIe 4.0 x16, one direction
# per-GPU inter-node bandwidth, GB/s: one 400 Gb/s NDR link per GPU (DGX H100, AWS p5) else 200 Gb/s HDR
_INTER_NODE_GBPS = {"h100-sxm": 50.0, "h200": 50.0, "mi300x": 50.0}
_INTER_NODE_DEFAULT_GBPS = 25.0


def peak_flops(device: DeviceSpec, precision: str) -> float | None:
    """Dense peak FLOP/s of ``device`` for the matmul dtype of ``precision`` (``None``: not in the catalog).

    ``32-true`` counts at the fp32 (CUDA-core) rate: TF32 is opt-in in PyTorch.
    """
    value = device.peak_tflops.get(_PEAK_KEY.get(precision, "fp32"))
    return float(value) * 1e12 if value else None


@dataclass(frozen=True)
class Interconnect:
    """The links that data parallelism communicates over (``None``: the default for the device).

    Defaults: NVLink inside a node where the part has it (per GPU, one direction: A100 300 GB/s,
    H100/H200 450 GB/s, V100 150 GB/s, MI300X 448 GB/s), else PCIe 4.0 x16 (32 GB/s); 8 GPUs per node;
    between nodes one 400 Gb/s link per GPU on H100/H200/MI300X (50 GB/s), 200 Gb/s (25 GB/s) on
    others. Peak link rates: a collective reaches less, so communication is on the optimistic side.
    """

    gpus_per_node: int = 8
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int):
            raise ConfigurationError(f"`Interconnect(gpus_per_node={self.gpus_per_node!r})` must be an int")
        if self.gpus_per_node < 1:
            raise ConfigurationError(f"`Interconnect(gpus_per_node={self.gpus_per_node!r})` must be >= 1")
        for name in ("intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ConfigurationError(f"`Interconnect({name}={value!r})` must be a number > 0 or None")

    def links(self, device: DeviceSpec) -> tuple[float, float]:
        """``(intra-node, inter-node)`` GB/s per GPU for ``device``."""
        intra = self.intra_node_gbps or _NVLINK_GBPS.get(device.name, _PCIE_GBPS)
        inter = self.inter_node_gbps or _INTER_NODE_GBPS.get(device.name, _INTER_NODE_DEFAULT_GBPS)
        return float(intra), float(inter)

    def describe(self, device: DeviceSpec) -> str:
        intra, inter = self.links(device)
        return (
            f"{self.gpus_per_node} GPUs/node, {intra:g} GB/s in a node, {inter:g} GB/s per GPU between nodes"
        )

    def collective_s(self, device: DeviceSpec, gpus: int, payload_bytes: float, factor: float) -> float:
        """Seconds for a ring collective moving ``factor (N-1)/N × payload`` per rank (hierarchical)."""
        if gpus <= 1 or payload_bytes <= 0:
            return 0.0
        intra, inter = self.links(device)
        local = min(gpus, self.gpus_per_node)
        nodes = math.ceil(gpus / self.gpus_per_node)
        seconds = factor * (local - 1) / local * payload_bytes / (intra * 1e9)
        if nodes > 1:
            seconds += factor * (nodes - 1) / nodes * (payload_bytes / local) / (inter * 1e9)
        return seconds


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of the training step per sample, counted on fake tensors (precision does not change them).

    Attributes:
        forward_per_sample / backward_per_sample: of the whole step's loss, per sample.
        module_forward_per_sample: forward FLOPs per sample of every named submodule (``""``: the model).
        optimizer_per_step: the elementwise update of all trainable parameters, once per step.
        trainable_parameters: number of trainable parameters.
        kernels_per_micro_step: operators launched by one forward + backward (views excluded).
    """

    forward_per_sample: float
    backward_per_sample: float
    module_forward_per_sample: Mapping[str, float] = field(default_factory=dict, repr=False)
    optimizer_per_step: float = 0.0
    trainable_parameters: int = 0
    kernels_per_micro_step: int = 0

    def recompute_per_sample(self, checkpointed_modules: tuple[str, ...] | list[str]) -> float:
        """Forward FLOPs run again in backward for the checkpointed modules (nested names once)."""
        names = sorted(set(checkpointed_modules))
        outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
        return sum(self.module_forward_per_sample.get(n, 0.0) for n in outer)

    def step(self, samples: int, checkpointed_modules: tuple[str, ...] | list[str] = ()) -> float:
        """FLOPs of an optimizer step over ``samples`` samples on one rank."""
        per_sample = self.forward_per_sample + self.backward_per_sample
        per_sample += self.recompute_per_sample(checkpointed_modules)
        return samples * per_sample + self.optimizer_per_step


def count_step_flops(
    model: nn.Module, optimizer: Any, batch: Any, loss_fn: LossFn | None = None
) -> StepFlops:
    """Count one step's FLOPs on fake tensors: forward and backward separately, and per module.

    The model, batch and RNG are untouched (a copy of the model on fake tensors runs).

    Example:
        >>> f = count_step_flops(torch.nn.Linear(4, 2), torch.optim.SGD, torch.randn(8, 4),
        ...                      lambda m, b: m(b).sum())
        >>> f.forward_per_sample, f.backward_per_sample
        (16.0, 16.0)
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from resource_guard.estimate.trace.fake_world import fake_copy

    samples = batch_size_of(batch) or 1
    forward: dict[str, float] = {}
    with torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=False):
        fake_model, fake_batch = fake_copy(model, batch)
        ops = _OpCounter()
        with FlopCounterMode(display=False) as fwd, ops:
            handles = [
                _time_module(name, module, fwd, forward) for name, module in fake_model.named_modules()
            ]
            try:
                loss = call_loss_fn(fake_model, fake_batch, loss_fn)
            finally:
                for pre, post in handles:
                    pre.remove()
                    post.remove()
        with FlopCounterMode(display=False) as bwd, ops:
            if loss.requires_grad:
                loss.backward()
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    kind = optimizer if isinstance(optimizer, type) else type(optimizer)
    per_param = OPTIMIZER_FLOPS_PER_PARAM.get(getattr(kind, "__name__", ""), _DEFAULT_OPTIMIZER_FLOPS)
    return StepFlops(
        forward_per_sample=float(fwd.get_total_flops()) / samples,
        backward_per_sample=float(bwd.get_total_flops()) / samples,
        module_forward_per_sample={k: v / samples for k, v in forward.items()},
        optimizer_per_step=float(per_param * trainable),
        trainable_parameters=trainable,
        kernels_per_micro_step=ops.count,
    )


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators that launch work (views, ``prim`` and metadata-only ops excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        launches = getattr(func, "namespace", "") == "aten" and not getattr(func, "is_view", False)
        if launches and func.__name__.split(".")[0] not in _NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


_NO_KERNEL = frozenset(
    {"detach", "empty", "empty_like", "empty_strided", "lift_fresh", "sym_size", "sym_stride"}
)


def _time_module(name: str, module: nn.Module, counter: Any, out: dict[str, float]) -> tuple[Any, Any]:
    """Hooks adding the counter's growth over ``module``'s forward to ``out[name]``."""
    start: list[float] = []

    def pre(*_: Any) -> None:
        start.append(float(counter.get_total_flops()))

    def post(*_: Any) -> None:
        if start:
            out[name] = out.get(name, 0.0) + float(counter.get_total_flops()) - start.pop()

    return module.register_forward_pre_hook(pre), module.register_forward_hook(post)


def tokens_per_sample(batch: Any) -> int | None:
    """Tokens per sample: the second dimension of the first 2-D integer tensor (token ids), else None."""
    for t in iter_tensors(batch):
        if t.dim() == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return int(t.shape[1])
    return None


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's time on one rank, in parts (seconds)."""

    step_s: float
    compute_s: float
    memory_s: float
    comm_s: float
    flops: float
    bytes_moved: float
    comm_bytes: float
    efficiency: float
    launch_s: float = 0.0

    @property
    def bound(self) -> str:
        """``"compute"``, ``"memory"``, ``"launch"`` or ``"communication"``: the largest part."""
        parts = {"compute": self.compute_s, "memory": self.memory_s, "launch": self.launch_s}
        parts["communication"] = self.comm_s
        return max(parts, key=lambda k: parts[k])


def step_time(
    device: DeviceSpec,
    precision: str,
    *,
    flops: float,
    bytes_moved: float,
    efficiency: float = DEFAULT_EFFICIENCY,
    achieved_flops_per_s: float | None = None,
    comm_bytes: float = 0.0,
    comm_factor: float = 2.0,
    gpus: int = 1,
    interconnect: Interconnect | None = None,
    kernels: float = 0.0,
) -> StepTime:
    """The step-time model of the module docstring for ``flops`` and ``bytes_moved`` per rank.

    ``achieved_flops_per_s`` (a calibration on this very device) replaces peak × efficiency and the
    launch bound (a measured step includes its launches). ``kernels``: operators launched per step.

    Raises:
        ConfigurationError: the device has no peak for ``precision`` and no calibration is given.
    """
    rate = achieved_flops_per_s
    if rate is None:
        peak = peak_flops(device, precision)
        if peak is None:
            raise ConfigurationError(
                f"{device.name} has no peak TFLOP/s for {precision} in the catalog: add `peak_tflops` to a "
                "catalog file, or calibrate with a run monitored on it"
            )
        rate = peak * efficiency
    compute = flops / rate
    bandwidth = device.memory_bandwidth_gbps
    memory = bytes_moved / (bandwidth * 1e9) if bandwidth else 0.0
    comm = (interconnect or Interconnect()).collective_s(device, gpus, comm_bytes, comm_factor)
    eff = rate / peak if (peak := peak_flops(device, precision)) else efficiency
    launch = 0.0 if achieved_flops_per_s is not None else kernels * LAUNCH_S_PER_KERNEL.get(device.kind, 0.0)
    step = max(compute, memory, launch) + comm
    return StepTime(step, compute, memory, comm, flops, bytes_moved, comm_bytes, eff, launch)


@dataclass(frozen=True)
class Calibration:
    """Measured throughput of a monitored run, which replaces the assumed efficiency.

    Attributes:
        device: the catalog name of the device measured (``"cpu"`` for the host).
        precision: the run's precision.
        achieved_flops_per_s: model FLOPs per second the run reached (FLOPs per step ÷ step time).
        source: where it came from (a report path, ``"measured"``).
    """

    device: str
    precision: str
    achieved_flops_per_s: float
    source: str = "measured"

    def __post_init__(self) -> None:
        parse_precision(self.precision)
        rate = self.achieved_flops_per_s
        if not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
            raise ConfigurationError(f"`Calibration(achieved_flops_per_s={rate!r})` must be a number > 0")

    @classmethod
    def from_step(
        cls, device: str, precision: str, *, step_s: float, flops_per_step: float, source: str = "measured"
    ) -> Calibration:
        """From one measured step time and the FLOPs of that step."""
        if not step_s > 0 or not flops_per_step > 0:
            raise ConfigurationError(
                f"`Calibration.from_step(step_s={step_s!r}, flops_per_step={flops_per_step!r})`: "
                "both must be > 0"
            )
        return cls(device, precision, flops_per_step / step_s, source)

    @classmethod
    def from_report(cls, report: str | Path | Mapping[str, Any], catalog: Catalog) -> Calibration:
        """From a monitored run's report: ``report.json`` of ``resource-guard report LOGDIR`` (the file,
        or the log dir holding it), or the dict of ``guard``/``ResourceGuard``'s ``report.to_dict()``."""
        if isinstance(report, Mapping):
            file, summary = "the run's report", report.get("summary") or {}
        else:
            file, summary = _read_summary(Path(report))
        step_s, flops = summary.get("step_time_s"), summary.get("flops_per_step")
        if not step_s or not flops:
            raise ConfigurationError(
                f"{file} has no step time and FLOPs per step to calibrate with (FLOPs are counted when "
                "guard is given a loss_fn, or by the Lightning callback)"
            )
        kind, name = summary.get("device_kind", "cpu"), summary.get("device_name") or ""
        match = None if kind == "cpu" else catalog.match_hardware_name(name, summary.get("capacity_bytes"))
        device = "cpu" if kind == "cpu" else (match.name if match else name)
        precision = summary.get("precision") or "32-true"  # FLOPs per step are per rank, as the MFU's
        return cls.from_step(device, precision, step_s=step_s, flops_per_step=flops, source=file)

    def efficiency(self, catalog: Catalog) -> float | None:
        """The measured share of the device's peak, ``None`` where the catalog has no peak (a CPU)."""
        if self.device not in catalog:
            return None
        peak = peak_flops(catalog.get(self.device), self.precision)
        return None if peak is None else min(1.0, self.achieved_flops_per_s / peak)


def _read_summary(path: Path) -> tuple[str, Mapping[str, Any]]:
    """``(where, summary)`` of the newest ``report.json`` at ``path`` (a file or a log dir)."""
    file = path
    if path.is_dir():
        found = sorted(path.rglob("report.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigurationError(f"no report.json in {str(path)!r} to calibrate with")
        file = found[-1]
    try:
        summary = json.loads(file.read_text(encoding="utf-8")).get("summary") or {}
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigurationError(f"cannot read the run report {str(file)!r}: {exc}") from None
    return str(file), summary
