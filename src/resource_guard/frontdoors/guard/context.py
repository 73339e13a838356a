"""The plain-PyTorch front door: ``with guard(model, optimizer) as g: ...``.

On enter the guard plans the run (device, precision, activation checkpointing, micro-batch and
gradient accumulation) from a sample batch — or, lazily, from the first batch of
:meth:`Guard.iterate` — and fails fast with :class:`~resource_guard.errors.DoesNotFitError` before any
step when nothing fits. It then moves the model and the optimizer state to the device, applies
checkpointing, and keeps a GradScaler for ``16-mixed``. In the loop, :meth:`Guard.iterate` moves
batches to the device, times the data wait and yields micro-batches; :meth:`Guard.autocast` is the
precision's autocast; :meth:`Guard.backward` scales the loss for accumulation (and loss scaling) and
steps and zeroes the optimizer when an effective batch is complete. On exit — also on an exception or
``KeyboardInterrupt`` — it stops what it started, writes what it measured next to the estimate into
the log dir, and lets the user's exception through unchanged. When that exception is an
out-of-memory error (``torch.OutOfMemoryError``, by type), the monitor also writes the last memory
figures into ``oom.json`` and the report (finding ``oom``), and on CUDA with ``memory_history=True`` a
memory snapshot for https://pytorch.org/memory_viz (see :mod:`resource_guard.observe.oom`).

Without ``loss_fn`` the guard plans from the model's own loss when its output carries one, else from a
stated stand-in (:class:`~resource_guard.step.training.StandInLoss`: a cross-entropy-shaped float32
reduction of the outputs), so a model that returns logits while the loop computes the loss works as
written; the plan's reasons then say so once, and ``loss_fn=`` makes the estimate exact.

Example:
    >>> import torch
    >>> from resource_guard import guard
    >>> model = torch.nn.Linear(8, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(2)]
    >>> with guard(model, optimizer, device="cpu", monitor=False) as g:
    ...     for x, y in g.iterate(data):
    ...         with g.autocast():
    ...             loss = torch.nn.functional.mse_loss(model(x), y)
    ...         stepped = g.backward(loss)  # True when the optimizer stepped
    >>> g.optimizer_steps
    2
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError, DoesNotFitError, warn_at_user
from resource_guard.estimate.user_step import manual_update_stand_in
from resource_guard.frontdoors.eval_preflight import EvalPreflights
from resource_guard.frontdoors.guard.args import check_device_and_catalog, check_log_dir, torch_device_of
from resource_guard.frontdoors.guard.batches import MicroBatches, expect_steps, to_device
from resource_guard.frontdoors.guard.evaluation import EvalMode, preflight_eval
from resource_guard.frontdoors.guard.observed import LoopWatch, loop_precision, outputs_as_kept, own_precision
from resource_guard.frontdoors.guard.setup import (
    flops_per_sample,
    make_plan,
    prepare_model,
    start_monitor,
)
from resource_guard.frontdoors.guard.stepper import Stepper
from resource_guard.frontdoors.guard.summary import run_summary
from resource_guard.observe.loader_settings import loader_settings
from resource_guard.step.batching import split_batch
from resource_guard.step.precision import autocast_context, parse_precision
from resource_guard.step.training import LossFn, StandInLoss, batch_size_of

if TYPE_CHECKING:
    from resource_guard.devices import DeviceSpec
    from resource_guard.observe.phases import PhaseClock
    from resource_guard.planning.planner import Plan

__all__ = ["Guard", "check_log_dir", "guard", "torch_device_of"]


class Guard:
    """The context manager returned by :func:`guard`; see the module docstring.

    Each batch's shape is checked against the plan before it runs (``check_shapes=True``): a batch too
    big for the plan runs as smaller micro-batches that fit, with the effective batch, the loss
    weighting and the optimizer steps unchanged (:mod:`~resource_guard.frontdoors.shape_guard`). The
    run's largest batch, declared (``max_seq_len=``, ``worst_case_batch=``) or declared by the loader,
    is traced before any step; the plan's reasons say what it needs.

    Attributes:
        plan: the :class:`~resource_guard.Plan` once made (``None`` before the first batch when
            no ``sample_batch`` was given).
        device: the torch device the run uses (``None`` until planned).
        optimizer_steps: optimizer steps taken (skipped GradScaler steps included).
        micro_steps: micro-batches processed.
        report: the monitor's report after exit (``None`` when monitoring is off).

    ``precision``: by default the loop's own (its parameters' dtype: fp32 is ``"32-true"``, a float64
    model ``"64-true"``; an unchanged loop's autocast is seen at its first forward): the guard changes
    no numerics unless asked. ``"auto"`` lets it choose (bf16 where the device runs it well), a
    precision name sets it (with ``g.autocast()`` in the loop).

    ``keep_outputs``: the traced step keeps the model's outputs alive through backward and the optimizer
    step, as a loop holding them in a variable does (``logits, loss = model(x, y)``); ``False`` for a
    loop that frees them once the loss is computed (``loss = crit(model(x), y)``).

    Around an unchanged loop (no ``g.iterate``), the guard watches it through hooks instead
    (:mod:`~resource_guard.frontdoors.guard.observed`): pre-flight at the first training forward,
    phases, steps and the loop's accumulation counted, the report written at exit; nothing applied.

    ``batch_dim``: where the batch is in the loop's inputs. ``None`` (default): the model says (its first
    ``batch_first=False`` LSTM/GRU/RNN/``nn.Transformer*`` layer: dim 1), else dim 0; ``1`` declares a
    sequence-first loop (``(seq, batch, ...)`` inputs, flat ``(seq * batch,)`` targets), observed unchanged
    (``g.iterate`` cuts along dim 0 and refuses it).

    ``eval_sample_batch``: one batch of the evaluation loop (its own batch size and shapes), whose step
    is pre-flighted with the plan, before any training step, as it will run after the first optimizer
    step (see :meth:`evaluate`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
        *,
        sample_batch: Any = None,
        loss_fn: LossFn | None = None,
        target_batch_size: int | None = None,
        device: str | DeviceSpec = "auto",
        precision: str | None = None,
        checkpointing: bool | str = "auto",
        memory_limit: int | str | None = None,
        headroom: float = 0.1,
        log_dir: str | os.PathLike[str] | None = None,
        clip_grad_norm: float | None = None,
        monitor: bool = True,
        profile: Any = True,
        catalog: Any = None,
        memory_history: bool = False,
        eval_sample_batch: Any = None,
        max_seq_len: int | None = None,
        worst_case_batch: Any = None,
        check_shapes: bool = True,
        keep_outputs: bool = True,
        batch_dim: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigurationError(
                f"`guard(model=...)` must be a torch.nn.Module, got {type(model).__name__}."
            )
        several = isinstance(optimizer, (list, tuple))  # a GAN's loop: g.backward(loss, optimizer=...)
        from resource_guard.estimate.user_step import UserStep

        # several optimizers and no user step: an unchanged loop, its first step recorded (recorded.py)
        self._recording = several and not isinstance(loss_fn, UserStep)
        if several:
            from resource_guard.estimate.user_step import check_optimizers

            check_optimizers(model, optimizer, loss_fn, "guard", recorded=self._recording)
        elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(
                f"`guard(optimizer=...)` must be a torch.optim.Optimizer, a list of them, or "
                "`optimizer=None` for a loop that updates the parameters by hand "
                f"(`p.data.add_(p.grad, alpha=-lr)`), got {type(optimizer).__name__}."
            )
        if optimizer is None and sample_batch is not None:
            raise ConfigurationError(
                "`guard(model, None, sample_batch=...)`: with manual updates (`optimizer=None`) the loop "
                "updates the parameters itself, so `g.iterate`/`g.backward` cannot step it. Remove "
                "`sample_batch=` and leave the loop unchanged: the guard pre-flights its first forward."
            )
        from resource_guard.frontdoors.vocabulary import check_shared
        from resource_guard.planning.planner import _check_args

        # the settings every door shares, in the same words (frontdoors/vocabulary.py)
        precision = check_shared(
            "guard", memory_limit=memory_limit, precision=precision, target_batch_size=target_batch_size,
            max_seq_len=max_seq_len, log_dir=log_dir, profile=profile, monitor=monitor,
        )  # fmt: skip
        _check_args(headroom, target_batch_size, 1, "auto", checkpointing, call="guard")
        catalog = check_device_and_catalog(device, catalog)
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ConfigurationError(f"`guard(clip_grad_norm={clip_grad_norm!r})` must be > 0 or None.")
        if not isinstance(memory_history, bool):
            raise ConfigurationError(f"`guard(memory_history={memory_history!r})` must be True or False.")
        if not isinstance(keep_outputs, bool):
            raise ConfigurationError(f"`guard(keep_outputs={keep_outputs!r})` must be True or False.")
        self._keep_outputs = keep_outputs
        from resource_guard.frontdoors.guard.batch_dim import check_batch_dim

        self._batch_dim = check_batch_dim(batch_dim)
        if self._batch_dim == 1 and sample_batch is not None:
            raise ConfigurationError(
                "`guard(..., batch_dim=1, sample_batch=...)`: `g.iterate` cuts batches along dim 0. Leave "
                "the sequence-first loop unchanged under `with guard(model, optimizer, batch_dim=1):` (the "
                "guard pre-flights its first forward), or give batch-first batches to `g.iterate`."
            )
        from resource_guard.frontdoors.shape_guard import check_worst_case_args

        check_worst_case_args("guard", max_seq_len, check_shapes)
        self._worst = (max_seq_len, worst_case_batch, check_shapes)
        self._shapes: Any = None  # the ShapeGuard, once planned
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.optimizers: tuple[torch.optim.Optimizer, ...] = (
            tuple(optimizer)
            if isinstance(optimizer, (list, tuple))
            else ()
            if optimizer is None
            else (optimizer,)
        )
        # what the estimate steps: a manual-update loop's in-place, stateless update when there is none
        self._planned_optimizers = self.optimizers or (manual_update_stand_in(model),)
        self._sample_batch = sample_batch
        self._eval_sample = eval_sample_batch  # pre-flighted with the plan (see `evaluate`)
        self._target = target_batch_size
        self._plan_kwargs: dict[str, Any] = {
            "device": device,
            "precision": precision,
            "checkpointing": checkpointing,
            "memory_limit": memory_limit,
            "headroom": headroom,
            "catalog": catalog,
        }
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._clip = clip_grad_norm
        self._monitor_on, self._profile, self._history = monitor, profile, memory_history
        self._flops_per_sample: float | None = None
        self.plan: Plan | None = None
        self.device: torch.device | None = None
        self.micro_steps = 0
        self.report: Any = None
        self._monitor: Any = None
        self._scaler: torch.amp.GradScaler | None = None
        self._ckpt: Any = None
        self._entered = False
        self._eval_mode = EvalMode(model)  # train and grad mode to restore after evaluate
        self._evals = EvalPreflights()
        self._stepper: Stepper | None = None  # backward and optimizer steps, once planned
        self._micro: MicroBatches | None = None  # the micro-batch size of each batch, once planned
        self._clock: PhaseClock | None = None  # the monitor's phase clock, once it runs
        self._current_micro = 0  # size of the micro-batch being processed
        self._started = 0.0
        self._watch: LoopWatch | None = None  # the hooks of an unchanged loop (no g.iterate)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (skipped GradScaler steps included); of an unchanged loop: its own."""
        if self._watch is not None:
            return self._watch.steps
        return self._stepper.optimizer_steps if self._stepper is not None else 0

    # ------------------------------------------------------------------------------------------------
    # context manager

    def __enter__(self) -> Guard:
        if self._entered:
            raise ConfigurationError("this guard is already in use; create a new `guard(...)` per run.")
        self._entered = True
        self._started = time.perf_counter()
        if self._log_dir is not None:
            check_log_dir(self._log_dir)
        if self._sample_batch is not None:
            self._setup(self._sample_batch)
        else:  # until the loop calls g.iterate: watch it as it is (frontdoors/guard/observed.py)
            self._watch = LoopWatch(
                self.model,
                self.optimizers,
                self._setup_observed,
                self._gradients_kept,
                self._closure_loss,
                record=self._setup_recorded if self._recording else None,
            )
            self._watch.install()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._teardown(exc)
        except Exception as error:  # our own clean-up never replaces the user's exception
            warn_at_user(f"resource_guard: clean-up failed: {error!r}")
        # returning None lets the user's exception (if any) through unchanged

    # ------------------------------------------------------------------------------------------------
    # set-up (the parts: frontdoors/guard/setup.py)

    def _setup(self, batch: Any, loader: Any = None) -> None:
        if self._recording:  # g.iterate / sample_batch= with several optimizers: the guard runs the step
            from resource_guard.estimate.user_step import check_optimizers

            check_optimizers(self.model, list(self.optimizers), self.loss_fn, "guard")
        target = self._target if self._target is not None else batch_size_of(batch)
        if target is None:
            from resource_guard.frontdoors.guard.batch_dim import infer_batch_dim

            said = infer_batch_dim(self.model)[1]
            raise ConfigurationError(
                "cannot tell the batch size of the sample batch (its tensors do not share dim 0)"
                + (f"; the model says why: {said}" if said else "")
                + ". `g.iterate` cuts batches along dim 0: give it batch-first batches, or leave a "
                "sequence-first loop unchanged under `with guard(model, optimizer, batch_dim=1):`."
            )
        self._target = target
        loss_fn = self.loss_fn if self.loss_fn is not None else StandInLoss()  # several: a UserStep
        loss_fn = outputs_as_kept(loss_fn, self._keep_outputs)
        kwargs, own = self._plan_kwargs, self._plan_kwargs["precision"] is None
        if own:  # numerics by consent: the loop's own precision unless precision= says otherwise
            kwargs = {**kwargs, "precision": loop_precision(self.model, "cpu")}
        self.plan, self.device = make_plan(
            self.model, self._planned_optimizers, batch, loss_fn, target, kwargs
        )
        if own:
            self.plan = own_precision(self.plan, "the loop's own (its parameters' dtype)")
        if self._eval_sample is not None:  # the evaluation to come, before any step
            self._preflight_eval(self._eval_sample, later=True)
        if self._monitor_on:  # model FLOPs, before checkpointing adds its recomputation
            self._flops_per_sample = flops_per_sample(self.model, batch, loss_fn, self._planned_optimizers)
        prepared = prepare_model(self.model, self.optimizers, self.plan, self.device)
        self._ckpt, self._scaler = prepared.checkpointing, prepared.scaler
        if self._worst[2]:  # the shape guard; the worst case known before any step (it may split)
            self._start_shape_guard(batch, loss_fn, loader)
        self._stepper = Stepper(self.optimizers, target, self._scaler, self._clip)
        several = len(self.optimizers) > 1
        self._micro = MicroBatches(self._shapes, several)
        if self._monitor_on:
            self._monitor = self._start_monitor(self._shapes)
            self._clock = self._monitor.phases if self._monitor is not None else None
            self._stepper.clock = self._clock
            for check in self._evals.checks:  # pre-flighted with the plan: into the report too
                self._call_monitor("note", check.line())

    def _setup_observed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The unchanged loop's first training forward, before it runs: its step pre-flighted as the loop
        runs it (``DoesNotFitError`` stops it), then the monitor. Nothing is moved or changed."""
        from resource_guard.frontdoors.guard.observed import forward_batch, plan_as_run

        watch = self._watch
        assert watch is not None
        self.plan, self.device, loss, dim = plan_as_run(
            self.model,
            self._planned_optimizers,
            args,
            kwargs,
            self.loss_fn,
            self._plan_kwargs,
            self._keep_outputs,
            self._batch_dim,
        )
        watch.batch_dim = dim
        self._target = self.plan.target_batch_size
        if self._worst[2]:  # check_shapes: a later forward of a larger shape is refused before it runs
            self._start_observed_shape_guard(forward_batch(args, kwargs), loss, dim)
        self.plan = self._with_reasons(
            "unchanged loop: observed through hooks; nothing applied (the loop's device, precision and "
            "batch run as written); to let the guard apply a plan, loop with `g.iterate` and `g.backward`"
        )
        if not self.optimizers:
            self.plan = self._with_reasons(
                "manual updates (`optimizer=None`): planned as an in-place update with no optimizer state, "
                "the gradients freed before the next forward (`model.zero_grad()`); a step is counted at "
                "each training forward that follows a backward"
            )
        if self._monitor_on:
            batch, traced = forward_batch(args, kwargs), self.model
            if dim:  # FLOPs per sample of the batch-first view the plan traced
                from resource_guard.frontdoors.guard.batch_dim import BatchFirstView, to_batch_first

                traced, batch = BatchFirstView(self.model, dim, batch), to_batch_first(batch, dim)
            per_sample = flops_per_sample(traced, batch, loss, self._planned_optimizers)
            self._monitor = self._start_monitor(None)
            self._clock = self._monitor.phases if self._monitor is not None else None
            watch.monitor, watch.clock, watch.flops_per_sample = self._monitor, self._clock, per_sample

    def _start_observed_shape_guard(self, batch: Any, loss: Any, dim: int) -> None:
        """The shape guard of an unchanged loop: planned on its first forward's inputs (batch-first when
        its batch is dim ``dim``); the watch asks it before each later training forward."""
        watch = self._watch
        assert watch is not None and self.plan is not None
        model: nn.Module = self.model
        if dim:
            from resource_guard.frontdoors.guard.batch_dim import BatchFirstView, to_batch_first

            model, batch = BatchFirstView(self.model, dim, batch), to_batch_first(batch, dim)
        # the watch's own hooks are quiet here; the loop runs each batch whole
        self._start_shape_guard(batch, loss, None, model=model, whole_batches=True)
        watch.shapes = self._shapes

    def _setup_recorded(self, recorder: Any) -> None:
        """The first step of an unchanged loop with several optimizers ended: that step, replayed on fake
        tensors, planned (``DoesNotFitError`` stops the loop before its next forward), then the monitor."""
        from resource_guard.frontdoors.guard.observed import plan_recorded

        watch = self._watch
        assert watch is not None
        self.plan, self.device, step = plan_recorded(self.model, self.optimizers, recorder, self._plan_kwargs)
        self._target = self.plan.target_batch_size
        if self._monitor_on:
            from resource_guard.estimate.user_step import UserStep
            from resource_guard.frontdoors.guard.recorded import replay_step

            once = UserStep(replay_step(recorder.events, passes=1))
            per_sample = flops_per_sample(self.model, tuple(recorder.fresh), once, self.optimizers)
            self._monitor = self._start_monitor(None)
            self._clock = self._monitor.phases if self._monitor is not None else None
            watch.monitor, watch.clock, watch.flops_per_sample = self._monitor, self._clock, per_sample

    def _closure_loss(self, loss_bytes: int) -> None:
        """The unchanged loop's closure returned its loss: the step refitted with the losses it holds."""
        from resource_guard.frontdoors.guard.observed import closure_loss_plan

        if self.plan is not None:
            self.plan, line = closure_loss_plan(self.plan, loss_bytes)
            self._call_monitor("note", line)

    def _gradients_kept(self, forward: int) -> None:
        """The unchanged loop's first forward on gradients kept: its later micro-steps' peak, refitted."""
        from resource_guard.frontdoors.guard.observed import gradients_kept_plan

        if self.plan is not None:
            self.plan, line = gradients_kept_plan(self.plan, forward)
            self._call_monitor("note", line)

    def _start_monitor(self, shapes: Any) -> Any:
        """The run monitor of this plan: phases, the profiler window, the report at exit."""
        assert self.plan is not None  # planned before any monitor starts
        return start_monitor(
            self._log_dir,
            self.plan,
            self.device,
            profile=self._profile,
            memory_history=self._history,
            shapes=shapes,
            optimizers=self.optimizers,
        )

    def _start_shape_guard(
        self,
        batch: Any,
        loss_fn: LossFn,
        loader: Any,
        *,
        model: nn.Module | None = None,
        whole_batches: bool = False,
    ) -> None:
        """The shape guard of this plan (``model``: the module the plan traced, the guard's by
        default; ``whole_batches``: an unchanged loop, whose batches are never split)."""
        from resource_guard.frontdoors.shape_guard import start_shape_guard

        assert self.plan is not None
        try:
            self._shapes, notes = start_shape_guard(
                model if model is not None else self.model, self.optimizer, batch, loss_fn, self.plan,
                *self._worst[:2], loader=loader, whole_batches=whole_batches,
            )  # fmt: skip
        except DoesNotFitError:
            raise
        except Exception as error:  # our check never stops the run
            warn_at_user(f"resource_guard: the shape check is off: {error!r}")
            notes = []
        self.plan = self._with_reasons(*notes)

    def _with_reasons(self, *lines: str) -> Plan:
        import dataclasses

        assert self.plan is not None
        return dataclasses.replace(self.plan, reasons=(*self.plan.reasons, *lines))

    # ------------------------------------------------------------------------------------------------
    # the loop (the parts: frontdoors/guard/batches.py, stepper.py)

    def iterate(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the loader's batches as device-resident micro-batches of the planned size.

        The first batch plans the run when no ``sample_batch`` was given. The time spent waiting for
        each batch is measured; batches from a loader with ``pin_memory=True`` are copied with
        ``non_blocking=True``. At the end, a partial effective batch (fewer samples than the target)
        still takes an optimizer step, with its gradients rescaled to that batch's mean.
        """
        if not self._entered:
            raise ConfigurationError("call `g.iterate(...)` inside `with guard(...) as g:`.")
        from resource_guard.estimate.closure_step import needs_closure

        if self._batch_dim == 1:  # before step 0: the batches would be cut along the wrong dim
            raise ConfigurationError(
                "`g.iterate(...)` with `guard(..., batch_dim=1)`: `g.iterate` cuts batches along dim 0. "
                "Leave the sequence-first loop unchanged (the guard pre-flights, times and reports it), or "
                "give `g.iterate` batch-first batches and drop `batch_dim=1`."
            )
        if not self.optimizers:  # before step 0: g.backward would have nothing to step
            raise ConfigurationError(
                "`g.iterate(...)` with `guard(model, None)`: the loop updates the parameters by hand, so "
                "`g.backward` has no optimizer to step. Leave the loop unchanged under `with guard(model, "
                "None):` (the guard pre-flights, times and reports it), or pass the optimizer."
            )
        closure = next((type(o).__name__ for o in self.optimizers if needs_closure(o)), None)
        if closure is not None:  # before step 0: g.backward steps with no closure to re-evaluate
            raise ConfigurationError(
                f"{closure} steps with a closure that re-evaluates the model (`optimizer.step(closure)`), "
                "which `g.iterate`/`g.backward` cannot give it. Leave the loop unchanged under "
                "`with guard(model, optimizer):` and call `optimizer.step(closure)` yourself: the guard "
                "pre-flights the closure's step (its history included), times and reports it."
            )
        watch, self._watch = self._watch, None
        if watch is not None:  # the loop drives the guard: the hooks go
            watch.remove()
            if watch.planned:
                raise ConfigurationError(
                    "the model ran a training forward inside `with guard(...)` before `g.iterate(...)`: "
                    "either loop with `g.iterate` from the first batch, or leave the loop unchanged."
                )
        non_blocking = bool(getattr(loader, "pin_memory", False))
        expect_steps(self._monitor, loader)
        batches = iter(loader)
        while True:
            clock = self._clock
            if clock is not None:  # the data wait: the loader's own __next__, nothing else
                clock.switch("data_wait")
            try:
                batch = next(batches)
            except StopIteration:
                break
            if clock is not None:
                clock.switch("other")
            if self.plan is None:
                self._setup(batch, loader)
                expect_steps(self._monitor, loader)
                self._call_monitor("set_loader_info", loader_settings(loader))  # the advice reads them
            if self._flops_per_sample is not None and self._monitor is not None:
                # the monitor's step is one loader batch: MFU from the FLOPs of that many samples
                self._monitor.flops_per_step = self._flops_per_sample * (batch_size_of(batch) or 1)
                self._flops_per_sample = None
            self._call_monitor("batch_ready", batch)
            device, micro, plan = self.device, self._micro, self.plan
            assert device is not None and micro is not None and plan is not None
            moved = to_device(batch, device, non_blocking)
            micro_size = micro.size_for(moved, plan.micro_batch_size)
            rows = micro.rows(moved)
            if rows is not None and rows <= micro_size:  # the hot path: no slicing
                self._current_micro = rows
                yield self._forward(moved)
                self._resumed()
            else:
                for part in split_batch(moved, micro_size):
                    self._current_micro = batch_size_of(part) or 1
                    yield self._forward(part)
                    self._resumed()
            if len(self.optimizers) > 1 and self._scaler is not None:
                self._scaler.update()  # once per batch, after every optimizer stepped
            self._call_monitor("step_end")
        if self._clock is not None:
            self._clock.switch("other")
        if self._stepper is not None and self._stepper.pending:
            self._stepper.finish_partial_step()
            if self._clock is not None:
                self._clock.switch("other")

    def _forward(self, batch: Any) -> Any:
        """``batch``, the forward phase running from here until ``g.backward``."""
        if self._clock is not None:
            self._clock.switch("forward")
        return batch

    def _resumed(self) -> None:
        """The loop asked for the next micro-batch: the user's code since ``g.backward`` was host time."""
        self.micro_steps += 1
        if self._clock is not None:
            self._clock.switch("other")

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a block of the loop as phase ``name`` (``"checkpoint"``, ``"logging"``, ``"evaluation"``…).

        The report splits each step's wall time by phase (:data:`~resource_guard.report.types.PHASES`);
        the guard times data waits, forward, backward, the optimizer and evaluation itself, and counts
        the rest of the loop's own code as ``host``. Saving a checkpoint or logging inside the loop is
        named when wrapped::

            with g.phase("checkpoint"):
                torch.save(model.state_dict(), path)
        """
        from resource_guard.observe.phases import timed
        from resource_guard.report.types import PHASES

        if name not in PHASES:
            raise ConfigurationError(f"`g.phase({name!r})` must name one of {', '.join(PHASES)}.")
        return timed(self._clock, name)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Autocast for the planned precision on the planned device (a no-op for ``*-true``)."""
        if self.plan is None or self.device is None:
            raise ConfigurationError("`g.autocast()` is only valid once the run is planned (inside iterate).")
        return autocast_context(parse_precision(self.plan.precision), self.device.type)

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Backward of a micro-batch's mean loss; steps the optimizer when the effective batch is done.

        The loss is weighted by ``micro-batch size / target batch size`` so the accumulated gradient is
        that of the mean over the effective batch. Returns True when an optimizer step was taken.
        With several optimizers (``guard(model, [opt_g, opt_d], loss_fn=UserStep(...))``) each backward
        names the ``optimizer`` it trains, which then steps and is zeroed; the batch is not split.
        """
        stepper = self._stepper
        if self.plan is None or stepper is None:
            raise ConfigurationError("`g.backward(loss)` must follow a batch from `g.iterate(loader)`.")
        clock = self._clock
        if clock is None:
            return stepper.backward(loss, self._current_micro, optimizer)
        clock.switch("backward")
        try:
            return stepper.backward(loss, self._current_micro, optimizer)
        finally:
            clock.switch("host")  # until the loop asks for the next batch: the user's own code

    # ------------------------------------------------------------------------------------------------
    # evaluation (the parts: frontdoors/guard/evaluation.py)

    def evaluate(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the loader's batches on the device, with the model in eval mode under ``torch.no_grad()``.

        Before the first batch runs, its evaluation step is pre-flighted beside what the run holds now
        (parameters, the optimizer state once it exists, gradients the model holds; see
        :mod:`~resource_guard.frontdoors.eval_preflight`): :class:`~resource_guard.errors.DoesNotFitError`
        if it does not fit, naming the largest evaluation batch size that does. The step traced is the
        guard's ``loss_fn`` (else the stand-in loss) under the planned precision: run the loop's forward
        under :meth:`autocast` as in training. Batches are not split or timed as training steps. After
        the loop (also on ``break`` or an exception) the model's mode and the grad mode are restored.
        """
        if self.plan is None or self.device is None:
            raise ConfigurationError(
                "`g.evaluate(loader)` needs the run planned first: iterate the train loader (`g.iterate`) "
                "before evaluating, or pass `guard(..., sample_batch=...)`."
            )
        device, non_blocking = self.device, bool(getattr(loader, "pin_memory", False))
        self._eval_mode.remember()
        clock = self._clock
        previous = clock.switch("evaluation") if clock is not None else None
        try:
            for i, batch in enumerate(loader):
                if i == 0:
                    self._preflight_eval(batch)
                    self._eval_mode.enter()
                yield to_device(batch, device, non_blocking)
        finally:
            self._eval_mode.restore()
            if clock is not None and previous is not None:
                clock.switch(previous)

    def _preflight_eval(self, batch: Any, later: bool = False) -> None:
        assert self.plan is not None
        line = preflight_eval(
            self._evals, self.model, self.loss_fn, self._planned_optimizers, self.plan, batch, later
        )
        if line is not None:  # new: into the plan's reasons and the report
            self.plan = self._with_reasons(line)
            self._call_monitor("note", line)

    # ------------------------------------------------------------------------------------------------
    # monitoring and tear-down (the parts: frontdoors/guard/summary.py)

    def _call_monitor(self, name: str, *args: Any) -> None:
        if self._monitor is None:
            return
        try:
            getattr(self._monitor, name)(*args)
        except Exception as error:  # a failure in our monitoring never stops training
            warn_at_user(f"resource_guard: monitoring stopped: {error!r}")
            self._monitor = None

    def _teardown(self, exc: BaseException | None) -> None:
        self._eval_mode.restore()  # an evaluation left by an exception: train and grad mode back
        watch = self._watch
        if watch is not None:
            watch.remove()
            watch.finish()
            self.micro_steps = watch.forwards
            if watch.planned:
                self._call_monitor("note", watch.line())
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            try:
                self.report = monitor.close(exc)
            except Exception as error:
                warn_at_user(f"resource_guard: monitor close failed: {error!r}")
        if self._ckpt is not None:
            self._ckpt.remove()
            self._ckpt = None
        if self._log_dir is not None and self.plan is not None and _rank() == 0:  # one writer per log dir
            self._log_dir.mkdir(parents=True, exist_ok=True)
            (self._log_dir / "guard.json").write_text(json.dumps(self.summary(exc), indent=2, default=str))

    def summary(self, exc: BaseException | None = None) -> dict[str, Any]:
        """What was planned and what was measured (peak memory where the device reports it)."""
        out = run_summary(
            self.plan,
            self.device,
            optimizer_steps=self.optimizer_steps,
            micro_steps=self.micro_steps,
            wall_s=time.perf_counter() - self._started,
            exc=exc,
            shapes=self._shapes,
        )
        if self._watch is not None:
            out["observed"] = self._watch.facts()
        return out


def _rank() -> int:
    """This process's rank under ``torch.distributed`` (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def guard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    **kwargs: Any,
) -> Guard:
    """Plan and run a plain-PyTorch training loop; see :class:`Guard` for the arguments.

    ``guard(model, None)`` (or ``guard(model)``) is a loop that updates the parameters by hand
    (``p.data.add_(p.grad, alpha=-lr)``, ``model.zero_grad()``): left unchanged, it is planned with no
    optimizer state and observed through its forwards and backwards.

    Several optimizers (a GAN's loop) come as a list, with ``loss_fn=UserStep(step)``: the step the
    pre-flight estimates (:mod:`~resource_guard.estimate.user_step`), and ``g.backward(loss,
    optimizer=opt)`` in the loop.
    """
    return Guard(model, optimizer, **kwargs)
