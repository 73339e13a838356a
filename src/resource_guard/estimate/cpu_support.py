"""What this machine's CPU can run, probed once per process with tiny real kernels.

oneDNN chooses its CPU kernels by instruction set, so two things the estimator relies on differ
between x86-64 CPUs of the same kind (an AVX2-only AMD EPYC and an AVX-512 one):

- **Whether a kernel exists at all.** oneDNN's LSTM (``aten.mkldnn_rnn_layer``, which LSTMs take
  under autocast) has no bf16 kernel without AVX-512 and no fp16 kernel without native fp16: a real
  step raises "could not create a primitive descriptor for the LSTM forward propagation primitive".
  :func:`cpu_can_run` says so for an operator in a dtype; the estimator names such operators in
  :attr:`MemoryEstimate.cpu_unsupported` for a CPU target (the fake trace itself needs no kernel).
- **Whether reduced-precision GEMMs go through oneDNN**, which packs operands into scratch, or
  through ATen's own loop, which allocates nothing (and is slow: probing it per shape would cost
  minutes). :func:`reduced_gemm_packs` tells which.

Each answer runs a tiny real kernel (a 1-unit LSTM layer, a 64×64 matmul) rather than reading CPU
flags: the flags do not say what this torch build's oneDNN does with them, and ``ONEDNN_MAX_CPU_ISA``
caps it below the hardware (the tests use that to play an AVX2 CPU).

Example:
    >>> import torch
    >>> cpu_can_run("aten.mkldnn_rnn_layer", torch.float32).runs
    True
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from resource_guard.devices import cpu_summary
from resource_guard.estimate.measure import allocation_deltas
from resource_guard.estimate.quiet import quiet_profile

__all__ = ["CHECKED_OPS", "CpuKernelSupport", "cpu_can_run", "reduced_gemm_packs"]

_REDUCED = (torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class CpuKernelSupport:
    """Whether this CPU runs ``op`` in ``dtype``; if not, ``reason`` says why (the kernel's error)."""

    op: str
    dtype: torch.dtype
    runs: bool
    reason: str | None = None

    def describe(self) -> str:
        """``"aten.mkldnn_rnn_layer in bf16 (oneDNN's LSTM …)"`` — for warnings and skip reasons."""
        name = _DTYPE_NAMES.get(self.dtype, str(self.dtype).replace("torch.", ""))
        text = f"{self.op} in {name}"
        return text if self.runs else f"{text} ({self.reason})"


def _lstm_layer(dtype: torch.dtype) -> None:
    """A 1-unit, 1-step LSTM layer through oneDNN in ``dtype`` (forward, training mode)."""
    op = torch.ops.aten.mkldnn_rnn_layer.default
    mode_lstm, hidden, gates = 2, 1, 4

    def z(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    op(z(1, 1, 1), z(gates * hidden, 1), z(gates * hidden, hidden), z(gates * hidden), z(gates * hidden),
       z(1, hidden), z(1, hidden), False, [], mode_lstm, hidden, 1, True, False, False, True)  # fmt: skip


#: operators whose CPU kernel may not exist, by name, with the tiny kernel that tells (a backward
#: kernel is not listed: it runs only after its forward, which is)
_PROBES = {"aten.mkldnn_rnn_layer": _lstm_layer}
CHECKED_OPS = frozenset(_PROBES)
_HINTS = {
    ("aten.mkldnn_rnn_layer", torch.bfloat16): "oneDNN's bf16 LSTM needs AVX-512",
    ("aten.mkldnn_rnn_layer", torch.float16): "oneDNN's fp16 LSTM needs native fp16 (AVX512-FP16/AMX-FP16)",
}


@functools.cache
def cpu_can_run(op: str, dtype: torch.dtype) -> CpuKernelSupport:
    """Whether this CPU has a kernel for ``op`` (``"aten.mkldnn_rnn_layer"``) in ``dtype``; cached.

    Operators outside :data:`CHECKED_OPS` are assumed to run. Safe to call inside a fake-tensor trace:
    the probe runs on real tensors with every dispatch mode and autocast off.
    """
    probe = _PROBES.get(op)
    if probe is None or not hasattr(torch.ops.aten, op.removeprefix("aten.")):
        return CpuKernelSupport(op, dtype, True)
    try:
        with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
            probe(dtype)
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:160]
        hint = _HINTS.get((op, dtype))
        why = f"{hint}; this CPU: {cpu_summary()}" if hint else f"this CPU: {cpu_summary()}"
        return CpuKernelSupport(op, dtype, False, f"{why}; the kernel says: {first}")
    return CpuKernelSupport(op, dtype, True)


def reduced_gemm_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's ``dtype`` (bf16/fp16) matmuls go through oneDNN, which allocates packing scratch.

    Probed once with a 64×64×64 matmul under the profiler: any allocation besides the output is
    scratch. ``False`` means ATen's own loop, which allocates nothing (an AVX2 CPU in bf16, most CPUs
    in fp16). If the probe cannot run (another profiler is active), ``True``: the per-shape probes,
    or their rule of thumb, stand — and the next call probes again.
    """
    if dtype not in _REDUCED:
        return False
    try:
        return _reduced_gemm_packs(dtype)
    except RuntimeError:
        return True


@functools.cache
def _reduced_gemm_packs(dtype: torch.dtype) -> bool:
    with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
        a = torch.zeros(64, 64, dtype=dtype)
        with quiet_profile() as prof:
            torch.mm(a, a)
        allocated = [size for _, size in allocation_deltas(prof) if size > 0]
    return len(allocated) > 1  # the output, and scratch
