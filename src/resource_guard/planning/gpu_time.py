"""The per-operator step-time model on a GPU of the catalog: the CPU model's trace, a GPU's kernels.

The operators are those :func:`~resource_guard.planning.op_time.count_step_ops` lists from the memory
estimate's fake trace, traced for the target (autocast's CUDA policy, the flash attention kernel, the
optimizer's ``foreach`` path). Each one's GPU time comes from the catalog's peak FLOP/s for its dtype and
memory bandwidth, scaled by an efficiency that depends on the operator's class and size. None of the
constants below is fitted to a benchmark; each is a published figure or a property of the hardware:

- **matmul** (and convolution, as an implicit GEMM): ``flops ÷ (peak × ceiling × waves × depth)``, and
  never faster than its bytes ÷ bandwidth. ``ceiling`` is what cuBLAS reaches on large GEMMs:
  :data:`MATMUL_CEILING` (A100 bf16 ~250 TFLOP/s of 312; H100 SXM ~700-750 of 989: NVIDIA's cuBLAS 12
  blog "Matrix multiplication performance on Hopper", CUTLASS's published profiler results).
  ``waves`` is the wave quantization of NVIDIA's "Matrix Multiplication Background User's Guide": the
  output is cut into 128×128 tiles, one per SM at a time, and a last partial wave leaves SMs idle
  (tiles ÷ (waves × SMs); :data:`SM_COUNT` from the architecture whitepapers). ``depth`` = k ÷ (k + 128):
  each tile's main loop over k pays a prologue and epilogue of about one 128-deep block (why the same
  guide's throughput climbs with k). So a small matmul is far from peak, a large one near the ceiling.
- **attention** (flash): the same, with the kernel's own ceiling per direction and architecture
  (:data:`ATTENTION_CEILING`: FlashAttention-2, Dao 2023, arXiv 2307.08691: forward up to 73% of the
  A100's peak, backward ~55-60%; on the H100 FlashAttention-2 reaches ~35%, FlashAttention-3 paper, Shah
  et al. 2024, arXiv 2407.08608), tiles of 128 queries per batch × head, and the depth of the key loop
  (a causal query row sees half the keys on average). Causal FLOPs are the half the kernel computes.
- **everything else** (elementwise, norms, softmax, casts, copies, embeddings, the optimizer): its bytes
  ÷ (bandwidth × :data:`BANDWIDTH_EFFICIENCY`, 0.8: streaming kernels reach 85-92% of the datasheet on
  BabelStream/STREAM on A100 and H100; PyTorch's generic kernels somewhat less).
- **every kernel** lasts at least :data:`KERNEL_FLOOR_S` (3 µs: launch latency and the ramp of a
  short grid), and the host launches each operator in :data:`~resource_guard.planning.steptime.
  LAUNCH_S_PER_KERNEL` (5 µs on CUDA): the GPU runs asynchronously, so a micro-step takes the larger
  of its kernels' sum and its launches' sum.

A step of ``k`` micro-steps is ``k × micro-step + (k − 1) × accumulation + optimizer`` as on the CPU
(:class:`~resource_guard.planning.op_time.StepTimePrediction`); a sharded optimizer updates 1/N.
Communication (:func:`exposed_comm_s`) runs beside the compute it can hide behind (FSDP prefetches the
next unit's parameters during this one's compute and reduce-scatters a unit's gradients during the
backward of the next; DDP all-reduces gradient buckets during the backward): only what exceeds that
compute shows, and never less than one unit's share (the first gather and the last reduce wait).

Example:
    >>> from resource_guard.devices import load_catalog
    >>> a100 = GpuOpModel(load_catalog().get("a100-40gb"))
    >>> big = a100.matmul_efficiency((1, 8192, 8192, 8192), torch.bfloat16)
    >>> small = a100.matmul_efficiency((1, 256, 256, 256), torch.bfloat16)
    >>> round(big, 2), small < big / 5
    (0.79, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from resource_guard.devices import DeviceSpec
from resource_guard.errors import ConfigurationError
from resource_guard.planning.op_time import (
    OP_CLASSES,
    OpWork,
    StepOps,
    StepTimePrediction,
    count_step_ops,
)
from resource_guard.planning.steptime import LAUNCH_S_PER_KERNEL, StepTime

__all__ = [
    "ATTENTION_CEILING",
    "BANDWIDTH_EFFICIENCY",
    "KERNEL_FLOOR_S",
    "MATMUL_CEILING",
    "SM_COUNT",
    "GpuOpModel",
    "exposed_comm_s",
    "gpu_step_time",
]

# share of the dense peak that large GEMMs reach with cuBLAS, by compute-capability major version
# (8: A100 ~250 of 312 TFLOP/s bf16; 9: H100 SXM ~700-750 of 989; others: a conservative 0.7)
MATMUL_CEILING = {"8": 0.80, "9": 0.75}
_MATMUL_CEILING_OTHER = 0.70
# flash attention's share of the dense peak at long sequences (forward, backward) by kernel and major
# version. "flash2" (FlashAttention-2, PyTorch's SDPA flash kernel since 2.2): A100 forward up to 73%,
# backward ~55% (Dao 2023); H100 ~35% overall, an Ampere kernel without Hopper's wgmma/TMA (Shah et al.
# 2024). "flash1" (flash-attn 1.x, FlashAttention-1): A100 forward 30-50%, backward 25-35% (Dao 2023,
# introduction); on the H100 the same Ampere code loses what FlashAttention-2 loses there (about half).
ATTENTION_CEILING = {
    "flash2": {"8": (0.70, 0.55), "9": (0.40, 0.32)},
    "flash1": {"8": (0.40, 0.30), "9": (0.20, 0.15)},
}
_ATTENTION_CEILING_OTHER = {"flash2": (0.50, 0.40), "flash1": (0.30, 0.22)}
BANDWIDTH_EFFICIENCY = 0.80
KERNEL_FLOOR_S = 3e-6
_TILE = 128  # a GEMM's output tile (and flash attention's query block), rows and columns
_DEPTH = 128  # the k (keys) a tile's prologue and epilogue cost, about one pipelined block
# streaming multiprocessors (NVIDIA) / compute units (AMD), architecture whitepapers and datasheets
SM_COUNT = {
    "a100-40gb": 108,
    "a100-80gb": 108,
    "h100-sxm": 132,
    "h100-pcie": 114,
    "h200": 132,
    "rtx-4090": 128,
    "rtx-3090": 82,
    "t4": 40,
    "l4": 58,
    "a10g": 80,
    "a10": 72,
    "l40s": 142,
    "v100-16gb": 80,
    "v100-32gb": 80,
    "mi300x": 304,
    "mi250x": 220,
}
_PEAK_KEY = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_MATMUL_LIKE = ("matmul", "conv", "attention")


class GpuOpModel:
    """Time the traced operators of a step on ``device`` (a CUDA/ROCm entry of the catalog).

    Args:
        device: the catalog spec; it needs ``peak_tflops`` and ``memory_bandwidth_gbps``.
        attention_kernel: ``"flash2"`` (PyTorch's SDPA) or ``"flash1"`` (flash-attn 1.x, as 2023's
            MPT code ran).

    Raises:
        ConfigurationError: not a GPU, or no bandwidth / fp32 peak in the catalog.
    """

    def __init__(self, device: DeviceSpec, *, attention_kernel: str = "flash2") -> None:
        if attention_kernel not in ATTENTION_CEILING:
            raise ConfigurationError(
                f"`GpuOpModel(attention_kernel={attention_kernel!r})` must be one of "
                f"{tuple(ATTENTION_CEILING)}"
            )
        if device.kind not in ("cuda", "rocm"):
            raise ConfigurationError(
                f"`GpuOpModel({device.name!r})`: a CUDA or ROCm device, not {device.kind}"
            )
        if not device.memory_bandwidth_gbps or not device.peak_tflops.get("fp32"):
            raise ConfigurationError(
                f"`GpuOpModel({device.name!r})`: the catalog entry needs memory_bandwidth_gbps and "
                "peak_tflops (fp32 at least)"
            )
        self.device = device
        major = (device.compute_capability or "").split(".")[0]
        self.matmul_ceiling = MATMUL_CEILING.get(major, _MATMUL_CEILING_OTHER)
        self.attention_kernel = attention_kernel
        self.attention_ceiling = ATTENTION_CEILING[attention_kernel].get(
            major, _ATTENTION_CEILING_OTHER[attention_kernel]
        )
        self.sm_count = SM_COUNT.get(device.name)
        self.bandwidth = float(device.memory_bandwidth_gbps) * 1e9 * BANDWIDTH_EFFICIENCY
        self.launch_s = LAUNCH_S_PER_KERNEL.get(device.kind, 0.0)

    # -- efficiencies --------------------------------------------------------------------------------
    def peak(self, dtype: torch.dtype) -> float:
        """Dense peak FLOP/s of a matmul in ``dtype`` (fp32: the CUDA-core rate; TF32 is opt-in)."""
        tflops = self.device.peak_tflops
        value = tflops.get(_PEAK_KEY.get(dtype, "fp32")) or tflops["fp32"]
        return float(value) * 1e12

    def _waves(self, tiles: int) -> float:
        if not self.sm_count or tiles <= 0:
            return 1.0
        return tiles / (math.ceil(tiles / self.sm_count) * self.sm_count)

    def matmul_efficiency(self, shape: tuple[int, ...], dtype: torch.dtype) -> float:
        """Share of the peak a GEMM of ``(batch, m, n, k)`` reaches (see the module docstring)."""
        ceiling = self.matmul_ceiling if dtype in _PEAK_KEY else 1.0  # fp32 CUDA cores: no tensor path
        if len(shape) != 4:
            return ceiling
        batch, m, n, k = shape
        tiles = batch * math.ceil(m / _TILE) * math.ceil(n / _TILE)
        return ceiling * self._waves(tiles) * k / (k + _DEPTH)

    def attention_efficiency(self, shape: tuple[int, ...], backward: bool, causal: bool) -> float:
        """Share of the peak of a flash attention over ``(batch × heads, queries, keys, head size)``."""
        ceiling = self.attention_ceiling[1 if backward else 0]
        if len(shape) != 4:
            return ceiling
        heads, queries, keys, _ = shape
        seen = keys / 2 if causal else keys  # the keys a query block loops over, on average
        return ceiling * self._waves(heads * math.ceil(queries / _TILE)) * seen / (seen + _DEPTH)

    # -- operators -----------------------------------------------------------------------------------
    def kernel_s(self, w: OpWork) -> float:
        """GPU time of one operator: the larger of its FLOPs at its efficiency and its bytes, at least
        :data:`KERNEL_FLOOR_S`; views take none."""
        if w.op_class == "view" or w.name in ("detach", "alias", "lift_fresh", "sym_size"):
            return 0.0
        memory = w.bytes / self.bandwidth
        compute = 0.0
        if w.op_class == "attention" and w.flops:
            causal = _causal_share(w) < 1.0
            compute = w.flops / (
                self.peak(w.dtype) * self.attention_efficiency(w.shape, w.variant == "backward", causal)
            )
        elif w.op_class in ("matmul", "conv") and w.flops:
            if w.variant == "rnn":  # sequential time steps, each a small GEMM and a kernel
                per_step = (
                    w.flops / max(w.steps, 1) / (self.peak(w.dtype) * self.matmul_efficiency((), w.dtype))
                )
                return w.steps * max(per_step, KERNEL_FLOOR_S) + memory
            compute = w.flops / (self.peak(w.dtype) * self.matmul_efficiency(w.shape, w.dtype))
        return max(compute, memory, KERNEL_FLOOR_S)

    def predict_ops(self, ops: StepOps) -> StepTimePrediction:
        """Time counted operators: per micro-step the larger of the kernels and the host's launches."""
        by_class = dict.fromkeys(OP_CLASSES, 0.0)
        launches = 0
        for w in ops.micro_step:
            by_class[w.op_class] += self.kernel_s(w)
            launches += w.op_class != "view"
        host = launches * self.launch_s
        kernels = sum(by_class.values())
        by_class["framework"] += max(host - kernels, 0.0)  # the GPU waits for the host
        optimizer = sum(self.kernel_s(w) for w in ops.optimizer)
        optimizer = max(optimizer, sum(w.op_class != "view" for w in ops.optimizer) * self.launch_s)
        return StepTimePrediction(
            micro_step_s=sum(by_class.values()),
            optimizer_s=optimizer,
            micro_step_by_class_s=by_class,
            # each later micro-step adds its gradients to the earlier ones: one more read, at bandwidth
            accumulate_s=ops.gradient_bytes / self.bandwidth,
            flops_per_micro_step=sum(w.flops for w in ops.micro_step if w.op_class in _MATMUL_LIKE),
            bytes_per_micro_step=sum(w.bytes for w in ops.micro_step),
            ops_per_micro_step=len(ops.micro_step),
        )

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
        """Predict one micro-step of ``batch`` and the (unsharded) optimizer's update on this GPU."""
        return self.predict_ops(self.trace(model, optimizer, batch, loss_fn, precision, checkpoint_every))

    def trace(
        self,
        model: nn.Module,
        optimizer: Any,
        batch: Any,
        loss_fn: Any = None,
        precision: str = "32-true",
        checkpoint_every: int = 0,
    ) -> StepOps:
        """The step's operators as this GPU runs them (traced on fake tensors for this target)."""
        return count_step_ops(
            model,
            optimizer,
            batch,
            loss_fn,
            precision=precision,
            checkpoint_every=checkpoint_every,
            device=self.device,
        )

    def describe(self) -> Mapping[str, Any]:
        """The constants in use, for a report."""
        return {
            "device": self.device.name,
            "matmul_ceiling": self.matmul_ceiling,
            "attention_kernel": self.attention_kernel,
            "attention_ceiling": self.attention_ceiling,
            "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
            "sm_count": self.sm_count,
            "kernel_floor_s": KERNEL_FLOOR_S,
            "launch_s": self.launch_s,
        }


def exposed_comm_s(comm_s: float, overlap_s: float, units: int = 1) -> float:
    """The communication a step waits for: ``comm_s`` beyond the ``overlap_s`` of compute beside it,
    and at least one of ``units`` equal parts (``units=1``: nothing overlaps).

    Example:
        >>> exposed_comm_s(1.0, 3.0, units=10), exposed_comm_s(5.0, 3.0, units=10), exposed_comm_s(1.0, 3.0)
        (0.1, 2.0, 1.0)
    """
    if comm_s <= 0:
        return 0.0
    return max(comm_s - overlap_s, comm_s / max(units, 1))


def gpu_step_time(
    prediction: StepTimePrediction,
    *,
    peak_flops: float,
    accumulation_steps: int = 1,
    optimizer_share: float = 1.0,
    comm_s: float = 0.0,
    comm_bytes: float = 0.0,
    comm_overlap: str = "none",
    units: int = 1,
    flops: float | None = None,
) -> StepTime:
    """One optimizer step on one rank from a GPU micro-step prediction, in the parts of ``StepTime``.

    Args:
        prediction: :meth:`GpuOpModel.predict` of one micro-step (the unsharded optimizer's update).
        peak_flops: the dense peak of the step's matmul dtype (for ``efficiency``, the FLOPs' share).
        accumulation_steps: micro-steps per optimizer step.
        optimizer_share: the share of the update this rank runs (1/N under a sharded strategy).
        comm_s: the collectives' time per optimizer step on this rank, were nothing overlapped.
        comm_overlap: ``"none"``; ``"fsdp"`` (beside every micro-step's compute); ``"ddp"`` (beside
            the last micro-step's backward, 2/3 of its compute).
        units: the parts communication is cut into (FSDP units, DDP buckets).
        flops: the step's FLOPs as reported (default: the traced matmuls', attention's and
            convolutions' of ``accumulation_steps`` micro-steps); ``efficiency`` is their share of the peak.
    """
    k = accumulation_steps
    by_class = prediction.micro_step_by_class_s
    compute = k * sum(by_class.get(c, 0.0) for c in _MATMUL_LIKE)
    waits = k * by_class.get("framework", 0.0)  # the GPU idle while the host launches
    optimizer = prediction.optimizer_s * optimizer_share
    memory = k * prediction.micro_step_s - compute - waits + (k - 1) * prediction.accumulate_s + optimizer
    launch = k * prediction.micro_step_s if waits > 0 else 0.0  # host-bound: the launches are the step
    overlap = {"fsdp": k * prediction.micro_step_s, "ddp": prediction.micro_step_s * 2 / 3}.get(
        comm_overlap, 0.0
    )
    comm = exposed_comm_s(comm_s, overlap, units if comm_overlap in ("fsdp", "ddp") else 1)
    step = prediction.step_s(k) - prediction.optimizer_s + optimizer + comm
    flops = k * prediction.flops_per_micro_step if flops is None else flops
    return StepTime(
        step_s=step,
        compute_s=compute,
        memory_s=memory,
        comm_s=comm,
        flops=flops,
        bytes_moved=float(k * prediction.bytes_per_micro_step),
        comm_bytes=comm_bytes,
        efficiency=flops / (step * peak_flops) if step > 0 and peak_flops > 0 else 0.0,
        launch_s=launch,
    )


def _causal_share(w: OpWork) -> float:
    """1.0 for a full attention; 0.5 where the counted FLOPs are the causal half (read off the shape)."""
    if len(w.shape) != 4 or not w.flops:
        return 1.0
    heads, queries, keys, size = w.shape
    full = 4.0 * heads * queries * keys * size * (2.5 if w.variant == "backward" else 1.0)
    return 0.5 if w.flops < 0.75 * full else 1.0
