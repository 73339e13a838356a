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

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from transformers import TrainerCallback

from resource_guard.errors import DoesNotFitError
from resource_guard.frontdoors.eval_preflight import EvalPreflights
from resource_guard.frontdoors.hf import step as hf_step
from resource_guard.frontdoors.hf.phases import TrainerPhases
from resource_guard.frontdoors.hf.plan import say
from resource_guard.frontdoors.hf.preflight import (
    attach_kwargs,
    check_against,
    check_settings,
    preflight_eval_batch,
    preflight_line,
    preflight_step,
    render_preflight,
)
from resource_guard.frontdoors.hf.runtime import build_monitor, per_device_rows, plan_writer
from resource_guard.frontdoors.hf.watch import ModelWatch, as_planned
from resource_guard.frontdoors.run import Run, RunEndedEarly
from resource_guard.observe.oom import is_oom
from resource_guard.observe.profiling import ProfileWindow

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = ["ResourceGuardCallback", "RunEndedEarly"]


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
        log_every_n_steps / log_interval_s: how often the monitor logs (on the ``global_step`` axis): by
            default every optimizer step for the first 20, then about every ``log_interval_s`` seconds
            (2); an int ``n``: after step 1 and every ``n``-th step.

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
        log_every_n_steps: int | None = None,
        log_interval_s: float = 2.0,
    ) -> None:
        self.precision = check_settings(
            device=device, memory_limit=memory_limit, headroom=headroom, max_seq_len=max_seq_len,
            check_shapes=check_shapes, check_eval=check_eval, monitor=monitor, profile=profile,
            log_dir=log_dir, loss_fn=loss_fn, compute_loss_func=compute_loss_func, verbose=verbose,
            precision=precision, target_batch_size=target_batch_size,
            log_every_n_steps=log_every_n_steps, log_interval_s=log_interval_s,
        )  # fmt: skip
        self.log_every_n_steps, self.log_interval_s = log_every_n_steps, log_interval_s
        self.target_batch_size = target_batch_size
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
        self._rows = 0  # the per-device batch of this attempt (auto_find_batch_size lowers it)
        self._made: Any = None  # the pre-flight's Preflight: optimizer, loss, shape guard, planned tensors
        self._shapes: Any = None
        self._run = Run("ResourceGuardCallback")
        self._hooks = ModelWatch(
            self._train_forward, self._eval_forward, self._forward_end, self._forward_error
        )
        self._eval_pending = True
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
        callback = cls(**attach_kwargs(trainer, kwargs))
        callback._args = trainer.args
        check_against(callback, trainer.args)
        trainer.add_callback(callback)
        if isinstance(trainer.model, nn.Module):
            callback._hooks.watch(trainer.model)
        return callback

    @property
    def eval_checks(self) -> list[Any]:
        return list(self._evals.checks)

    # -- the Trainer's events --------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Check the shared settings against the Trainer's arguments, and watch the model from the start,
        so that an evaluation before any training is pre-flighted."""
        self._args = args
        check_against(self, args)
        if isinstance(model, nn.Module):
            self._hooks.watch(model)

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
        check_against(self, args)  # also here: a callback added after the Trainer was built
        self._input_name = hf_step.input_name_of(kwargs.get("processing_class"))
        if self._run.monitor is not None:  # the previous run ended without on_train_end
            self._stop_run(self._run.ended_early("the Trainer started training again before this run ended"))
        self.plan, self.report, self.shape_stats, self._eval_pending = None, None, None, True
        if not isinstance(model, nn.Module) or optimizer is None or train_dataloader is None:
            return
        self._hooks.watch(model)
        started, self._rows = time.perf_counter(), per_device_rows(args, state)
        # the one collective of the pre-flight, made by every rank whatever its pre-flight did; the shape
        # guard stays on on every rank or on none (a rank must not wait in a per-batch agreement alone)
        agreed = self._run.preflight(lambda: self._preflight(args, model, optimizer, train_dataloader), 1)
        if agreed.error is not None:
            raise agreed.error
        assert self.plan is not None and agreed.row is not None
        if not agreed.row[0]:
            self._shapes = None
        if self.verbose and args.process_index == 0:
            seconds, shapes_on = time.perf_counter() - started, self._shapes is not None
            say(preflight_line(self.plan, args, self._rows, self._hooks.model, seconds, shapes_on))
        if self.monitor:
            self._start_monitor(args, state, train_dataloader)

    def _preflight(self, args: Any, model: nn.Module, optimizer: Any, loader: Any) -> list[int]:
        """This rank's pre-flight; its row for the agreement: whether its shape guard is on."""
        made = preflight_step(
            self, args, model, optimizer, loader, self._rows, self._hooks.tracing, self._input_name
        )
        self._made, self._shapes, self.plan = made, made.shapes, made.plan
        return [int(made.shapes is not None)]

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # a micro-batch of an accumulating step: its phases end, the monitor's step (an optimizer step,
        # the Trainer's global_step) goes on
        self._run.phase("substep_end")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._run.phase("step_end")
        self._run.call("step_end")

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._run.phase("logged")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._run.phase("saved")

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._eval_pending = True  # the next evaluation's first batch is checked (once per shape)
        self._run.phase("evaluated")

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self._eval_pending = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write and print the report; the model stays watched for later evaluations."""
        self._stop_run()

    # -- the model's forwards (frontdoors/hf/watch.py) -------------------------------------------
    def _train_forward(self, kwargs: dict[str, Any]) -> None:
        """A training batch, about to run: the shape guard's check, then the monitor's step begins."""
        batch = as_planned(kwargs, self._made.keys) if self._made is not None else None
        if self._shapes is not None and batch is not None:
            try:
                with self._hooks.tracing():
                    self._shapes.stop_if_too_big(batch)
            except DoesNotFitError as error:
                self._stop_run(error)
                raise
        self._run.call("batch_ready", batch if batch is not None else kwargs)
        self._run.phase("forward_start", True)

    def _eval_forward(self, kwargs: dict[str, Any]) -> None:
        self._run.phase("forward_start", False)
        if self.check_eval and self._eval_pending:
            self._eval_pending = False
            self._preflight_eval(kwargs)

    def _forward_end(self, training: bool) -> None:
        self._run.phase("forward_end", training)

    def _forward_error(self, error: BaseException | None, training: bool) -> None:
        """An out-of-memory error in a training forward closes the run now, while the allocator still
        holds what the step allocated."""
        if self._run.monitor is not None and training and is_oom(error):
            self._stop_run(error)

    def _preflight_eval(self, kwargs: dict[str, Any]) -> None:
        try:
            check = preflight_eval_batch(self, self._hooks, self._made, kwargs)
        except DoesNotFitError as error:
            self._stop_run(error)
            raise
        if check is not None:
            if self.verbose and self._args.process_index == 0:
                say(f"ResourceGuard: {check.line()}")
            self._run.call("note", check.line())

    # -- the run's monitor (frontdoors/run.py) ---------------------------------------------------
    def _start_monitor(self, args: Any, state: Any, loader: Any) -> None:
        made = self.plan
        assert made is not None
        writer = plan_writer(args, render_preflight(made, args, self._rows, self._hooks.model, 0.0), state)
        if writer is not None:
            self._run.closing.append(writer.close)
        log_dir = self.log_dir or os.path.join(args.output_dir, "resource_guard")
        flops = self._made.flops_per_step if self._made is not None else None
        max_steps = int(getattr(state, "max_steps", 0) or 0)
        monitor = self._run.start(
            lambda: build_monitor(args, made, log_dir, self.profile, writer, flops, self._cadence()),
            made, shapes=self._shapes, total_steps=max_steps if max_steps > 0 else None,
            notes=made.reasons, close_at_exit=True,
        )  # fmt: skip
        if monitor is not None and monitor.phases is not None:  # the Trainer's boundaries (hf/phases.py)
            phases = self._run.phases = TrainerPhases(monitor.phases)
            phases.install(self._made.optimizer if self._made is not None else None, loader)
            for line in phases.notes:
                monitor.note(line)

    def _cadence(self) -> dict[str, Any]:
        return {"log_every_n_steps": self.log_every_n_steps, "log_interval_s": self.log_interval_s}

    def _stop_run(self, exc: BaseException | None = None) -> None:
        """Close the run (the report is written and printed, the writer closed). Safe to call twice."""
        report = self._run.close(exc)
        if report is not None:
            self.report = report
        if self._shapes is not None:
            self.shape_stats = self._shapes.stats()
        self._shapes = None
