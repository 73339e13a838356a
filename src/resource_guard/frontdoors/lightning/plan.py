"""The Lightning door's plan: the callback's arguments checked, this rank's plan of the Trainer's step
(:func:`plan_locally`, before the ranks agree), and the plan as logged (console and TensorBoard text).

Example:
    >>> check_settings(device=None, headroom=0.1, checkpointing="auto", accumulation=1, fail_fast=1,
    ...                memory_history=False, max_seq_len=None, check_shapes=True)
    Traceback (most recent call last):
    ...
    resource_guard.errors.ConfigurationError: `ResourceGuard(fail_fast=1)` must be True or False.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from resource_guard.errors import ConfigurationError, DoesNotFitError, warn_at_user
from resource_guard.frontdoors.lightning import apply as ap
from resource_guard.frontdoors.lightning import shapes as lightning_shapes

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = [
    "MANUAL",
    "accumulation_of",
    "check_settings",
    "describe",
    "flops_per_sample",
    "log_plan",
    "plan_locally",
    "render_plan",
    "strategy_name",
    "total_batches",
    "trainer_monitor",
]

_CALL = "ResourceGuard"
_TEXT_TAG = "resource_guard/plan"
MANUAL = "manual optimization (`automatic_optimization = False`)"


def check_settings(
    *, device: Any, headroom: Any, checkpointing: Any, accumulation: Any, fail_fast: Any,
    memory_history: Any, max_seq_len: Any, check_shapes: Any, **shared: Any,
) -> str | None:  # fmt: skip
    """The callback's arguments checked, each refused with ``ConfigurationError`` quoting the call; the
    precision it keeps (``shared``: the settings every door shares, frontdoors/vocabulary.py)."""
    from resource_guard.frontdoors.shape_guard import check_worst_case_args
    from resource_guard.frontdoors.vocabulary import check_shared, refused

    precision = check_shared(_CALL, max_seq_len=max_seq_len, **shared)
    if device is not None and not (isinstance(device, str) and device.strip()):
        raise refused(_CALL, "device", device, "a device name ('cpu', 'cuda:0', 'a100-40gb', ...) or None")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 0.9:
        raise refused(_CALL, "headroom", headroom, "in [0, 0.9)")
    if checkpointing not in (True, False, "auto"):
        raise refused(_CALL, "checkpointing", checkpointing, "True, False or 'auto'")
    positive = isinstance(accumulation, int) and not isinstance(accumulation, bool) and accumulation >= 1
    if accumulation != "auto" and not positive:
        raise refused(_CALL, "accumulation", accumulation, "'auto' or a positive int")
    for name, value in (("fail_fast", fail_fast), ("memory_history", memory_history)):
        if not isinstance(value, bool):
            raise refused(_CALL, name, value, "True or False")
    check_worst_case_args(_CALL, max_seq_len, check_shapes)
    return None if precision is None else str(precision)


def plan_locally(
    cb: Any,
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    loader_batch_size: int | None,
    target: int | None,
) -> ap.Decisions:
    """This rank's plan of the step with the callback ``cb``'s settings (``cb.plan``, and for MFU
    ``cb._flops_per_sample``, are set), as the decisions to agree on across ranks."""
    from resource_guard.frontdoors.lightning.manual import manual_step, optimizers_of
    from resource_guard.planning.planner import plan

    optimizers = optimizers_of(trainer, pl_module)  # every optimizer, its state estimated
    manual = not pl_module.automatic_optimization
    optimizer: Any = optimizers if manual else optimizers[0]
    step = manual_step(trainer, pl_module) if manual else ap.training_step_loss
    world = trainer.world_size
    fixed = cb._fixed
    batch = cb._planned_on = lightning_shapes.worst_case_of(cb, trainer, batch)
    if target is None:
        if loader_batch_size is None:
            raise ConfigurationError(
                "cannot tell the train loader's batch size (its tensors do not share dim 0); pass "
                "`ResourceGuard(target_batch_size=...)`."
            )
        target = loader_batch_size * trainer.accumulate_grad_batches * world
    per_step = target
    if fixed.accumulation is not None:
        if target % (fixed.accumulation * world):
            raise ConfigurationError(
                f"the target batch {target} is not divisible by the fixed accumulation × world size "
                f"({fixed.accumulation_source} × {world}); change `target_batch_size` or the "
                "accumulation."
            )
        per_step = target // fixed.accumulation
    with ap.detached_trainer(pl_module):
        made = plan(
            pl_module, optimizer, batch, step, device=cb.device or str(trainer.strategy.root_device),
            target_batch_size=per_step, headroom=cb.headroom, precision=fixed.precision or "auto",
            checkpointing=cb.checkpointing, world_size=world, strategy=strategy_name(trainer),
            memory_limit=cb.memory_limit,
            allow_rough=True,  # the run starts either way: plan on the bound, its warning says why
        )  # fmt: skip
    cb.plan = made
    if cb.monitor:  # model FLOPs per sample, for MFU (before checkpointing is applied)
        with ap.detached_trainer(pl_module):
            cb._flops_per_sample = flops_per_sample(pl_module, batch, step if manual else None, optimizers)
    accumulation = made.accumulation_steps
    if fixed.accumulation is not None:
        if made.accumulation_steps != 1:
            raise DoesNotFitError(
                f"with {fixed.accumulation_source} fixed, each rank's micro-batch must be "
                f"{per_step // world} for the target batch {target}, and that does not fit: the largest "
                f"that fits is {made.micro_batch_size} ({made.precision}, checkpointing "
                f"{'on' if made.checkpointing else 'off'}). "
                + (
                    "Lower the batch size (or accumulate in `training_step`)."
                    if manual
                    else "Remove the accumulation setting so ResourceGuard can choose it, or lower the "
                    "target batch."
                ),
                made,
            )
        accumulation = fixed.accumulation
    return ap.Decisions(
        made.micro_batch_size, accumulation, made.precision, bool(made.checkpointing), target, world
    )


def render_plan(d: ap.Decisions, fixed: ap.Fixed, made: Plan | None, seconds: float, notes: list[str]) -> str:
    """The plan as logged: what was decided, the notes, what the user fixed, the reasons and memory."""
    lines = [f"ResourceGuard plan ({seconds:.1f} s): {describe(d)}", *(f"- {n}" for n in notes)]
    if fixed.accumulation_source == MANUAL:
        from resource_guard.frontdoors.lightning.manual import WHAT_MANUAL_LEAVES

        lines.append(f"- {WHAT_MANUAL_LEAVES}")
    elif fixed.accumulation is not None:
        lines.append(f"- accumulation fixed by {fixed.accumulation_source}: planned around it")
    if fixed.precision is not None:
        lines.append(f"- precision fixed by {fixed.precision_source}: planned around it")
    if made is not None:
        lines.extend(f"- {reason}" for reason in getattr(made, "reasons", ()))
        est, fit = made.estimate, made.fit
        parts = ", ".join(f"{k} {_mib(v)}" for k, v in est.breakdown.items() if v)
        lines.append(
            f"- pre-flight ({est.method}): peak {_mib(est.peak_bytes)} per rank ({parts}); device "
            f"{fit.device.name}: {_mib(fit.device_total_bytes)} of {_mib(fit.capacity_bytes)} "
            f"(usable {_mib(fit.usable_bytes)})"
        )
    return "\n".join(lines)


def log_plan(trainer: pl.Trainer, made: Plan | None, text: str) -> None:
    """Console (rank zero), and TensorBoard text with the planner's table of alternatives."""
    rank_zero_info(text)
    if not trainer.is_global_zero:
        return
    head, _, rest = text.partition("\n")
    markdown = f"{head}\n\n{rest}" if rest else head
    alternatives = getattr(made, "alternatives", ())
    if alternatives:
        from resource_guard.planning.search import render_table

        markdown += "\n\n" + render_table(alternatives)
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(_TEXT_TAG, markdown, trainer.global_step)


def describe(d: ap.Decisions) -> str:
    return (
        f"micro-batch {d.micro_batch_size} × accumulation {d.accumulation_steps} × world size "
        f"{d.world_size} = {d.target_batch_size}; precision {d.precision}; activation checkpointing "
        f"{'on' if d.checkpointing else 'off'}"
    )


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def strategy_name(trainer: pl.Trainer) -> str:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    if isinstance(trainer.strategy, FSDPStrategy):
        return "fsdp"
    if trainer.world_size == 1:
        return "single"
    if not isinstance(trainer.strategy, DDPStrategy):
        warn_at_user(
            f"ResourceGuard: {type(trainer.strategy).__name__} is planned as DDP (a full replica per "
            "rank), which is conservative for sharded strategies."
        )
    return "ddp"


def flops_per_sample(
    pl_module: pl.LightningModule, batch: Any, manual: Any = None, optimizers: Any = ()
) -> float | None:
    """FLOPs of ``training_step`` + backward per sample, counted on fake tensors; None if unknown."""
    from resource_guard.frontdoors.lightning.manual import manual_flops
    from resource_guard.observe.throughput import count_flops
    from resource_guard.step.training import batch_size_of

    size = batch_size_of(batch)
    if not size:
        return None
    if manual is not None:  # the module's own step, its backwards included
        flops = manual_flops(manual, pl_module, optimizers, batch)
    else:
        flops = count_flops(pl_module, batch, ap.training_step_loss)
    return flops / size if flops and size else None


def accumulation_of(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    """Batches per optimizer step: ``accumulate_grad_batches`` (automatic optimization), else one."""
    if not getattr(pl_module, "automatic_optimization", True):
        return 1
    return max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))


def total_batches(trainer: pl.Trainer) -> int | None:
    """Optimizer steps the fit will run (the monitor's steps), for the report's ETA; None if unbounded."""
    try:
        steps = float(trainer.estimated_stepping_batches)
    except Exception:  # no loader length yet (iterable datasets), or Lightning could not tell
        return None
    if not math.isfinite(steps) or steps <= 0:
        return None
    return int(steps)


def trainer_monitor(cb: Any, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The run monitor of the callback ``cb``'s fit (not started; see
    :func:`~resource_guard.frontdoors.run.new_monitor`): every rank runs one, rank zero writes, into the
    Trainer's TensorBoard logger; a step is an optimizer step, its FLOPs its micro-batches'."""
    from resource_guard.frontdoors.run import new_monitor
    from resource_guard.step.precision import PRECISIONS

    log_dir = cb.log_dir
    if log_dir is None:  # `trainer.log_dir` is a collective under DDP: every rank reads it
        log_dir = os.path.join(trainer.log_dir or trainer.default_root_dir, "resource_guard")
    loggers = trainer.loggers if trainer.is_global_zero else []
    writer = next((lg.experiment for lg in loggers if isinstance(lg, TensorBoardLogger)), None)
    d, precision = cb.decisions, str(trainer.precision)
    flops = (
        cb._flops_per_sample * d.micro_batch_size * accumulation_of(trainer, pl_module)
        if cb._flops_per_sample and d is not None
        else None
    )
    return new_monitor(
        cb.plan, trainer.strategy.root_device, log_dir, memory_history=cb.memory_history,
        log_every_n_steps=cb.log_every_n_steps, log_interval_s=cb.log_interval_s, profile=cb.profile,
        writer=writer, rank=trainer.global_rank, world_size=trainer.world_size,
        loader_info=ap.loader_info(trainer), flops_per_step=flops,
        precision=precision if precision in PRECISIONS else None,
    )  # fmt: skip
