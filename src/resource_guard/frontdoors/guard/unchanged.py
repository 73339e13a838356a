"""The zero-change door: a plain loop left as written under ``with guard(model, optimizer):``.

:class:`~resource_guard.frontdoors.guard.observed.LoopWatch` hooks the model and the optimizers; this
module translates what it sees into the run's events, as the other doors translate their framework's:

- the first training forward, before it runs: the step pre-flighted as the loop runs it
  (``DoesNotFitError`` stops it), the shape guard for later forwards, then the monitor;
- with several optimizers and no ``UserStep`` (a GAN's loop), the end of the first step: that step,
  recorded and replayed on fake tensors, planned before the next forward;
- a closure optimizer's first loss, and the first forward on gradients kept (the loop's own
  accumulation): the plan refitted with what the loop holds, a line for the report.

Nothing is moved or changed: the loop's device, precision and batch run as written.
"""

from __future__ import annotations

from typing import Any

from resource_guard.frontdoors.guard.first_batch import start_shapes
from resource_guard.frontdoors.guard.observed import LoopWatch
from resource_guard.frontdoors.guard.setup import flops_per_sample

__all__ = ["UNCHANGED", "watch_unchanged"]

UNCHANGED = (
    "unchanged loop: observed through hooks; nothing applied (the loop's device, precision and batch run "
    "as written); to let the guard apply a plan, loop with `g.iterate` and `g.backward`"
)
_MANUAL = (
    "manual updates (`optimizer=None`): planned as an in-place update with no optimizer state, the "
    "gradients freed before the next forward (`model.zero_grad()`); a step is counted at each training "
    "forward that follows a backward"
)


def watch_unchanged(g: Any) -> LoopWatch:
    """The hooks on the guard ``g``'s model and optimizers, installed, their events translated."""
    events = _Events(g)
    watch = LoopWatch(
        g.model,
        g.optimizers,
        events.first_forward,
        events.gradients_kept,
        events.closure_loss,
        record=events.first_step if g._recording else None,
    )
    events.watch = watch
    watch.install()
    return watch


class _Events:
    """The watch's events, for the guard ``g``: each sets what the guard's own planning sets."""

    def __init__(self, g: Any) -> None:
        self.g = g
        self.watch: LoopWatch | None = None

    def first_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The first training forward, before it runs: pre-flighted as the loop runs it."""
        from resource_guard.frontdoors.guard.observed import forward_batch, plan_as_run

        g, watch = self.g, self.watch
        assert watch is not None
        made: list[Any] = []

        def preflight() -> list[int]:
            made[:] = plan_as_run(
                g.model, g._planned_optimizers, args, kwargs, g.loss_fn, g._plan_kwargs, g._keep_outputs,
                g._batch_dim,
            )  # fmt: skip
            return []

        agreed = g._run.preflight(preflight, 0)  # under torch.distributed: every rank stops, or none
        if agreed.error is not None:
            raise agreed.error
        g.plan, g.device, loss, dim = made
        watch.batch_dim = dim
        g._target = g.plan.target_batch_size
        batch, traced = forward_batch(args, kwargs), g.model
        if dim:  # the batch-first view the plan traced
            from resource_guard.frontdoors.guard.batch_dim import BatchFirstView, to_batch_first

            traced, batch = BatchFirstView(g.model, dim, batch), to_batch_first(batch, dim)
        if g._worst[2]:  # check_shapes: a later forward of a larger shape is refused before it runs
            # the watch's own hooks are quiet here; the loop runs each batch whole
            start_shapes(g, batch, loss, None, model=traced, whole_batches=True)
            watch.shapes = g._shapes
        g.plan = g._with_reasons(UNCHANGED, *(() if g.optimizers else (_MANUAL,)))
        if g._monitor_on:  # FLOPs per sample of what the plan traced
            self._monitor(flops_per_sample(traced, batch, loss, g._planned_optimizers))

    def first_step(self, recorder: Any) -> None:
        """The first step of a loop with several optimizers ended: that step, replayed on fake tensors,
        planned (``DoesNotFitError`` stops the loop before its next forward)."""
        from resource_guard.frontdoors.guard.observed import plan_recorded

        g = self.g
        made: list[Any] = []

        def preflight() -> list[int]:
            made[:] = plan_recorded(g.model, g.optimizers, recorder, g._plan_kwargs)
            return []

        agreed = g._run.preflight(preflight, 0)  # under torch.distributed: every rank stops, or none
        if agreed.error is not None:
            raise agreed.error
        g.plan, g.device, step = made
        g._target = g.plan.target_batch_size
        if g._monitor_on:
            from resource_guard.estimate.user_step import UserStep
            from resource_guard.frontdoors.guard.recorded import replay_step

            once = UserStep(replay_step(recorder.events, passes=1))
            self._monitor(flops_per_sample(g.model, tuple(recorder.fresh), once, g.optimizers))

    def _monitor(self, per_sample: float | None) -> None:
        g, watch = self.g, self.watch
        assert watch is not None
        monitor = g._start_monitor(None)
        g._clock = monitor.phases if monitor is not None else None
        watch.monitor, watch.clock, watch.flops_per_sample = monitor, g._clock, per_sample

    def closure_loss(self, loss_bytes: int) -> None:
        """The closure returned its loss: the step refitted with the losses it holds."""
        from resource_guard.frontdoors.guard.observed import closure_loss_plan

        g = self.g
        if g.plan is not None:
            g.plan, line = closure_loss_plan(g.plan, loss_bytes)
            g._run.note(line)

    def gradients_kept(self, forward: int) -> None:
        """The first forward on gradients kept: its later micro-steps' peak, refitted."""
        from resource_guard.frontdoors.guard.observed import gradients_kept_plan

        g = self.g
        if g.plan is not None:
            g.plan, line = gradients_kept_plan(g.plan, forward)
            g._run.note(line)
