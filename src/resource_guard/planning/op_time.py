"""A per-operator step-time model on this CPU: FLOPs and bytes of every traced operator, calibrated.

The memory estimate runs the training step on fake tensors; :func:`count_step_ops` listens to that
same trace (:func:`~resource_guard.estimate.trace.tracer.observe_ops`) and gives every operator a class,
its FLOPs and its bytes moved:

- **matmul / conv / attention**: FLOPs by formula (``torch.utils.flop_counter``'s registry; the CPU's
  fused attention ``_scaled_dot_product_flash_attention_for_cpu`` by its two matmuls, its backward by
  five);
- **copy** (casts, clones, concatenations) and **elementwise / other**: the bytes of their inputs and
  outputs;
- **view** (metadata only): no work, only the dispatch overhead.

:func:`cpu_calibration` measures, once per CPU profile and thread count (cached for the process), this
CPU's matmul throughput per dtype at a few sizes (small matmuls are far from peak), its copy bandwidth
per dtype at a few sizes (cache-resident copies are faster), and the host time of one operator call.
An operator's time is then

- ``max(FLOPs / throughput(dtype, size), bytes / bandwidth) + overhead`` for matmul-like classes,
- ``bytes / bandwidth(dtype, size) + overhead`` for the others,

and a step of ``k`` accumulation micro-steps is ``k × (forward + backward) + optimizer`` (the
optimizer's code path as it runs on the CPU). The result is a :class:`StepTimePrediction`, by class.

Example:
    >>> import torch
    >>> model = OpTimeModel(cpu_calibration())
    >>> p = model.predict(torch.nn.Linear(64, 64), torch.optim.SGD(torch.nn.Linear(64, 64).parameters()),
    ...                   torch.randn(8, 64), lambda m, b: m(b).sum(), precision="32-true")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from resource_guard.devices import cpu_profile

__all__ = [
    "OP_CLASSES",
    "CpuCalibration",
    "OpTimeModel",
    "StepOps",
    "StepTimeModel",
    "StepTimePrediction",
    "classify_op",
    "count_step_ops",
    "cpu_calibration",
]

OP_CLASSES = ("matmul", "conv", "attention", "transcendental", "elementwise", "copy", "view")
_MATMUL_LIKE = ("matmul", "conv", "attention")
_CALIBRATED_DTYPES = (torch.float32, torch.bfloat16)
_MATMUL_SIZES = (64, 192, 512)  # n of an n×n×n matmul: 0.5, 14 and 268 MFLOP
_COPY_NUMELS = (2**14, 2**18, 2**22)  # 64 KiB, 1 MiB and 16 MiB of fp32
_COPY_NAMES = frozenset(
    {"_to_copy", "copy_", "clone", "contiguous", "cat", "stack", "_copy_from", "index_select", "gather"}
)
# elementwise operators bound by their arithmetic (exp, erf) rather than by memory on a CPU
_TRANSCENDENTAL = (
    "softmax", "gelu", "exp", "tanh", "sigmoid", "erf", "silu", "nll_loss", "layer_norm", "pow",
)  # fmt: skip
_NO_WORK = frozenset(
    {"detach", "alias", "_unsafe_view", "empty", "empty_like", "empty_strided", "lift_fresh", "sym_size"}
)


# -- counting ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpWork:
    """One traced operator: its class, FLOPs, bytes moved and the dtype it computes in.

    ``flops`` of a ``"transcendental"`` operator counts the elements of its largest input instead.
    """

    op_class: str
    flops: float
    bytes: int
    dtype: torch.dtype


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            seen.setdefault(id(t), t)
    return list(seen.values())


def _arg(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs.get(name, default) if a.kwarg_only or i >= len(args) else args[i]
    return default


def _registry_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float | None:
    """FLOPs from ``torch.utils.flop_counter``'s formulas (the registry FlopCounterMode uses), or None.

    The one place that reads the registry: ``tests/planning/test_op_time.py`` fails loudly if it moves.
    """
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return None
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that does not take this overload: counted by bytes
        return None


def _cpu_attention_flops(func: Any, args: tuple, kwargs: dict) -> float:
    """The CPU's fused attention: ``QKᵀ`` and ``PV`` forward (4·B·H·L·S·E), 2.5× that backward; causal ÷ 2."""
    backward = func.__name__.split(".")[0].endswith("_backward")
    q, k, v = (_arg(func, args, kwargs, n) for n in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return 0.0
    lead = math.prod(q.shape[:-2])
    forward = 2.0 * lead * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    causal = bool(_arg(func, args, kwargs, "is_causal", False))
    return forward * (2.5 if backward else 1.0) * (0.5 if causal else 1.0)


def classify_op(func: Any, args: tuple, kwargs: dict, out: Any) -> OpWork:
    """The class, FLOPs and bytes moved of one ATen operator call (fake or real tensors).

    Example:
        >>> a, b = torch.ones(4, 8), torch.ones(8, 2)
        >>> w = classify_op(torch.ops.aten.mm.default, (a, b), {}, a @ b)
        >>> w.op_class, w.flops, w.bytes
        ('matmul', 128.0, 224)
    """
    name = func.__name__.split(".")[0]
    ins, outs = _tensors((args, kwargs)), _tensors(out)
    dtype = next((t.dtype for t in (*outs, *ins) if t.is_floating_point()), torch.float32)
    if getattr(func, "is_view", False) or name in _NO_WORK:
        return OpWork("view", 0.0, 0, dtype)
    outs = [t for t in outs if all(t is not i for i in ins)]  # an in-place op's output is its input
    moved = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
    if name == "embedding":  # reads the rows it gathers, not the table
        moved = 2 * sum(map(_nbytes, outs)) + sum(_nbytes(t) for t in ins if not t.is_floating_point())
    if "attention" in name:
        flops = _registry_flops(func, args, kwargs, out)
        return OpWork("attention", flops if flops is not None else _cpu_attention_flops(func, args, kwargs),
                      moved, dtype)  # fmt: skip
    flops = _registry_flops(func, args, kwargs, out)
    if flops is not None:
        return OpWork("conv" if "conv" in name else "matmul", flops, moved, dtype)
    if any(t in name for t in _TRANSCENDENTAL):
        return OpWork("transcendental", float(max((t.numel() for t in ins), default=0)), moved, dtype)
    return OpWork("copy" if name in _COPY_NAMES else "elementwise", 0.0, moved, dtype)


@dataclass(frozen=True)
class StepOps:
    """The operators of one traced step: one micro-step's forward and backward, and the optimizer's."""

    micro_step: tuple[OpWork, ...]
    optimizer: tuple[OpWork, ...]


def count_step_ops(
    model: nn.Module,
    optimizer: Any,
    batch: Any,
    loss_fn: Any = None,
    *,
    precision: str = "32-true",
    checkpoint_every: int = 0,
) -> StepOps:
    """Trace one step on fake tensors (the memory estimate's trace, on the CPU) and list its operators.

    ``checkpoint_every``: 0 none, 1 every block, k every k-th block (the recompute is traced).
    """
    from resource_guard.estimate.estimator import estimate_memory
    from resource_guard.estimate.trace.tracer import observe_ops
    from resource_guard.planning.checkpointing import apply_checkpointing

    seen: list[tuple[str, OpWork]] = []

    def observe(phase: str, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        root = phase.split(":")[0]
        if root in ("forward", "backward", "optimizer"):
            seen.append((phase, classify_op(func, args, kwargs, out)))

    handle = apply_checkpointing(model, every=checkpoint_every) if checkpoint_every else None
    try:
        with observe_ops(observe):
            estimate_memory(model, optimizer, batch, loss_fn, device="cpu", precision=precision)
    finally:
        if handle is not None:
            handle.remove()
    variants = {p for p, _ in seen if p.startswith("optimizer:")}
    # the code path the CPU runs: a for-loop unless the optimizer's settings fix it ("as-set")
    path = "optimizer:as-set" if "optimizer:as-set" in variants else "optimizer:for-loop"
    micro = tuple(w for p, w in seen if p.split(":")[0] in ("forward", "backward"))
    return StepOps(micro, tuple(w for p, w in seen if p == path))


# -- calibration ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuCalibration:
    """This CPU's measured speeds (``cpu_calibration``).

    Attributes:
        matmul_flops_per_s: per dtype name, ``(flops of the matmul, FLOP/s)`` points, smallest first.
        copy_bytes_per_s: per dtype name, ``(bytes moved, bytes/s)`` points, smallest first.
        op_overhead_s: host time of one small operator call (dispatch, allocation).
        attention_flops_per_s: per dtype name, FLOP/s of the CPU's fused causal attention, forward and
            backward together (far below a plain matmul's).
        transcendental_per_s: per dtype name, elements/s of ``log_softmax`` forward and backward (exp, log:
            bound by arithmetic, not memory).
        view_overhead_s: host time of one view (no kernel).
        threads: ``torch.get_num_threads()`` when measured.
        calibration_s: how long the measurement took.
    """

    matmul_flops_per_s: Mapping[str, tuple[tuple[float, float], ...]]
    copy_bytes_per_s: Mapping[str, tuple[tuple[float, float], ...]]
    op_overhead_s: float
    view_overhead_s: float
    attention_flops_per_s: Mapping[str, float] = field(default_factory=dict)
    transcendental_per_s: Mapping[str, float] = field(default_factory=dict)
    threads: int = 1
    calibration_s: float = 0.0

    def matmul_rate(self, dtype: torch.dtype, flops: float) -> float:
        """FLOP/s of a matmul of ``flops`` in ``dtype`` (interpolated in log size; fp32's if not measured)."""
        points = self.matmul_flops_per_s.get(str(dtype)) or self.matmul_flops_per_s["torch.float32"]
        return _interpolate(points, flops)

    def bandwidth(self, dtype: torch.dtype, nbytes: float) -> float:
        """Bytes/s of an elementwise pass over ``nbytes`` in ``dtype``."""
        points = self.copy_bytes_per_s.get(str(dtype)) or self.copy_bytes_per_s["torch.float32"]
        return _interpolate(points, nbytes)


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + f * (y1 - y0)
    return points[-1][1]


def _median_s(fn: Callable[[], Any], timer: Callable[[], float], reps: int, rounds: int = 3) -> float:
    """Median over ``rounds`` of the mean time of ``reps`` calls."""
    fn()  # warm-up: first-call allocation and kernel selection
    times = []
    for _ in range(rounds):
        start = timer()
        for _ in range(reps):
            fn()
        times.append((timer() - start) / reps)
    return max(statistics.median(times), 1e-12)


def _attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def _softmax_step(x: torch.Tensor) -> None:
    torch.log_softmax(x, dim=-1).sum().backward()


def measure_cpu(timer: Callable[[], float] = time.perf_counter) -> CpuCalibration:
    """Measure this CPU now (a few matmuls and copies per dtype; ~0.2 s). ``timer``: for tests."""
    started = timer()
    matmul: dict[str, tuple[tuple[float, float], ...]] = {}
    copies: dict[str, tuple[tuple[float, float], ...]] = {}
    with torch.no_grad():
        for dtype in _CALIBRATED_DTYPES:
            points = []
            for n in _MATMUL_SIZES:
                a, b = torch.ones(n, n, dtype=dtype), torch.ones(n, n, dtype=dtype)
                flops = 2.0 * n**3
                points.append(
                    (flops, flops / _median_s(functools.partial(torch.mm, a, b), timer, 2 if n > 256 else 8))
                )
            matmul[str(dtype)] = tuple(points)
            points = []
            for numel in _COPY_NUMELS:
                x = torch.ones(numel, dtype=dtype)
                moved = 2.0 * numel * x.element_size()  # read and write
                points.append(
                    (
                        moved,
                        moved / _median_s(functools.partial(x.mul, 2.0), timer, 2 if numel > 2**20 else 8),
                    )
                )
            copies[str(dtype)] = tuple(points)
    attention: dict[str, float] = {}
    transcendental: dict[str, float] = {}
    for dtype in _CALIBRATED_DTYPES:
        q, k, v = (torch.ones(1, 4, 128, 64, dtype=dtype, requires_grad=True) for _ in range(3))

        flops = 3.5 * 0.5 * 2.0 * 4 * 128 * 128 * (64 + 64)  # forward + 2.5× backward, causal
        attention[str(dtype)] = flops / _median_s(functools.partial(_attention_step, q, k, v), timer, 2)
        x = torch.ones(256, 1024, dtype=dtype, requires_grad=True)

        transcendental[str(dtype)] = (
            2.0 * x.numel() / _median_s(functools.partial(_softmax_step, x), timer, 2)
        )
    with torch.no_grad():
        tiny = torch.ones(4)
        overhead = _median_s(lambda: torch.add(tiny, tiny), timer, 200)
        view = _median_s(lambda: tiny.view(2, 2), timer, 200)
    return CpuCalibration(
        matmul_flops_per_s=matmul,
        copy_bytes_per_s=copies,
        op_overhead_s=overhead,
        view_overhead_s=view,
        attention_flops_per_s=attention,
        transcendental_per_s=transcendental,
        threads=torch.get_num_threads(),
        calibration_s=timer() - started,
    )


_CACHE: dict[tuple[Any, int], CpuCalibration] = {}
_LOCK = threading.Lock()


def cpu_calibration(*, timer: Callable[[], float] | None = None, refresh: bool = False) -> CpuCalibration:
    """This CPU's calibration, measured once per CPU profile and thread count in this process.

    Example:
        >>> cal = cpu_calibration()
        >>> cal is cpu_calibration()
        True
    """
    key = (cpu_profile(), torch.get_num_threads())
    with _LOCK:
        if refresh or key not in _CACHE:
            _CACHE[key] = measure_cpu(timer or time.perf_counter)
        return _CACHE[key]


# -- prediction -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTimePrediction:
    """Predicted time of one step, by operator class.

    Attributes:
        micro_step_s: one micro-step's forward and backward.
        optimizer_s: the optimizer's update, once per step.
        micro_step_by_class_s: ``micro_step_s`` split by :data:`OP_CLASSES`.
        flops_per_micro_step / bytes_per_micro_step: what the micro-step's operators compute and move.
        ops_per_micro_step: operators in a micro-step (views included).
    """

    micro_step_s: float
    optimizer_s: float
    micro_step_by_class_s: Mapping[str, float] = field(default_factory=dict)
    flops_per_micro_step: float = 0.0
    bytes_per_micro_step: int = 0
    ops_per_micro_step: int = 0

    def step_s(self, accumulation_steps: int = 1) -> float:
        """An optimizer step of ``accumulation_steps`` micro-steps."""
        return accumulation_steps * self.micro_step_s + self.optimizer_s

    def describe(self, accumulation_steps: int = 1) -> str:
        """``"41.2 ms/step: matmul 60%, elementwise 25%, …"``."""
        total = sum(self.micro_step_by_class_s.values()) or 1.0
        parts = sorted(self.micro_step_by_class_s.items(), key=lambda kv: -kv[1])
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in parts if v / total >= 0.05)
        return f"{self.step_s(accumulation_steps) * 1e3:,.1f} ms/step ({shares})"


class StepTimeModel(Protocol):
    """What the planner asks of a step-time model (:class:`OpTimeModel`, or a test's stand-in)."""

    def predict(
        self,
        model: nn.Module,
        optimizer: Any,
        batch: Any,
        loss_fn: Any,
        *,
        precision: str,
        checkpoint_every: int,
    ) -> StepTimePrediction: ...


def _op_seconds(w: OpWork, cal: CpuCalibration) -> float:
    if w.op_class == "view":
        return cal.view_overhead_s
    memory = w.bytes / cal.bandwidth(w.dtype, w.bytes) if w.bytes else 0.0
    if w.op_class == "attention" and w.flops and cal.attention_flops_per_s:
        rate = cal.attention_flops_per_s.get(str(w.dtype)) or cal.attention_flops_per_s["torch.float32"]
        return max(w.flops / rate, memory) + cal.op_overhead_s
    if w.op_class == "transcendental" and cal.transcendental_per_s:
        rate = cal.transcendental_per_s.get(str(w.dtype)) or cal.transcendental_per_s["torch.float32"]
        return max(w.flops / rate, memory) + cal.op_overhead_s
    if w.op_class in _MATMUL_LIKE and w.flops:
        return max(w.flops / cal.matmul_rate(w.dtype, w.flops), memory) + cal.op_overhead_s
    return memory + cal.op_overhead_s


def predict_ops(ops: StepOps, cal: CpuCalibration) -> StepTimePrediction:
    """Time the counted operators with a calibration."""
    by_class = dict.fromkeys(OP_CLASSES, 0.0)
    for w in ops.micro_step:
        by_class[w.op_class] += _op_seconds(w, cal)
    return StepTimePrediction(
        micro_step_s=sum(by_class.values()),
        optimizer_s=sum(_op_seconds(w, cal) for w in ops.optimizer),
        micro_step_by_class_s=by_class,
        flops_per_micro_step=sum(w.flops for w in ops.micro_step if w.op_class in _MATMUL_LIKE),
        bytes_per_micro_step=sum(w.bytes for w in ops.micro_step),
        ops_per_micro_step=len(ops.micro_step),
    )


class OpTimeModel:
    """The per-operator step-time model on this CPU (see the module docstring).

    Args:
        calibration: the CPU's speeds (default: :func:`cpu_calibration`, measured on first use).
    """

    def __init__(self, calibration: CpuCalibration | None = None) -> None:
        if calibration is not None and not isinstance(calibration, CpuCalibration):
            raise TypeError(
                f"`OpTimeModel(calibration={calibration!r})` must be a CpuCalibration (`cpu_calibration()`)"
            )
        self._calibration = calibration

    @property
    def calibration(self) -> CpuCalibration:
        if self._calibration is None:
            self._calibration = cpu_calibration()
        return self._calibration

    def predict(
        self,
        model: nn.Module,
        optimizer: Any,
        batch: Any,
        loss_fn: Any = None,
        *,
        precision: str = "32-true",
        checkpoint_every: int = 0,
    ) -> StepTimePrediction:
        """Predict one step of ``batch`` (one micro-step) and the optimizer's update on this CPU."""
        ops = count_step_ops(
            model, optimizer, batch, loss_fn, precision=precision, checkpoint_every=checkpoint_every
        )
        return predict_ops(ops, self.calibration)
