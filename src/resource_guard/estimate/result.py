"""The result of an estimate: :class:`MemoryEstimate`, one steady-state training step's memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resource_guard.devices import DeviceSpec
from resource_guard.estimate.allocation.allocator import DeviceFit, device_fit

__all__ = ["ANALYTIC", "METHODS", "MemoryEstimate", "TRACED", "TRACED_RECOVERED"]

TRACED = "traced"
"""Every operator of the step ran on fake tensors (or on the batch's real shadow values): exact for the
traced device's kernels."""
TRACED_RECOVERED = "traced-recovered"
"""Traced, but some operators' outputs were computed another way (a corrected fake rule, the real
kernel on zero tensors, an assumed value); ``recovered_ops`` says which and how."""
ANALYTIC = "analytic"
"""The step could not be traced: a count from shapes alone, meant as an upper bound (``warnings``
says why the trace failed and what the bound covers)."""
METHODS = (TRACED, TRACED_RECOVERED, ANALYTIC)


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory of one steady-state training step.

    Attributes:
        peak_bytes: peak live tensor bytes in the step on the target device kind (what
            ``torch.cuda.max_memory_allocated`` reports on a GPU, before allocator rounding).
        breakdown: bytes by category at the peak (keys: ``CATEGORIES``).
        method: how the estimate was obtained, one of :data:`METHODS`: ``"traced"``,
            ``"traced-recovered"`` (see ``recovered_ops``) or ``"analytic"`` (``warnings`` says why).
            Before 0.2 a traced estimate said ``"trace"``; test ``est.traced`` to accept both kinds of trace.
        precision: the Lightning precision name the step was estimated under.
        device_kind: the kind of device whose behaviour was assumed (``"cuda"``, ``"cpu"``, ...).
        peak_phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"zero_grad"``.
        peak_op: the operator at which the peak was reached.
        batch_size: the batch's leading dimension, when it could be told.
        parameter_count / trainable_parameter_count: distinct parameters (tied weights once).
        persistent_bytes: bytes that stay between steps (parameters, buffers, optimizer state).
        phase_peak_bytes: the peak of each phase, and of each optimizer code path traced.
        warnings: what was assumed or could not be traced.
        timeline: ``(phase, bytes by category)`` over the step, at most ~2000 points.
        allocations: the step's allocation events ``(id, +bytes | -bytes)`` on the target's code path,
            for the caching-allocator model of :meth:`for_device`; ``initial_allocations`` holds
            ``(id, bytes)`` of the storages alive when the step began; ``gradient_allocations`` the
            gradients alive when ``zero_grad`` began, ``(id, n)``: accumulated into ``.grad`` after the
            first ``n`` events (``-1``: not known); ``sparse_gradient_allocations`` the sparse ones among
            them, ``(id of the values, bytes)``: what the next micro-step's accumulation allocates
            (old and new rows concatenated, indices and values).
        trace_seconds: time the estimate took.
        assumed_target: the device behaviour the step was traced as, stated in every summary:
            ``"as on cuda sm80 (a100-40gb), bf16-mixed, autocast policy: cuda, attention: flash×24"``.
        cpu_unsupported: for a CPU target, the step's calls this machine's CPU was probed to fail, each
            probed as the step makes it (e.g. ``"nn.LSTM in fp32 under bf16 autocast, training
            (oneDNN's bf16 LSTM needs AVX-512; …)"``; :mod:`~resource_guard.estimate.host.cpu_support`): a
            real step here would fail; ``warnings`` says so too. Empty when the CPU runs the step.
        cpu_unknown: for a CPU target, the step's operators whose kernel may be missing on some CPU and
            that no probe could answer (e.g. a direct ``torch.lstm`` call); ``warnings`` says so too.
        recovered_ops: for ``"traced-recovered"``: one line per operator and way it was recovered,
            e.g. ``"`_grouped_mm`: a corrected fake rule (12x)"``.
    """

    peak_bytes: int
    breakdown: Mapping[str, int]
    method: str
    precision: str
    device_kind: str
    peak_phase: str | None = None
    peak_op: str | None = None
    batch_size: int | None = None
    parameter_count: int = 0
    trainable_parameter_count: int = 0
    persistent_bytes: int = 0
    phase_peak_bytes: Mapping[str, int] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    timeline: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), repr=False)
    allocations: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    initial_allocations: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    gradient_allocations: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    sparse_gradient_allocations: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    trace_seconds: float = 0.0
    assumed_target: str = ""
    cpu_unsupported: tuple[str, ...] = ()
    cpu_unknown: tuple[str, ...] = ()
    recovered_ops: tuple[str, ...] = ()

    @property
    def traced(self) -> bool:
        """True when the step was traced (``"traced"`` or ``"traced-recovered"``), not counted."""
        return self.method in (TRACED, TRACED_RECOVERED)

    @property
    def method_line(self) -> str:
        """One line naming how the estimate was obtained, for the CLI, the report and TensorBoard.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from resource_guard import estimate_memory
            >>> estimate_memory(nn.Linear(4, 2), torch.optim.SGD, torch.randn(8, 4),
            ...                 lambda m, b: m(b).sum()).method_line
            'method: traced (every operator of the step ran on fake tensors)'
        """
        if self.method == TRACED:
            return "method: traced (every operator of the step ran on fake tensors)"
        if self.method == TRACED_RECOVERED:
            ops = "; ".join(self.recovered_ops) or "see warnings"
            return f"method: traced-recovered ({len(self.recovered_ops)} operator(s) recovered: {ops})"
        if self.method == ANALYTIC:
            why = self.warnings[0] if self.warnings else "the step could not be traced"
            return f"method: analytic upper bound from shapes, not a trace ({why})"
        return f"method: {self.method}"

    def for_device(
        self,
        device: str | DeviceSpec = "auto",
        *,
        headroom: float = 0.1,
        catalog: Any = None,
        gradients_kept: bool = False,
    ) -> DeviceFit:
        """What ``device`` would show for this step: allocator rounding, context, workspace, fit.

        ``gradients_kept=True``: for a later step that starts with the gradients allocated (micro-steps
        2..k of gradient accumulation, ``zero_grad(set_to_none=False)``).

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from resource_guard import estimate_memory
            >>> est = estimate_memory(nn.Linear(4, 2), torch.optim.SGD, torch.randn(8, 4),
            ...                       lambda m, b: m(b).sum())
            >>> est.for_device("a100-40gb").fits
            True
        """
        return device_fit(self, device, headroom=headroom, catalog=catalog, gradients_kept=gradients_kept)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (no timeline or allocation events)."""
        return {
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "method": self.method,
            "precision": self.precision,
            "device_kind": self.device_kind,
            "peak_phase": self.peak_phase,
            "peak_op": self.peak_op,
            "batch_size": self.batch_size,
            "parameter_count": self.parameter_count,
            "trainable_parameter_count": self.trainable_parameter_count,
            "persistent_bytes": self.persistent_bytes,
            "phase_peak_bytes": dict(self.phase_peak_bytes),
            "warnings": list(self.warnings),
            "recovered_ops": list(self.recovered_ops),
            "trace_seconds": round(self.trace_seconds, 3),
            "assumed_target": self.assumed_target,
            "cpu_unsupported": list(self.cpu_unsupported),
            "cpu_unknown": list(self.cpu_unknown),
        }
