"""The guard's batch loop helpers: device moves, and the micro-batch size of each batch (the plan's,
or the shape guard's for that batch's shape).

Example:
    >>> import torch
    >>> batch = (torch.zeros(4, 2), torch.zeros(4))
    >>> to_device(batch, torch.device("cpu"), False) is batch  # already there: nothing rebuilt
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch

from resource_guard.observe.growth import batch_signature
from resource_guard.observe.loader_settings import loader_settings
from resource_guard.step.batching import split_batch
from resource_guard.step.training import batch_size_of, map_tensors

__all__ = ["MicroBatches", "expect_steps", "iterate_batches", "to_device"]


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """``batch`` with its tensors on ``device`` (a flat batch already there is returned as is)."""
    parts = batch.values() if type(batch) is dict else batch if type(batch) in (tuple, list) else None
    if parts is not None and all(isinstance(t, torch.Tensor) and t.device == device for t in parts):
        return batch  # a flat batch already there: nothing to rebuild
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


def expect_steps(monitor: Any, loader: Iterable[Any]) -> None:
    """The monitor's step count at the end of this pass over ``loader`` (the report's ETA), if sized."""
    if monitor is not None and isinstance(loader, Sized):
        with contextlib.suppress(TypeError):  # a loader whose len() is undefined
            monitor.total_steps = monitor.steps + len(loader)


class MicroBatches:
    """The micro-batch size for each batch, and its rows, looked up by the batch's signature once seen.

    Args:
        shapes: the :class:`~resource_guard.frontdoors.shape_guard.ShapeGuard`, or ``None``.
        several: the loop has several optimizers: its own step takes the whole batch, and a batch that
            would not fit stops the run before it (``DoesNotFitError``) instead of being split.
    """

    def __init__(self, shapes: Any, several: bool) -> None:
        self.shapes, self.several = shapes, several
        self._rows_by_signature: dict[Any, int | None] = {}

    def size_for(self, batch: Any, planned: int) -> int:
        """The micro-batch for this batch's shape (one dict lookup once seen); ``planned``: the plan's."""
        if self.shapes is None:
            return planned
        if self.several:
            self.shapes.stop_if_too_big(batch)
            return planned
        return int(self.shapes.micro_batch_size(batch))

    def rows(self, batch: Any) -> int | None:
        """``batch_size_of(batch)``, looked up by the batch's signature (shapes and dtypes) once seen."""
        signature = batch_signature(batch)
        if signature is None:
            return batch_size_of(batch)
        rows = self._rows_by_signature.get(signature, -1)
        if rows == -1:
            rows = batch_size_of(batch)
            if len(self._rows_by_signature) < 4096:
                self._rows_by_signature[signature] = rows
        return rows


def iterate_batches(g: Any, loader: Iterable[Any]) -> Iterator[Any]:
    """The guard ``g``'s batch loop (:meth:`~resource_guard.frontdoors.guard.context.Guard.iterate`):
    the data wait timed inside the loader's ``__next__``, the first batch planning the run, each batch
    moved to the device and yielded as micro-batches of the planned size (the shape guard's for its
    shape), one monitor step per batch, and a partial effective batch stepped at the end."""
    non_blocking = bool(getattr(loader, "pin_memory", False))
    expect_steps(g._run.monitor, loader)
    batches = iter(loader)
    while True:
        clock = g._clock
        if clock is not None:  # the data wait: the loader's own __next__, nothing else
            clock.switch("data_wait")
        try:
            batch = next(batches)
        except StopIteration:
            break
        if clock is not None:
            clock.switch("other")
        if g.plan is None:
            g._setup(batch, loader)
            expect_steps(g._run.monitor, loader)
            g._run.call("set_loader_info", loader_settings(loader))  # the advice reads them
        monitor = g._run.monitor
        if g._flops_per_sample is not None and monitor is not None:
            # the monitor's step is one loader batch: MFU from the FLOPs of that many samples
            monitor.flops_per_step = g._flops_per_sample * (batch_size_of(batch) or 1)
            g._flops_per_sample = None
        g._run.call("batch_ready", batch)
        device, micro, plan = g.device, g._micro, g.plan
        assert device is not None and micro is not None and plan is not None
        moved = to_device(batch, device, non_blocking)
        micro_size = micro.size_for(moved, plan.micro_batch_size)
        rows = micro.rows(moved)
        if rows is not None and rows <= micro_size:  # the hot path: no slicing
            g._current_micro = rows
            yield g._forward(moved)
            g._resumed()
        else:
            for part in split_batch(moved, micro_size):
                g._current_micro = batch_size_of(part) or 1
                yield g._forward(part)
                g._resumed()
        if len(g.optimizers) > 1 and g._scaler is not None:
            g._scaler.update()  # once per batch, after every optimizer stepped
        g._run.call("step_end")
    if g._clock is not None:
        g._clock.switch("other")
    if g._stepper is not None and g._stepper.pending:
        g._stepper.finish_partial_step()
        if g._clock is not None:
            g._clock.switch("other")
