"""The shape guard (:mod:`resource_guard.frontdoors.shape_guard`) in a Lightning run.

Two calls from the :class:`~resource_guard.ResourceGuard` callback: :func:`worst_case_of` (the batch to
plan on: the run's largest when it is knowable, since Lightning cannot split a batch) and
:func:`start_shapes` (the per-batch check, over the decisions applied).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.seed import isolate_rng

from resource_guard.errors import warn_at_user
from resource_guard.frontdoors.lightning.apply import Decisions, detached_trainer, training_step_loss
from resource_guard.frontdoors.lightning.internals import drop_train_dataloader

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["start_shapes", "worst_case_of"]


def worst_case_of(callback: Any, trainer: pl.Trainer, batch: Any) -> Any:
    """The batch to plan on: the run's worst case when it is knowable (declared on the callback, else
    the train loader's declared longest sequence, a bounded look), else ``batch``. A run that cannot
    split a batch must plan for its largest one."""
    from resource_guard.frontdoors.shape_guard import worst_case

    callback._worst_source = None
    if not callback.check_shapes:
        return batch
    loader = None
    if callback.max_seq_len is None and callback.worst_case_batch is None:
        with isolate_rng(include_cuda=False):
            trainer.fit_loop.setup_data()
            loader = trainer.train_dataloader
            drop_train_dataloader(trainer)
    found = worst_case(batch, callback.max_seq_len, callback.worst_case_batch, loader)
    if found is None:
        return batch
    callback._worst_source = found[1]
    return trainer.strategy.batch_to_device(found[0], dataloader_idx=0)


def start_shapes(
    callback: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, d: Decisions
) -> list[str]:
    """Start the callback's shape guard over the applied decisions; the lines for the plan's log.

    A failure to start it warns and leaves it off, on every rank alike (one collective), so that no
    rank waits in a per-batch agreement the others do not join.
    """
    from resource_guard.frontdoors.shape_guard import agree_min, start_shape_guard
    from resource_guard.planning.planner import Plan
    from resource_guard.planning.worst_case import describe_signature, signature_of

    callback._shapes = None
    made, batch = callback.plan, callback._planned_on
    if not callback.check_shapes or not isinstance(made, Plan) or batch is None:
        return []  # off, or no plan made here (a resumed run re-applies stored decisions)
    try:
        mine = (made.micro_batch_size, made.accumulation_steps, made.precision, made.checkpointing)
        view = dataclasses.replace(
            made, micro_batch_size=d.micro_batch_size, accumulation_steps=d.accumulation_steps,
            precision=d.precision, checkpointing=d.checkpointing, checkpoint_every=int(d.checkpointing),
        )  # fmt: skip
        agreed = (d.micro_batch_size, d.accumulation_steps, d.precision, d.checkpointing)
        optimizer, step = _step_of(trainer, pl_module)
        shapes, _ = start_shape_guard(
            pl_module, optimizer, batch, step, view, traced_plan=mine == agreed,
            trace_context=lambda: detached_trainer(pl_module),
        )  # fmt: skip
    except Exception as error:  # our check never stops the run
        warn_at_user(f"ResourceGuard: the shape check is off: {error!r}")
        shapes = None
    if trainer.world_size > 1 and agree_min(int(shapes is not None)) == 0:
        return []
    callback._shapes = shapes
    if shapes is None:
        return []
    notes = ["shape guard: each batch is checked before it runs; one that would not fit stops the run"]
    if callback._worst_source is not None:
        shape = describe_signature(signature_of(batch))
        notes.append(f"planned for the run's largest batch, {shape} ({callback._worst_source})")
    return notes


def _step_of(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[Any, Any]:
    """The optimizer(s) and the step the plan traced: the first optimizer and ``training_step``'s loss
    under automatic optimization; every optimizer and the module's own step under manual optimization."""
    if pl_module.automatic_optimization:
        return trainer.optimizers[0], training_step_loss
    from resource_guard.frontdoors.lightning.manual import manual_step, optimizers_of

    return optimizers_of(trainer, pl_module), manual_step(trainer, pl_module)
