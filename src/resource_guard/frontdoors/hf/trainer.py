"""The Hugging Face front door: :class:`ResourceGuardCallback` for ``transformers.Trainer``.

At ``on_train_begin`` (the Trainer has built its optimizer and wrapped the model; no step has run) the
callback traces the Trainer's own step (:mod:`~resource_guard.frontdoors.hf.step`) with the Trainer's
model and optimizer on a batch of its train loader — the run's largest when it is knowable — and
raises :class:`~resource_guard.errors.DoesNotFitError` with the report before step 0 when the
configured ``per_device_train_batch_size`` does not fit (on any rank: the ranks agree with one
collective). Under ``auto_find_batch_size=True`` the error is a
:class:`~resource_guard.errors.PredictedOutOfMemoryError`, which accelerate's loop takes for an
out-of-memory error: it lowers the batch and trains again, each attempt pre-flighted, no step run. Plan
the arguments beforehand with :func:`~resource_guard.frontdoors.hf.plan.plan_training_args`.

The Trainer shows no callback its batches, so the callback watches the model: a forward pre-hook
(``register_forward_pre_hook(with_kwargs=True)``, public PyTorch) sees each batch exactly as the model
receives it, on the device, before it runs. In training mode the shape guard checks it and stops the
run before a batch that would not fit (one agreement across ranks per batch under DDP, as in
:mod:`~resource_guard.frontdoors.lightning.shapes`), and the monitor marks the batch ready; the step ends
at ``on_substep_end`` / ``on_step_end``. In eval mode, the first batch of each evaluation is
pre-flighted (:mod:`~resource_guard.frontdoors.eval_preflight`). The monitor
(:class:`~resource_guard.RunMonitor`) writes the report to ``<output_dir>/resource_guard`` and its
scalars into the Trainer's TensorBoard run; the summary is printed at ``on_train_end``. The run-time
pieces (the hook object, accelerate's autocast wrapper taken off for a trace, the TensorBoard run, the
monitor) are in :mod:`~resource_guard.frontdoors.hf.runtime`.

A run that ends in an error still gets its report, though the Trainer has no exception hook: an
out-of-memory error in a training forward closes the monitor at once (a forward hook with
``always_call=True``, run while the allocator still holds the step; ``oom.json`` is written); any other
error, or one in backward or the optimizer step, closes it when the process exits (``atexit``, with the
error Python kept as ``sys.last_value``) or when the Trainer starts training again (``auto_find_batch_size``
retrying after an out-of-memory error, a second ``train()`` in a notebook). Closed that way, the report
makes no collective: the other ranks may be gone.

Example:
    >>> from resource_guard.frontdoors.hf.trainer import ResourceGuardCallback
    >>> callback = ResourceGuardCallback(memory_limit="8GiB", monitor=False)
    >>> callback.plan is None
    True
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import TrainerCallback

from resource_guard.devices import parse_memory_limit
from resource_guard.errors import (
    ConfigurationError,
    DoesNotFitError,
    PredictedOutOfMemoryError,
    warn_at_user,
)
from resource_guard.frontdoors.eval_preflight import EvalPreflights
from resource_guard.frontdoors.hf import step as hf_step
from resource_guard.frontdoors.hf.phases import TrainerPhases
from resource_guard.frontdoors.hf.plan import auto_detected, planned_by, render, say
from resource_guard.frontdoors.hf.runtime import (
    ModelHook,
    agree,
    build_monitor,
    checkpointed,
    default_collator,
    kept_message,
    mib,
    per_device_rows,
    predicted_oom_message,
    tensorboard_writer,
    too_big_message,
    without_accelerate_autocast,
)
from resource_guard.observe.oom import is_oom
from resource_guard.observe.profiling import ProfileWindow

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = ["ResourceGuardCallback"]

_TEXT_TAG = "resource_guard/plan"


class RunEndedEarly(RuntimeError):
    """The Trainer's run ended without ``on_train_end``, by an error the callback did not see."""


class ResourceGuardCallback(TrainerCallback):
    """Pre-flight, shape guard, evaluation pre-flight and monitoring for a ``transformers.Trainer``.

    Args:
        device: the device to check against: default the Trainer's (``args.device``); a catalog name
            checks as if training there.
        memory_limit: check as if each device had only this much memory (bytes, or ``"6GiB"``).
        headroom: share of the device memory kept free, in [0, 0.9).
        max_seq_len / worst_case_batch: the run's largest batch (default: the collator's ``max_length``
            or the dataset's length column when declared): the pre-flight is made for it.
        check_shapes: check each training batch before it runs; ``False``: off.
        check_eval: pre-flight the first batch of each evaluation; ``False``: off.
        monitor: run-time monitoring and the report; ``False`` for none.
        profile: ``True`` (default window), ``False``, or a
            :class:`~resource_guard.observe.profiling.ProfileWindow`.
        log_dir: where the report goes; default ``<args.output_dir>/resource_guard``.
        loss_fn / compute_loss_func: as for :func:`~resource_guard.frontdoors.hf.plan.plan_training_args`.
        verbose: print the pre-flight (process zero).
        precision: as at the other doors: ``None`` (the default) keeps the TrainingArguments' precision.
            The callback changes no setting of a built Trainer, so ``"auto"``, or a precision the
            arguments do not set, is refused before training (plan it with
            :func:`~resource_guard.frontdoors.hf.plan.plan_training_args`); one they set is accepted.
        target_batch_size: the effective batch, ``per_device_train_batch_size ×
            gradient_accumulation_steps × world size``: accepted when it is the Trainer's, else refused
            before training (plan it with ``plan_training_args(..., target_batch_size=...)``).

    Attributes:
        plan: the :class:`~resource_guard.Plan` of the configured step (``None`` before training).
        report: the monitor's report once training ended.
        eval_checks: the evaluation pre-flights made.
        shape_stats: the shape guard's counts (shapes seen, batches checked, stops) once training ended.

    Example:
        >>> ResourceGuardCallback(headroom=0.95)
        Traceback (most recent call last):
        ...
        resource_guard.errors.ConfigurationError: `ResourceGuardCallback(headroom=0.95)` must be in [0, 0.9).
    """

    def __init__(
        self,
        device: str | None = None,
        memory_limit: int | str | None = None,
        headroom: float = 0.1,
        max_seq_len: int | None = None,
        worst_case_batch: Any = None,
        check_shapes: bool = True,
        check_eval: bool = True,
        monitor: bool = True,
        profile: bool | ProfileWindow = True,
        log_dir: str | os.PathLike[str] | None = None,
        loss_fn: Callable[[nn.Module, Any], Any] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
        verbose: bool = True,
        precision: str | None = None,
        target_batch_size: int | None = None,
    ) -> None:
        from resource_guard.frontdoors.hf.plan import EXPRESSIBLE
        from resource_guard.frontdoors.shape_guard import check_worst_case_args
        from resource_guard.frontdoors.vocabulary import check_shared, refused

        def bad(name: str, value: Any, allowed: str) -> ConfigurationError:
            return refused("ResourceGuardCallback", name, value, allowed)

        # the settings every door shares, in the same words (frontdoors/vocabulary.py)
        self.precision = check_shared(
            "ResourceGuardCallback", memory_limit=memory_limit, precision=precision,
            target_batch_size=target_batch_size, max_seq_len=max_seq_len, log_dir=log_dir,
            profile=profile, monitor=monitor, precisions=EXPRESSIBLE,
        )  # fmt: skip
        self.target_batch_size = target_batch_size
        if device is not None and not (isinstance(device, str) and device.strip()):
            raise bad("device", device, "a device name ('cpu', 'cuda:0', 'a100-40gb', ...) or None")
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 0.9:
            raise bad("headroom", headroom, "in [0, 0.9)")
        check_worst_case_args("ResourceGuardCallback", max_seq_len, check_shapes)
        for name, value in (("check_eval", check_eval), ("verbose", verbose)):
            if not isinstance(value, bool):
                raise bad(name, value, "True or False")
        for name, fn in (("loss_fn", loss_fn), ("compute_loss_func", compute_loss_func)):
            if fn is not None and not callable(fn):
                raise bad(name, fn, "a callable or None")
        self.device, self.memory_limit, self.headroom = device, memory_limit, float(headroom)
        self.max_seq_len, self.worst_case_batch = max_seq_len, worst_case_batch
        self.check_shapes, self.check_eval, self.monitor = check_shapes, check_eval, monitor
        self.profile, self.log_dir, self.verbose = profile, log_dir, verbose
        self.loss_fn, self.compute_loss_func = loss_fn, compute_loss_func
        self.plan: Plan | None = None
        self.report: Any = None
        self.shape_stats: dict[str, Any] | None = None
        self._evals = EvalPreflights()
        self._args: Any = None
        self._model: nn.Module | None = None
        self._hooks: tuple[Any, ...] = ()
        self._flops_per_step: float | None = None
        self._rows = 0  # the per-device batch of this attempt (auto_find_batch_size lowers it)
        self._errors_before: Any = None  # sys.last_value when the monitor started: an older error
        self._optimizer: torch.optim.Optimizer | None = None
        self._loss: Any = None
        self._keys: dict[str, tuple[torch.Size, torch.dtype]] = {}  # the planned batch's tensors
        self._shapes: Any = None
        self._monitor: Any = None
        self._phases: TrainerPhases | None = None  # switches the monitor's phase clock while training
        self._writer: Any = None
        self._eval_pending = True
        self._inside = False  # our own traces call the model: the hook ignores them
        self._input_name: str | None = None  # the processing class's first model input (its lengths)

    @classmethod
    def attach(cls, trainer: Any, **kwargs: Any) -> ResourceGuardCallback:
        """Add the callback to a built ``Trainer``, reading from it what its step runs: its
        ``compute_loss_func``, and its own ``compute_loss`` when a subclass overrides it (so the
        pre-flight traces the loss the Trainer computes, not the model's). ``kwargs`` are the
        constructor's; a ``loss_fn`` or ``compute_loss_func`` given there wins.

        Example:
            >>> from transformers import Trainer  # doctest: +SKIP
            >>> guard = ResourceGuardCallback.attach(trainer, memory_limit="8GiB")  # doctest: +SKIP
        """
        from transformers import Trainer

        if not isinstance(trainer, Trainer):
            raise ConfigurationError(
                f"`ResourceGuardCallback.attach(trainer=...)` must be a transformers Trainer, got "
                f"{type(trainer).__name__}."
            )
        if kwargs.get("compute_loss_func") is None:
            kwargs["compute_loss_func"] = getattr(trainer, "compute_loss_func", None)
        if kwargs.get("loss_fn") is None and type(trainer).compute_loss is not Trainer.compute_loss:

            def loss_fn(model: nn.Module, batch: Any) -> Any:  # the subclass's own loss
                return trainer.compute_loss(model, dict(batch))

            kwargs["loss_fn"] = loss_fn
        callback = cls(**kwargs)
        callback._args = trainer.args
        callback._check_against(trainer.args)
        trainer.add_callback(callback)
        if isinstance(trainer.model, nn.Module):
            callback._watch(trainer.model)
        return callback

    @property
    def eval_checks(self) -> list[Any]:
        return list(self._evals.checks)

    # -- the Trainer's events --------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Check the shared settings against the Trainer's arguments, and watch the model from the start,
        so that an evaluation before any training is pre-flighted."""
        self._args = args
        self._check_against(args)
        if isinstance(model, nn.Module):
            self._watch(model)

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        """The pre-flight of the configured step on every rank; ``DoesNotFitError`` before step 0."""
        self._args = args
        self._check_against(args)  # also here: a callback added after the Trainer was built
        self._input_name = hf_step.input_name_of(kwargs.get("processing_class"))
        if self._monitor is not None:  # the previous run ended without on_train_end
            self._stop_run(self._ended_early("the Trainer started training again before this run ended"))
        self.plan, self.report, self.shape_stats, self._eval_pending = None, None, None, True
        if not isinstance(model, nn.Module) or optimizer is None or train_dataloader is None:
            return
        self._watch(model)
        started = time.perf_counter()
        error: BaseException | None = None
        self._rows = per_device_rows(args, state)
        try:
            notes = self._preflight(args, model, optimizer, train_dataloader)
        except Exception as failure:  # every rank must reach the agreement below, also after an error
            error, notes = failure, []
        # the one collective of the pre-flight, made by every rank whatever its pre-flight did
        error, shapes_on = agree(error, self._shapes is not None)
        if error is not None:
            raise error
        if not shapes_on:
            self._shapes = None  # off on every rank alike
        assert self.plan is not None
        if self.verbose and args.process_index == 0:
            seconds = time.perf_counter() - started
            # arguments plan_training_args made were printed with their plan: one line confirms it
            say(
                self._confirm(args, seconds)
                if planned_by(args) is not None
                else self._render(args, seconds, notes)
            )
        if self.monitor:
            self._start_monitor(args, state, train_dataloader)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # a micro-batch of an accumulating step: its phases end, the monitor's step (an optimizer step,
        # the Trainer's global_step) goes on
        if self._phases is not None:
            self._phases.substep_end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._phases is not None:
            self._phases.step_end()
        if self._monitor is not None:
            self._monitor.step_end()

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._phases is not None:
            self._phases.logged()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._phases is not None:
            self._phases.saved()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._eval_pending = True  # the next evaluation's first batch is checked (once per shape)
        if self._phases is not None:
            self._phases.evaluated()

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self._eval_pending = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write and print the report; the model stays watched for later evaluations."""
        self._stop_run()

    def _check_against(self, args: Any) -> None:
        """Refuse, before any step, a shared setting the built Trainer does not have: this callback
        changes none (``plan_training_args`` plans them before the Trainer is built)."""
        call = "ResourceGuardCallback"
        if self.precision is not None:
            own = hf_step.precision_of(args) or "32-true"
            kept = (
                "bf16=True" if own == "bf16-mixed" else "fp16=True" if own == "16-mixed" else "no bf16/fp16"
            )
            if self.precision == "auto":
                raise ConfigurationError(
                    f"`{call}(precision='auto')`: the Trainer's precision is its TrainingArguments' ({own}: "
                    f"{kept}), fixed when the Trainer is built; this callback changes no setting. Let the "
                    "planner choose it before: `args = plan_training_args(model, args, train_dataset, "
                    "precision='auto')`, or leave `precision` out to keep the arguments' precision."
                )
            if self.precision != own:
                raise ConfigurationError(
                    f"`{call}(precision={self.precision!r})` is not the TrainingArguments' precision ({own}: "
                    f"{kept}), which the Trainer runs; set it in the TrainingArguments (or plan them with "
                    f"`plan_training_args(..., precision={self.precision!r})`), or leave `precision` out."
                )
        if self.target_batch_size is not None:
            rows, acc = int(args.per_device_train_batch_size), max(1, int(args.gradient_accumulation_steps))
            world = max(1, int(getattr(args, "world_size", 1) or 1))
            if self.target_batch_size != rows * acc * world:
                raise ConfigurationError(
                    f"`{call}(target_batch_size={self.target_batch_size})` is not the Trainer's effective "
                    f"batch, per_device_train_batch_size {rows} × gradient_accumulation_steps {acc} × world "
                    f"size {world} = {rows * acc * world}; this callback changes no setting. Plan the "
                    "arguments before building the Trainer: `args = plan_training_args(model, args, "
                    f"train_dataset, target_batch_size={self.target_batch_size})`."
                )
        if self.log_dir is not None and self.monitor and int(getattr(args, "process_index", 0) or 0) == 0:
            from resource_guard.frontdoors.guard.args import check_log_dir

            check_log_dir(self.log_dir, call)  # now, not after the pre-flight

    # -- the pre-flight --------------------------------------------------------------------------
    def _preflight(self, args: Any, model: nn.Module, optimizer: Any, loader: Any) -> list[str]:
        from resource_guard.frontdoors.shape_guard import start_shape_guard
        from resource_guard.planning.planner import plan
        from resource_guard.planning.worst_case import describe_signature, signature_of

        self._optimizer = hf_step.unwrap_optimizer(optimizer)
        self._loss = hf_step.trainer_loss(
            model, args, compute_loss_func=self.compute_loss_func, loss_fn=self.loss_fn
        )
        step = hf_step.trainer_step(self._loss, args.max_grad_norm)
        rows = self._rows
        collate = getattr(loader, "collate_fn", None) or default_collator()
        batch = sample = hf_step.sample_batch(loader.dataset, collate, rows, args.device)
        notes: list[str] = []
        worst = None
        if self.check_shapes:
            worst = hf_step.worst_case_of(
                batch, max_seq_len=self.max_seq_len, worst_case_batch=self.worst_case_batch,
                collate=collate, dataset=loader.dataset,
            ) or hf_step.longest_batch(
                batch, loader.dataset, collate, rows, args.device, input_name=self._input_name
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
        with self._tracing(model):
            made = plan(
                model, [self._optimizer], batch, step, device=self.device or str(args.device),
                target_batch_size=rows * world, headroom=self.headroom, precision=precision,
                checkpointing=False, world_size=world, strategy="ddp" if world > 1 else "single",
                memory_limit=self.memory_limit, allow_rough=True,
            )  # fmt: skip
        self.plan = made
        acc = max(1, int(args.gradient_accumulation_steps))
        if made.accumulation_steps == 1 and acc > 1:  # micro-steps 2..k start with the gradients allocated
            kept = made.estimate.for_device(made.device, headroom=self.headroom, gradients_kept=True)
            made = self.plan = dataclasses.replace(
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
        if self.monitor:  # model FLOPs of the run's typical batch, for MFU
            self._flops_per_step = self._count_flops(model, sample)
        self._keys = {k: (v.shape, v.dtype) for k, v in batch.items() if isinstance(v, torch.Tensor)} if (
            isinstance(batch, dict)
        ) else {}  # fmt: skip
        if self.check_shapes:
            try:
                with self._tracing(model):
                    self._shapes, more = start_shape_guard(
                        model, [self._optimizer], batch, step, made, traced_plan=True,
                        trace_context=lambda: self._tracing(model),
                    )  # fmt: skip
                notes += [
                    *more,
                    "shape guard: each batch is checked before it runs; one that would not fit stops the run",
                ]
            except DoesNotFitError:
                raise
            except Exception as error:  # our check never stops the run
                warn_at_user(f"ResourceGuardCallback: the shape check is off: {error!r}")
                self._shapes = None
        self.plan = auto_detected(dataclasses.replace(made, reasons=(*made.reasons, *notes)), self.device)
        return notes

    def _count_flops(self, model: nn.Module, batch: Any) -> float | None:
        """Model FLOPs of one micro-step (forward and backward, the loader's first batch: the run's
        typical one, not its worst case), for MFU; counted on a fake copy in eval mode, so that the
        model's own gradient checkpointing does not count its recomputed forward."""
        from resource_guard.observe.throughput import count_flops

        loss = self._loss

        def model_flops_loss(m: nn.Module, b: Any) -> Any:
            return loss(m.eval(), b)

        with self._tracing(model):
            return count_flops(model, batch, model_flops_loss)

    def _confirm(self, args: Any, seconds: float) -> str:
        """One line: the Trainer's step is the one ``plan_training_args`` planned (and printed), and fits."""
        assert self.plan is not None
        made = self.plan
        guard = "; each batch checked before it runs" if self._shapes is not None else ""
        acc = args.gradient_accumulation_steps
        used, usable = mib(made.fit.device_total_bytes), mib(made.fit.usable_bytes)
        return (
            f"ResourceGuard pre-flight of the Trainer's step ({seconds:.1f} s): as plan_training_args "
            f"planned it (per-device batch {made.micro_batch_size} × accumulation {acc}, {made.precision}): "
            f"{used} of {usable} usable on {made.device.name}, fits{guard}"
        )

    def _render(self, args: Any, seconds: float, notes: list[str]) -> str:
        assert self.plan is not None
        settings = {
            "per_device_train_batch_size": self._rows,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "bf16": bool(args.bf16),
            "fp16": bool(args.fp16),
            hf_step.checkpointing_fields(args)[0]: bool(getattr(args, hf_step.checkpointing_fields(args)[0])),
        }
        made, acc = self.plan, args.gradient_accumulation_steps
        ckpt = self._model is not None and checkpointed(self._model)
        head = (
            f"ResourceGuard pre-flight of the Trainer's step ({seconds:.1f} s): per-device batch "
            f"{made.micro_batch_size} × accumulation {acc} × world size {made.world_size} = "
            f"{made.micro_batch_size * acc * made.world_size}; precision {made.precision}; gradient "
            f"checkpointing {'on' if ckpt else 'off'}: "
            f"{mib(made.fit.device_total_bytes)} of {mib(made.fit.usable_bytes)} usable, fits"
        )
        return render(made, settings, seconds, head)

    @contextlib.contextmanager
    def _tracing(self, model: nn.Module) -> Iterator[None]:
        """Our own traces: the hook ignores them; the Trainer's autocast (when a check runs inside its
        forward) is off, as the estimate emulates the precision itself; grad mode on (the estimates
        trace a step and decide eval mode themselves)."""
        inside, self._inside = self._inside, True
        try:
            with contextlib.ExitStack() as stack:
                for kind in ("cpu", "cuda"):
                    if torch.is_autocast_enabled(kind):
                        stack.enter_context(torch.autocast(kind, enabled=False))
                stack.enter_context(without_accelerate_autocast(model))
                stack.enter_context(torch.enable_grad())  # an evaluation loop runs under no_grad
                yield
        finally:
            self._inside = inside

    # -- the batches, seen by the model ------------------------------------------------------------
    def _watch(self, model: nn.Module) -> None:
        if self._model is model and self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self._model = model
        self._hooks = (
            model.register_forward_pre_hook(ModelHook(self._before_forward), with_kwargs=True),
            model.register_forward_hook(ModelHook(self._after_forward), always_call=True),
        )

    def _after_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """After every forward, also one that raised (``always_call``: then ``output`` is ``None`` and the
        error is being handled): an out-of-memory error in training closes the run now, while the
        allocator still holds what the step allocated."""
        if self._monitor is None or self._inside or module is not self._model:
            return
        if output is not None:
            if self._phases is not None:
                self._phases.forward_end(module.training)
            return
        error = sys.exc_info()[1]
        if module.training and is_oom(error):
            self._stop_run(error)

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._inside or module is not self._model:
            return
        if not module.training:
            if self._phases is not None:
                self._phases.forward_start(False)
            if self.check_eval and self._eval_pending:
                self._eval_pending = False
                self._preflight_eval(module, kwargs)
            return
        batch = self._as_planned(kwargs)
        if self._shapes is not None and batch is not None:
            try:
                with self._tracing(module):
                    self._shapes.stop_if_too_big(batch)
            except DoesNotFitError as error:
                self._stop_run(error)
                raise
        if self._monitor is not None:
            self._monitor.batch_ready(batch if batch is not None else kwargs)
        if self._phases is not None:
            self._phases.forward_start(True)

    def _as_planned(self, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The forward's keyword tensors as the planned batch had them: the Trainer's extra arguments
        (``num_items_in_batch``) left out; labels the Trainer took out for its own loss (label smoothing)
        put back as the tensor of the planned batch's shape and dtype (``input_ids``) the forward has.
        ``None`` when the batch cannot be matched (the check then skips it)."""
        if not self._keys:
            return None
        batch: dict[str, Any] = {}
        for key, planned in self._keys.items():
            if key in kwargs:
                batch[key] = kwargs[key]
                continue
            twin = next((k for k, p in self._keys.items() if k in kwargs and p == planned), None)
            if twin is None:
                return None
            batch[key] = kwargs[twin]
        return batch

    def _preflight_eval(self, model: nn.Module, kwargs: dict[str, Any]) -> None:
        from resource_guard.devices import resolve_device

        args = self._args
        if args is None or not kwargs:
            return
        made = self.plan
        spec = made.device if made is not None else resolve_device(self.device or str(args.device))
        if made is None and self.memory_limit is not None:
            spec = spec.with_memory(parse_memory_limit(self.memory_limit, "ResourceGuardCallback"))
        loss = self._loss or hf_step.trainer_loss(
            model, args, compute_loss_func=self.compute_loss_func, loss_fn=self.loss_fn
        )
        batch = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
        try:
            with self._tracing(model):
                check = self._evals.check(
                    model, batch, loss, loop="evaluation", device=spec,
                    optimizer=self._optimizer if made is not None else None, gradients_kept=False,
                    precision=hf_step.precision_of(args) or "32-true", headroom=self.headroom,
                )  # fmt: skip
        except DoesNotFitError as error:
            self._stop_run(error)
            raise
        if check is None:
            return
        if self.verbose and args.process_index == 0:
            say(f"ResourceGuard: {check.line()}")
        if self._monitor is not None:
            self._monitor.note(check.line())

    # -- monitoring ------------------------------------------------------------------------------
    def _start_monitor(self, args: Any, state: Any, loader: Any) -> None:
        assert self.plan is not None
        if args.process_index == 0 and "tensorboard" in (args.report_to or []):
            self._writer = tensorboard_writer(args)
        if self._writer is not None:
            with contextlib.suppress(Exception):  # a broken writer is the monitor's to report
                head, _, rest = self._render(args, 0.0, []).partition("\n")
                self._writer.add_text(_TEXT_TAG, f"{head}\n\n{rest}", state.global_step)
        log_dir = self.log_dir or os.path.join(args.output_dir, "resource_guard")
        self._monitor = build_monitor(
            args, state, self.plan, log_dir, self.profile, self._writer, self._shapes, self._flops_per_step
        )
        self._errors_before = getattr(sys, "last_value", None)
        self._monitor.start()
        if self._monitor.phases is not None:  # the Trainer's boundaries (frontdoors/hf/phases.py)
            self._phases = TrainerPhases(self._monitor.phases)
            self._phases.install(self._optimizer, loader)
            for line in self._phases.notes:
                self._monitor.note(line)
        atexit.register(self._close_at_exit)

    def _ended_early(self, why: str) -> BaseException:
        """The error that ended the run: the one Python kept as uncaught since the monitor started (a
        script's, at exit; a notebook's), else a :class:`RunEndedEarly` saying ``why``."""
        error = getattr(sys, "last_value", None)
        if isinstance(error, BaseException) and error is not self._errors_before:
            return error
        return RunEndedEarly(f"{why} (no on_train_end: an error the callback did not see)")

    def _close_at_exit(self) -> None:
        self._stop_run(self._ended_early("the process exited before the Trainer's run ended"))

    def _stop_run(self, exc: BaseException | None = None) -> None:
        """Close the monitor (the report is written and printed) and its writer. Safe to call twice."""
        phases, self._phases = self._phases, None
        if phases is not None:
            phases.remove()
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            atexit.unregister(self._close_at_exit)
            self.report = monitor.close(exc)
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        if self._shapes is not None:
            self.shape_stats = self._shapes.stats()
        self._shapes = None
