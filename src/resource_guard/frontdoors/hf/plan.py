"""Plan a Hugging Face ``Trainer`` run before the Trainer is built: :func:`plan_training_args`.

The user's ``TrainingArguments`` imply an effective batch (``per_device_train_batch_size ×
gradient_accumulation_steps × world size``); :func:`plan_training_args` keeps it and chooses, with
:func:`~resource_guard.plan`, the per-device batch, the accumulation, the precision (``bf16``/``fp16``)
and gradient checkpointing that fit the device (or ``memory_limit``), tracing the step as the Trainer
runs it (:mod:`~resource_guard.frontdoors.hf.step`: its loss, its ``optim=`` optimizer, clipping) on the
run's largest batch when it is knowable (``max_seq_len``, the collator's ``max_length``, the dataset's
length column). What the user set explicitly (``bf16``/``fp16``, ``gradient_checkpointing=True``) is
kept. The decisions, their reasons and the table of alternatives are printed (process zero).

Example:
    >>> import torch
    >>> from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    >>> model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64))
    >>> data = [{"input_ids": torch.arange(32) % 128, "labels": torch.arange(32) % 128}] * 16
    >>> args = TrainingArguments("out", use_cpu=True, report_to=[], per_device_train_batch_size=16)
    >>> planned = plan_training_args(model, args, data, memory_limit="4GiB", verbose=False)
    >>> planned.per_device_train_batch_size * planned.gradient_accumulation_steps
    16
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, overload

from torch import nn

from resource_guard.devices import parse_memory_limit
from resource_guard.errors import ConfigurationError
from resource_guard.frontdoors.hf import step as hf_step
from resource_guard.frontdoors.vocabulary import check_shared

if TYPE_CHECKING:
    from transformers import TrainingArguments

    from resource_guard.planning.planner import Plan

__all__ = [
    "EXPRESSIBLE",
    "auto_detected",
    "plan_training_args",
    "planned_by",
    "render",
    "say",
    "settings_text",
]

_log = logging.getLogger("resource_guard")
_MiB = 2**20


def say(text: str) -> None:
    """Print ``text`` as the monitor prints its summary: the ``resource_guard`` logger at INFO when it is
    enabled for INFO, else stderr."""
    if _log.isEnabledFor(logging.INFO):
        _log.info(text)
    else:
        print(text, file=sys.stderr)


EXPRESSIBLE = ("32-true", "bf16-mixed", "16-mixed")  # the precisions TrainingArguments can express
# the arguments plan_training_args returned, by id (TrainingArguments are not hashable), with the plan:
# ResourceGuardCallback then confirms the plan in one line instead of printing it again
_PLANNED: dict[int, tuple[weakref.ref[Any], Plan]] = {}


def planned_by(args: Any) -> Plan | None:
    """The :class:`~resource_guard.Plan` that :func:`plan_training_args` made ``args`` from (``None``: not
    planned there, or changed since: its batch, accumulation and precision are no longer the plan's)."""
    kept = _PLANNED.get(id(args))
    planned = kept[0]() if kept is not None else None
    if kept is None or planned is None or planned is not args:
        return None
    made = kept[1]
    same = (
        planned.per_device_train_batch_size == made.micro_batch_size
        and planned.gradient_accumulation_steps == made.accumulation_steps
        and bool(planned.bf16) == (made.precision == "bf16-mixed")
        and bool(planned.fp16) == (made.precision == "16-mixed")
    )
    return made if same else None


def _remember(args: Any, made: Plan) -> None:
    for key in [k for k, (ref, _) in _PLANNED.items() if ref() is None]:
        del _PLANNED[key]
    _PLANNED[id(args)] = (weakref.ref(args), made)


def auto_detected(made: Plan, device: str | None) -> Plan:
    """``made`` whose device reason says "auto-detected (the Trainer's device)" where the user named no
    device (the door plans for ``args.device``, which the planner otherwise takes as asked for)."""
    if device is not None:
        return made
    prefix = f"device {made.device.name} ({made.device.kind}): asked for"
    reasons = tuple(
        r.replace(": asked for", ": auto-detected (the Trainer's device)", 1) if r.startswith(prefix) else r
        for r in made.reasons
    )
    return dataclasses.replace(made, reasons=reasons)


@overload
def plan_training_args(
    model: nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    data_collator: Callable[[list[Any]], Any] | None = ...,
    *,
    processing_class: Any = ...,
    device: str | None = ...,
    memory_limit: int | str | None = ...,
    max_seq_len: int | None = ...,
    worst_case_batch: Any = ...,
    target_batch_size: int | None = ...,
    headroom: float = ...,
    precision: str | None = ...,
    loss_fn: Callable[[nn.Module, Any], Any] | None = ...,
    compute_loss_func: Callable[..., Any] | None = ...,
    verbose: bool = ...,
    return_plan: Literal[False] = ...,
) -> TrainingArguments: ...


@overload
def plan_training_args(
    model: nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    data_collator: Callable[[list[Any]], Any] | None = ...,
    *,
    processing_class: Any = ...,
    device: str | None = ...,
    memory_limit: int | str | None = ...,
    max_seq_len: int | None = ...,
    worst_case_batch: Any = ...,
    target_batch_size: int | None = ...,
    headroom: float = ...,
    precision: str | None = ...,
    loss_fn: Callable[[nn.Module, Any], Any] | None = ...,
    compute_loss_func: Callable[..., Any] | None = ...,
    verbose: bool = ...,
    return_plan: Literal[True],
) -> tuple[TrainingArguments, Plan]: ...


def plan_training_args(
    model: nn.Module,
    args: TrainingArguments,
    train_dataset: Any,
    data_collator: Callable[[list[Any]], Any] | None = None,
    *,
    processing_class: Any = None,
    device: str | None = None,
    memory_limit: int | str | None = None,
    max_seq_len: int | None = None,
    worst_case_batch: Any = None,
    target_batch_size: int | None = None,
    headroom: float = 0.1,
    precision: str | None = None,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    compute_loss_func: Callable[..., Any] | None = None,
    verbose: bool = True,
    return_plan: bool = False,
) -> TrainingArguments | tuple[TrainingArguments, Plan]:
    """A copy of ``args`` with the batch, accumulation, precision and checkpointing that fit.

    Args:
        model: the model the Trainer will train (a PEFT model included: its frozen base has no
            gradients and no optimizer state).
        args: the user's ``TrainingArguments``; not modified.
        train_dataset: the training dataset (map-style or iterable): its first rows, through the
            collator, are the sample batch.
        data_collator: the collator the Trainer will use; default the one the Trainer chooses for
            ``data_collator=None``: ``DataCollatorWithPadding(processing_class)`` with a tokenizer (or
            feature extractor), else transformers' ``default_data_collator``.
        processing_class: the tokenizer (or processor) the Trainer gets as ``processing_class=``. With a
            padding collator the plan is made for the batch around the dataset's longest example (the
            first batch of ``group_by_length``'s sampler).
        device: the device to plan for: default the one ``args`` trains on; a catalog name (for example
            ``"a100-40gb"``) plans as if training there.
        memory_limit: plan as if the device had only this much memory (bytes, or a string such as ``"6GiB"``).
        max_seq_len / worst_case_batch: the run's largest batch (the Trainer cannot split one); default
            from the collator's ``max_length`` or the dataset's length column when declared.
        target_batch_size: the effective batch; default the one ``args`` implies.
        headroom: share of the device memory kept free, in [0, 0.9).
        precision: ``None`` (the default) keeps the precision ``args`` sets (``bf16``/``fp16``, else
            float32): the run's numerics change only by consent. ``"auto"`` lets the planner choose
            where ``args`` sets neither; ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` fixes it.
        loss_fn: ``loss_fn(model, batch) -> loss`` for a Trainer subclass that overrides ``compute_loss``.
        compute_loss_func: the ``Trainer(compute_loss_func=...)`` the run will use.
        verbose: print the decisions, their reasons and the alternatives (process zero).
        return_plan: also return the :class:`~resource_guard.Plan`.

    Raises:
        ConfigurationError: a bad argument, or an ``optim`` the estimate cannot build.
        DoesNotFitError: not even one row per device fits; ``err.report`` says what would.
    """
    from resource_guard.frontdoors.shape_guard import check_worst_case_args
    from resource_guard.planning.planner import plan

    call = "plan_training_args"
    if not isinstance(model, nn.Module):
        raise ConfigurationError(
            f"`{call}(model=...)` must be a torch.nn.Module, got {type(model).__name__}."
        )
    if not all(
        hasattr(args, name) for name in ("per_device_train_batch_size", "gradient_accumulation_steps")
    ):
        raise ConfigurationError(f"`{call}(args=...)` must be a transformers TrainingArguments.")
    if target_batch_size is not None and (
        isinstance(target_batch_size, bool) or not isinstance(target_batch_size, int) or target_batch_size < 1
    ):
        raise ConfigurationError(
            f"`{call}(target_batch_size={target_batch_size!r})` must be a positive int or None."
        )
    if memory_limit is not None:
        parse_memory_limit(memory_limit, call)
    check_worst_case_args(call, max_seq_len, True)
    precision = check_shared(call, precision=precision, precisions=EXPRESSIBLE)  # the doors' words
    started = time.perf_counter()
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    target = target_batch_size or args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    if target % world:
        raise ConfigurationError(
            f"`{call}(target_batch_size={target})` is not divisible by the world size {world}."
        )
    if data_collator is None:  # what the Trainer chooses (Trainer.__init__)
        data_collator = hf_step.trainer_collator(processing_class)
    fixed_precision = hf_step.precision_of(args)
    if precision not in (None, "auto") and fixed_precision not in (None, precision):
        raise ConfigurationError(
            f"`{call}(precision={precision!r})` conflicts with the TrainingArguments' "
            f"{'bf16' if args.bf16 else 'fp16'}=True: set the precision in one place only."
        )
    planned_precision = fixed_precision or (precision if precision is not None else "32-true")
    ckpt_field, ckpt_kwargs_field = hf_step.checkpointing_fields(args)
    user_checkpointing = bool(getattr(args, ckpt_field, False))
    can_checkpoint = bool(getattr(hf_step.base_model_of(model), "supports_gradient_checkpointing", False))
    checkpointing: bool | str = True if user_checkpointing else ("auto" if can_checkpoint else False)
    loss_of = hf_step.trainer_loss(model, args, compute_loss_func=compute_loss_func, loss_fn=loss_fn)
    optimizer = hf_step.trainer_optimizer(model, args)
    step = hf_step.trainer_step(loss_of, getattr(args, "max_grad_norm", 0.0))
    on = next((p.device for p in model.parameters()), None)
    batch_device = on if on is not None and on.type != "meta" else "cpu"
    batch = hf_step.sample_batch(
        train_dataset,
        data_collator,
        args.per_device_train_batch_size,
        batch_device,
        model=model if getattr(args, "remove_unused_columns", True) else None,
    )
    notes: list[str] = []
    worst = hf_step.worst_case_of(
        batch, max_seq_len=max_seq_len, worst_case_batch=worst_case_batch, collate=data_collator,
        dataset=train_dataset,
    ) or hf_step.longest_batch(
        batch, train_dataset, data_collator, args.per_device_train_batch_size, batch_device,
        model=model if getattr(args, "remove_unused_columns", True) else None,
        input_name=hf_step.input_name_of(processing_class),
    )  # fmt: skip
    if worst is not None:
        from resource_guard.planning.worst_case import describe_signature, signature_of

        batch = worst[0]
        notes.append(
            f"planned for the run's largest batch, {describe_signature(signature_of(batch))} ({worst[1]})"
        )
    made = plan(
        model,
        [optimizer],
        batch,
        step,
        device=device or str(args.device),
        target_batch_size=target,
        headroom=headroom,
        precision=planned_precision,
        checkpointing=checkpointing,
        world_size=world,
        strategy=_strategy(args, world),
        memory_limit=memory_limit,
        allow_rough=True,
    )
    if made.precision not in EXPRESSIBLE:  # TrainingArguments cannot say it
        raise ConfigurationError(
            f"the plan chose {made.precision}, which TrainingArguments cannot express; set `bf16=True` or "
            "`fp16=True` in the TrainingArguments to fix the precision."
        )
    changes: dict[str, Any] = {
        "per_device_train_batch_size": made.micro_batch_size,
        "gradient_accumulation_steps": made.accumulation_steps,
        "bf16": made.precision == "bf16-mixed",
        "fp16": made.precision == "16-mixed",
        ckpt_field: bool(made.checkpointing),
    }
    if made.checkpointing and not user_checkpointing:
        changes[ckpt_kwargs_field] = dict(getattr(args, ckpt_kwargs_field, None) or {"use_reentrant": False})
        if made.checkpoint_every > 1:
            notes.append(
                f"the plan checkpoints every {made.checkpoint_every} blocks; the Trainer checkpoints every "
                "block, which needs less memory (and recomputes more)"
            )
    if user_checkpointing:
        notes.append(f"gradient checkpointing kept as set (`{ckpt_field}=True`)")
    if fixed_precision is not None:
        notes.append(f"precision kept as set ({'bf16' if args.bf16 else 'fp16'}=True)")
    elif precision is None:
        notes.append(
            "precision kept as set (float32: no bf16/fp16 in the TrainingArguments; "
            "`precision='auto'` lets the planner choose)"
        )
    before = {k: getattr(args, k, None) for k in changes}
    planned = dataclasses.replace(args, **changes)
    made = auto_detected(dataclasses.replace(made, reasons=(*made.reasons, *notes)), device)
    _remember(planned, made)
    if verbose and int(getattr(args, "process_index", 0) or 0) == 0:
        say(render(made, changes, time.perf_counter() - started, before=before))
    return (planned, made) if return_plan else planned


def settings_text(changes: Mapping[str, Any], before: Mapping[str, Any] | None = None) -> str:
    """``name=value`` for each setting, ``name=old → new`` where ``before`` had another value.

    >>> settings_text({"bf16": True, "gradient_accumulation_steps": 1}, {"bf16": False})
    'bf16=False → True, gradient_accumulation_steps=1'
    """
    old = before or {}
    return ", ".join(
        f"{k}={old[k]!r} → {v!r}" if k in old and old[k] != v else f"{k}={v!r}" for k, v in changes.items()
    )


def _strategy(args: Any, world: int) -> str:
    if getattr(args, "fsdp", None):
        return "fsdp"
    return "ddp" if world > 1 else "single"


def render(
    made: Plan,
    changes: dict[str, Any],
    seconds: float,
    head: str | None = None,
    before: Mapping[str, Any] | None = None,
) -> str:
    """The plan as the other front doors print it: the decisions, their reasons, the estimate, the table.
    With ``before`` (the user's values), each setting the plan changed shows ``old → new``."""
    from resource_guard.planning.search import render_table

    settings = settings_text(changes, before)
    est, fit = made.estimate, made.fit
    parts = ", ".join(f"{k} {v / _MiB:.1f} MiB" for k, v in est.breakdown.items() if v)
    lines = [
        head
        or f"ResourceGuard plan for the Trainer ({seconds:.1f} s): micro-batch {made.micro_batch_size} × "
        f"accumulation {made.accumulation_steps} × world size {made.world_size} = {made.target_batch_size}; "
        f"precision {made.precision}; gradient checkpointing {'on' if made.checkpointing else 'off'}",
        f"- TrainingArguments: {settings}",
        *(f"- {reason}" for reason in made.reasons),
        f"- pre-flight ({est.method}): peak {est.peak_bytes / _MiB:.1f} MiB per device ({parts}); device "
        f"{fit.device.name}: {fit.device_total_bytes / _MiB:.1f} MiB of {fit.capacity_bytes / _MiB:.1f} MiB "
        f"(usable {fit.usable_bytes / _MiB:.1f} MiB)",
    ]
    if made.alternatives:
        lines += ["", render_table(made.alternatives)]
    return "\n".join(lines)
