"""Measure the real memory of one training step on the CPU with torch.profiler's memory records.

This is the ground truth the estimator is checked against (DESIGN.md, "ground truth"): tensor sizes
are the same on every device, and the CPU allocator reports every allocation and free exactly.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resource_guard.estimate.host.quiet import quiet_profile
from resource_guard.estimate.trace.attached import attached_tensors
from resource_guard.estimate.trace.sparse import is_sparse, sparse_parts
from resource_guard.step.precision import autocast_context, parse_precision
from resource_guard.step.training import LossFn, call_loss_fn, iter_tensors, training_step

__all__ = ["MeasuredStep", "allocation_deltas", "live_bytes", "measure_training_step", "peak_of"]


@dataclass(frozen=True)
class MeasuredStep:
    """What one real step used.

    Attributes:
        peak_bytes: peak live tensor bytes during the step (persistent state included).
        start_bytes: bytes live when the step began: parameters, buffers, optimizer state, batch.
        peak_delta_bytes: the most the step added on top of ``start_bytes``.
        allocations: number of allocations the profiler recorded in the step.
    """

    peak_bytes: int
    start_bytes: int
    peak_delta_bytes: int
    allocations: int


def live_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages behind the tensors in ``objects`` (modules, optimizers, batches);
    a module's include the tensors it holds outside its parameters and buffers; of a DTensor, this
    rank's local shard; of a sparse tensor (a sparse gradient), its indices and values."""
    seen: dict[int, int] = {}
    for obj in objects:
        if isinstance(obj, nn.Module):
            tensors: list[torch.Tensor] = [*obj.parameters(), *obj.buffers()]
            tensors += [p.grad for p in obj.parameters() if p.grad is not None]
            tensors += [a.tensor for a in attached_tensors(obj)]  # e.g. a quantized weight's scales
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = [v for st in obj.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        else:
            tensors = iter_tensors(obj)
        for t in [p for whole in tensors for p in (sparse_parts(whole) if is_sparse(whole) else (whole,))]:
            to_local = getattr(t, "to_local", None)
            if callable(to_local):  # a DTensor (FSDP2): this rank's shard
                t = to_local()
            st = t.untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


_MARK = "resource_guard::measured_step"


def _mark_time_ns(prof: torch.profiler.profile) -> int:
    """When the record ``_MARK`` began: where the measured step starts in a longer profile."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.name == _MARK:
            return int(node.start_time_ns)
        stack.extend(node.children)
    raise RuntimeError(f"the profile holds no {_MARK!r} record")


def allocation_deltas(prof: torch.profiler.profile) -> list[tuple[int, int]]:
    """``(time_ns, +bytes | -bytes)`` of every CPU allocation and free the profiler recorded, in order."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    return events


def peak_of(deltas: list[tuple[int, int]]) -> int:
    """The highest running total of ``(time_ns, +bytes | -bytes)`` deltas, starting from 0."""
    running = peak = 0
    for _, size in deltas:
        running += size
        peak = max(peak, running)
    return peak


def measure_training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    precision: str = "32-true",
    warmup_steps: int = 1,
    gradients_kept: bool = False,
    keep_outputs: bool = True,
) -> MeasuredStep:
    """Run ``warmup_steps`` real steps (so optimizer state exists), then measure one more.

    ``gradients_kept=True`` measures the last micro-step of gradient accumulation instead: one more
    forward and backward first leaves every gradient allocated, and the measured step adds into them
    (what ``MemoryEstimate.for_device(gradients_kept=True)`` predicts). ``keep_outputs``: as for
    :func:`~resource_guard.estimate.estimator.estimate_memory`.

    The model and optimizer are trained for real: pass throwaway copies. For ``*-true`` precisions the
    model must already be in that dtype.

    Example:
        >>> m = nn.Linear(8, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> r = measure_training_step(m, opt, torch.randn(4, 8), lambda m, b: m(b).sum())
        >>> r.peak_bytes >= r.start_bytes > 0
        True
    """
    spec = parse_precision(precision)
    scale = 2.0**16 if spec.loss_scaling else None
    keep = None if keep_outputs else False  # as estimate_memory(keep_outputs=...)
    model.train()
    for _ in range(warmup_steps):
        training_step(model, optimizer, batch, loss_fn, spec, "cpu", loss_scale=scale)

    def earlier_micro_step() -> None:  # forward and backward, no optimizer step
        with autocast_context(spec, "cpu"):
            loss = call_loss_fn(model, batch, loss_fn)
        (loss.float() * scale if scale is not None else loss).backward()
        del loss

    # a sparse gradient is replaced, not added into, by the next accumulation: the profiler reports
    # the free of its old storage only if it saw it allocated, so that micro-step runs profiled too
    sparse = gradients_kept and any(
        isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse for m in model.modules()
    )
    if gradients_kept and not sparse:
        earlier_micro_step()
    gc.collect()
    start = live_bytes(model, optimizer, batch)
    with quiet_profile() as prof:
        if sparse:
            earlier_micro_step()
            gc.collect()
            with torch.profiler.record_function(_MARK):
                pass
        training_step(model, optimizer, batch, loss_fn, spec, "cpu", loss_scale=scale, keep_outputs=keep)
    deltas = allocation_deltas(prof)
    if sparse:
        mark = _mark_time_ns(prof)
        before = sum(d for t, d in deltas if t < mark)
        deltas = [(t, d) for t, d in deltas if t >= mark]
        start += before
    peak = peak_of(deltas)
    return MeasuredStep(start + peak, start, peak, sum(1 for _, s in deltas if s > 0))
