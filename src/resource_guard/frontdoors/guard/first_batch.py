"""The guard's first batch (or ``sample_batch``), the run's ``first_batch`` event under ``g.iterate``:
planned on it, the plan applied, the evaluation to come pre-flighted, the shape guard, the stepper and
the monitor set up (the parts: :mod:`.setup`, :mod:`.observed`'s precision and outputs rules)."""

from __future__ import annotations

from typing import Any

from torch import nn

from resource_guard.errors import ConfigurationError, DoesNotFitError, warn_at_user
from resource_guard.frontdoors.guard.batches import MicroBatches
from resource_guard.frontdoors.guard.observed import loop_precision, outputs_as_kept, own_precision
from resource_guard.frontdoors.guard.setup import flops_per_sample, make_plan, prepare_model
from resource_guard.frontdoors.guard.stepper import Stepper
from resource_guard.step.training import LossFn, StandInLoss, batch_size_of

__all__ = ["plan_first_batch", "start_shapes"]


def plan_first_batch(g: Any, batch: Any, loader: Any = None) -> None:
    """The guard ``g``'s first batch (or ``sample_batch``): the run planned on it, the plan applied to the
    model and optimizer state (device, precision, checkpointing, the GradScaler), the evaluation to come
    pre-flighted, the shape guard and the stepper set up, then the monitor."""
    if g._recording:  # g.iterate / sample_batch= with several optimizers: the guard runs the step
        from resource_guard.estimate.user_step import check_optimizers

        check_optimizers(g.model, list(g.optimizers), g.loss_fn, "guard")
    loss_fn = g.loss_fn if g.loss_fn is not None else StandInLoss()  # several: a UserStep
    loss_fn = outputs_as_kept(loss_fn, g._keep_outputs)
    own = g._plan_kwargs["precision"] is None

    def preflight() -> list[int]:
        target = g._target if g._target is not None else batch_size_of(batch)
        if target is None:
            from resource_guard.frontdoors.guard.batch_dim import infer_batch_dim

            said = infer_batch_dim(g.model)[1]
            raise ConfigurationError(
                "cannot tell the batch size of the sample batch (its tensors do not share dim 0)"
                + (f"; the model says why: {said}" if said else "")
                + ". `g.iterate` cuts batches along dim 0: give it batch-first batches, or leave a "
                "sequence-first loop unchanged under `with guard(model, optimizer, batch_dim=1):`."
            )
        g._target = target
        kwargs = g._plan_kwargs
        if own:  # numerics by consent: the loop's own precision unless precision= says otherwise
            kwargs = {**kwargs, "precision": loop_precision(g.model, "cpu")}
        g.plan, g.device = make_plan(g.model, g._planned_optimizers, batch, loss_fn, target, kwargs)
        return []

    # every rank plans its own first batch; under torch.distributed the ranks then agree (one collective,
    # frontdoors/run.py): a rank whose step does not fit stops every rank before step 0
    agreed = g._run.preflight(preflight, 0)
    if agreed.error is not None:
        raise agreed.error
    target = g._target
    if own:
        g.plan = own_precision(g.plan, "the loop's own (its parameters' dtype)")
    if g._eval_sample is not None:  # the evaluation to come, before any step
        g._preflight_eval(g._eval_sample, later=True)
    if g._monitor_on:  # model FLOPs, before checkpointing adds its recomputation
        g._flops_per_sample = flops_per_sample(g.model, batch, loss_fn, g._planned_optimizers)
    prepared = prepare_model(g.model, g.optimizers, g.plan, g.device)
    g._ckpt, g._scaler = prepared.checkpointing, prepared.scaler
    if g._worst[2]:  # the shape guard; the worst case known before any step (it may split)
        start_shapes(g, batch, loss_fn, loader)
    g._stepper = Stepper(g.optimizers, target, g._scaler, g._clip)
    g._micro = MicroBatches(g._shapes, len(g.optimizers) > 1)
    if g._monitor_on:
        monitor = g._start_monitor(g._shapes)
        g._stepper.clock = g._clock = monitor.phases if monitor is not None else None


def start_shapes(
    g: Any, batch: Any, loss_fn: LossFn, loader: Any, *, model: nn.Module | None = None,
    whole_batches: bool = False,
) -> None:  # fmt: skip
    """The shape guard of the guard ``g``'s plan (``model``: the module the plan traced, the guard's by
    default; ``whole_batches``: an unchanged loop, whose batches are never split)."""
    from resource_guard.frontdoors.shape_guard import start_shape_guard

    assert g.plan is not None
    try:
        g._shapes, notes = start_shape_guard(
            model if model is not None else g.model, g.optimizer, batch, loss_fn, g.plan,
            *g._worst[:2], loader=loader, whole_batches=whole_batches,
        )  # fmt: skip
    except DoesNotFitError:
        raise
    except Exception as error:  # our check never stops the run
        warn_at_user(f"resource_guard: the shape check is off: {error!r}")
        notes = []
    g.plan = g._with_reasons(*notes)
