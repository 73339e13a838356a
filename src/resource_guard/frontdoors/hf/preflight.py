"""The Trainer door's pre-flight: the built Trainer's arguments checked against the callback's, its step
traced on a batch of its train loader (the run's largest when knowable) and the shape guard started,
and the lines that say so.

The callback (:mod:`~resource_guard.frontdoors.hf.trainer`) calls :func:`preflight_step` at
``on_train_begin`` on every rank; the ranks then agree (:func:`resource_guard.frontdoors.run.agree`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError, DoesNotFitError, PredictedOutOfMemoryError, warn_at_user
from resource_guard.frontdoors.hf import step as hf_step
from resource_guard.frontdoors.hf.plan import auto_detected, render
from resource_guard.frontdoors.hf.runtime import (
    checkpointed,
    default_collator,
    kept_message,
    mib,
    predicted_oom_message,
    too_big_message,
)

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = [
    "Preflight",
    "attach_kwargs",
    "check_against",
    "check_settings",
    "confirm_line",
    "preflight_eval_batch",
    "preflight_line",
    "preflight_step",
    "render_preflight",
]

_CALL = "ResourceGuardCallback"


@dataclasses.dataclass
class Preflight:
    """What the pre-flight of the Trainer's step made: the plan (its reasons include ``notes``), the
    step's optimizer and loss as traced, the shape guard (``None``: off), the planned batch's tensors
    (the forward hook matches batches against them) and one micro-step's model FLOPs (for MFU)."""

    plan: Plan
    notes: list[str]
    optimizer: torch.optim.Optimizer
    loss: Any
    shapes: Any = None
    keys: dict[str, tuple[torch.Size, torch.dtype]] = dataclasses.field(default_factory=dict)
    flops_per_step: float | None = None


def check_settings(
    *,
    device: Any,
    headroom: Any,
    max_seq_len: Any,
    check_shapes: Any,
    check_eval: Any,
    verbose: Any,
    loss_fn: Any,
    compute_loss_func: Any,
    **shared: Any,
) -> str | None:
    """The callback's arguments checked, each refused with ``ConfigurationError`` quoting the call; the
    precision it keeps (``shared``: the settings every door shares, frontdoors/vocabulary.py)."""
    from resource_guard.frontdoors.hf.plan import EXPRESSIBLE
    from resource_guard.frontdoors.shape_guard import check_worst_case_args
    from resource_guard.frontdoors.vocabulary import check_shared, refused

    precision = check_shared(_CALL, max_seq_len=max_seq_len, precisions=EXPRESSIBLE, **shared)
    if device is not None and not (isinstance(device, str) and device.strip()):
        raise refused(_CALL, "device", device, "a device name ('cpu', 'cuda:0', 'a100-40gb', ...) or None")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 0.9:
        raise refused(_CALL, "headroom", headroom, "in [0, 0.9)")
    check_worst_case_args(_CALL, max_seq_len, check_shapes)
    for name, value in (("check_eval", check_eval), ("verbose", verbose)):
        if not isinstance(value, bool):
            raise refused(_CALL, name, value, "True or False")
    for name, fn in (("loss_fn", loss_fn), ("compute_loss_func", compute_loss_func)):
        if fn is not None and not callable(fn):
            raise refused(_CALL, name, fn, "a callable or None")
    return precision


def attach_kwargs(trainer: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The constructor's ``kwargs`` for a callback added to a built ``trainer``, with what its step runs:
    its ``compute_loss_func``, and its own ``compute_loss`` when a subclass overrides it (a ``loss_fn``
    or ``compute_loss_func`` in ``kwargs`` wins)."""
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise ConfigurationError(
            f"`{_CALL}.attach(trainer=...)` must be a transformers Trainer, got {type(trainer).__name__}."
        )
    kwargs = dict(kwargs)
    if kwargs.get("compute_loss_func") is None:
        kwargs["compute_loss_func"] = getattr(trainer, "compute_loss_func", None)
    if kwargs.get("loss_fn") is None and type(trainer).compute_loss is not Trainer.compute_loss:

        def loss_fn(model: nn.Module, batch: Any) -> Any:  # the subclass's own loss
            return trainer.compute_loss(model, dict(batch))

        kwargs["loss_fn"] = loss_fn
    return kwargs


def check_against(cb: Any, args: Any) -> None:
    """Refuse, before any step, a shared setting of the callback ``cb`` the built Trainer does not have:
    the callback changes none (``plan_training_args`` plans them before the Trainer is built)."""
    if cb.precision is not None:
        own = hf_step.precision_of(args) or "32-true"
        kept = "bf16=True" if own == "bf16-mixed" else "fp16=True" if own == "16-mixed" else "no bf16/fp16"
        if cb.precision == "auto":
            raise ConfigurationError(
                f"`{_CALL}(precision='auto')`: the Trainer's precision is its TrainingArguments' ({own}: "
                f"{kept}), fixed when the Trainer is built; this callback changes no setting. Let the "
                "planner choose it before: `args = plan_training_args(model, args, train_dataset, "
                "precision='auto')`, or leave `precision` out to keep the arguments' precision."
            )
        if cb.precision != own:
            raise ConfigurationError(
                f"`{_CALL}(precision={cb.precision!r})` is not the TrainingArguments' precision ({own}: "
                f"{kept}), which the Trainer runs; set it in the TrainingArguments (or plan them with "
                f"`plan_training_args(..., precision={cb.precision!r})`), or leave `precision` out."
            )
    if cb.target_batch_size is not None:
        rows, acc = int(args.per_device_train_batch_size), max(1, int(args.gradient_accumulation_steps))
        world = max(1, int(getattr(args, "world_size", 1) or 1))
        if cb.target_batch_size != rows * acc * world:
            raise ConfigurationError(
                f"`{_CALL}(target_batch_size={cb.target_batch_size})` is not the Trainer's effective "
                f"batch, per_device_train_batch_size {rows} × gradient_accumulation_steps {acc} × world "
                f"size {world} = {rows * acc * world}; this callback changes no setting. Plan the "
                "arguments before building the Trainer: `args = plan_training_args(model, args, "
                f"train_dataset, target_batch_size={cb.target_batch_size})`."
            )
    if cb.log_dir is not None and cb.monitor and int(getattr(args, "process_index", 0) or 0) == 0:
        from resource_guard.frontdoors.vocabulary import check_log_dir

        check_log_dir(cb.log_dir, _CALL)  # now, not after the pre-flight


def preflight_step(
    cb: Any,
    args: Any,
    model: nn.Module,
    optimizer: Any,
    loader: Any,
    rows: int,
    tracing: Callable[[], contextlib.AbstractContextManager[None]],
    input_name: str | None = None,
) -> Preflight:
    """The pre-flight of the Trainer's step with the settings of the callback ``cb``, at a per-device
    batch of ``rows``: ``DoesNotFitError`` (``PredictedOutOfMemoryError`` under ``auto_find_batch_size``)
    when it does not fit. ``tracing``: the context our own traces of the model run in."""
    from resource_guard.frontdoors.shape_guard import start_shape_guard
    from resource_guard.planning.planner import plan
    from resource_guard.planning.worst_case import describe_signature, signature_of

    opt = hf_step.unwrap_optimizer(optimizer)
    loss = hf_step.trainer_loss(model, args, compute_loss_func=cb.compute_loss_func, loss_fn=cb.loss_fn)
    step = hf_step.trainer_step(loss, args.max_grad_norm)
    collate = getattr(loader, "collate_fn", None) or default_collator()
    batch = sample = hf_step.sample_batch(loader.dataset, collate, rows, args.device)
    notes: list[str] = []
    worst = None
    if cb.check_shapes:
        worst = hf_step.worst_case_of(
            batch, max_seq_len=cb.max_seq_len, worst_case_batch=cb.worst_case_batch,
            collate=collate, dataset=loader.dataset,
        ) or hf_step.longest_batch(
            batch, loader.dataset, collate, rows, args.device, input_name=input_name
        )  # fmt: skip
    if worst is not None:
        batch = worst[0]
        notes.append(
            f"planned for the run's largest batch, {describe_signature(signature_of(batch))} ({worst[1]})"
        )
    if checkpointed(model):
        notes.append(
            "gradient checkpointing: the model's own (`gradient_checkpointing=True`), traced as it runs"
        )
    world = max(1, int(args.world_size))
    precision = hf_step.precision_of(args) or "32-true"
    with tracing():
        made = plan(
            model, [opt], batch, step, device=cb.device or str(args.device),
            target_batch_size=rows * world, headroom=cb.headroom, precision=precision,
            checkpointing=False, world_size=world, strategy="ddp" if world > 1 else "single",
            memory_limit=cb.memory_limit, allow_rough=True,
        )  # fmt: skip
    made = _with_accumulation(made, args, rows, world, cb.headroom, precision)
    out = Preflight(made, notes, opt, loss)
    if cb.monitor:  # model FLOPs of the run's typical batch, for MFU
        out.flops_per_step = _count_flops(model, sample, loss, tracing)
    if isinstance(batch, dict):
        out.keys = {k: (v.shape, v.dtype) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if cb.check_shapes:
        try:
            with tracing():
                out.shapes, more = start_shape_guard(
                    model, [opt], batch, step, made, traced_plan=True, trace_context=tracing
                )
            notes += [
                *more,
                "shape guard: each batch is checked before it runs; one that would not fit stops the run",
            ]
        except DoesNotFitError:
            raise
        except Exception as error:  # our check never stops the run
            warn_at_user(f"{_CALL}: the shape check is off: {error!r}")
            out.shapes = None
    out.plan = auto_detected(dataclasses.replace(made, reasons=(*made.reasons, *notes)), cb.device)
    return out


def _with_accumulation(made: Plan, args: Any, rows: int, world: int, headroom: float, precision: str) -> Plan:
    """The plan of the configured accumulation: micro-steps 2..k start with the gradients allocated; a
    plan that would need accumulation of its own means the configured batch does not fit."""
    acc = max(1, int(args.gradient_accumulation_steps))
    if made.accumulation_steps == 1 and acc > 1:
        kept = made.estimate.for_device(made.device, headroom=headroom, gradients_kept=True)
        made = dataclasses.replace(
            made, accumulation_steps=acc, target_batch_size=rows * acc * world, fit=kept
        )
        if not kept.fits:
            message = kept_message(acc, kept, made.device.name)
            if args.auto_find_batch_size:  # a smaller batch leaves room for the gradients
                oom = f"ResourceGuard predicts the step runs out of memory. {message}"
                raise PredictedOutOfMemoryError(oom, made)
            raise DoesNotFitError(message, made)
    elif made.accumulation_steps > 1:
        if args.auto_find_batch_size:  # accelerate's loop lowers the batch and calls again
            raise PredictedOutOfMemoryError(predicted_oom_message(rows, made), made)
        raise DoesNotFitError(too_big_message(rows, acc, precision, made), made)
    return made


def _count_flops(
    model: nn.Module, batch: Any, loss: Any, tracing: Callable[[], contextlib.AbstractContextManager[None]]
) -> float | None:
    """Model FLOPs of one micro-step (forward and backward, the loader's first batch: the run's typical
    one, not its worst case), for MFU; counted on a fake copy in eval mode, so that the model's own
    gradient checkpointing does not count its recomputed forward."""
    from resource_guard.observe.throughput import count_flops

    def model_flops_loss(m: nn.Module, b: Any) -> Any:
        return loss(m.eval(), b)

    with tracing():
        return count_flops(model, batch, model_flops_loss)


def preflight_line(
    made: Plan, args: Any, rows: int, model: nn.Module | None, seconds: float, shapes_on: bool
) -> str:
    """What the callback prints of its pre-flight: arguments ``plan_training_args`` made were printed
    with their plan, so one line confirms it; else the pre-flight in full."""
    from resource_guard.frontdoors.hf.plan import planned_by

    if planned_by(args) is not None:
        return confirm_line(made, args, seconds, shapes_on)
    return render_preflight(made, args, rows, model, seconds)


def confirm_line(made: Plan, args: Any, seconds: float, shapes_on: bool) -> str:
    """One line: the Trainer's step is the one ``plan_training_args`` planned (and printed), and fits."""
    guard = "; each batch checked before it runs" if shapes_on else ""
    used, usable = mib(made.fit.device_total_bytes), mib(made.fit.usable_bytes)
    return (
        f"ResourceGuard pre-flight of the Trainer's step ({seconds:.1f} s): as plan_training_args "
        f"planned it (per-device batch {made.micro_batch_size} × accumulation "
        f"{args.gradient_accumulation_steps}, {made.precision}): {used} of {usable} usable on "
        f"{made.device.name}, fits{guard}"
    )


def render_preflight(made: Plan, args: Any, rows: int, model: nn.Module | None, seconds: float) -> str:
    """The pre-flight as printed and written to TensorBoard: the step's settings, memory and reasons."""
    ckpt_field = hf_step.checkpointing_fields(args)[0]
    settings = {
        "per_device_train_batch_size": rows,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "bf16": bool(args.bf16),
        "fp16": bool(args.fp16),
        ckpt_field: bool(getattr(args, ckpt_field)),
    }
    acc = args.gradient_accumulation_steps
    ckpt = model is not None and checkpointed(model)
    head = (
        f"ResourceGuard pre-flight of the Trainer's step ({seconds:.1f} s): per-device batch "
        f"{made.micro_batch_size} × accumulation {acc} × world size {made.world_size} = "
        f"{made.micro_batch_size * acc * made.world_size}; precision {made.precision}; gradient "
        f"checkpointing {'on' if ckpt else 'off'}: "
        f"{mib(made.fit.device_total_bytes)} of {mib(made.fit.usable_bytes)} usable, fits"
    )
    return render(made, settings, seconds, head)


def preflight_eval_batch(cb: Any, watch: Any, made: Preflight | None, kwargs: dict[str, Any]) -> Any:
    """The first batch of an evaluation (the model's keyword arguments), pre-flighted beside what the
    run holds (the plan's optimizer once planned) with the callback ``cb``'s settings: its
    :class:`~resource_guard.frontdoors.eval_preflight.EvalCheck` (``None`` when already checked or
    nothing to check); ``DoesNotFitError`` when it does not fit."""
    from resource_guard.devices import parse_memory_limit, resolve_device

    args, model = cb._args, watch.model
    if args is None or not kwargs or model is None:
        return None
    planned = cb.plan
    spec = planned.device if planned is not None else resolve_device(cb.device or str(args.device))
    if planned is None and cb.memory_limit is not None:
        spec = spec.with_memory(parse_memory_limit(cb.memory_limit, _CALL))
    loss = made.loss if made is not None else hf_step.trainer_loss(
        model, args, compute_loss_func=cb.compute_loss_func, loss_fn=cb.loss_fn
    )  # fmt: skip
    batch = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
    with watch.tracing():
        return cb._evals.check(
            model, batch, loss, loop="evaluation", device=spec,
            optimizer=made.optimizer if planned is not None and made is not None else None,
            gradients_kept=False, precision=hf_step.precision_of(args) or "32-true", headroom=cb.headroom,
        )  # fmt: skip
