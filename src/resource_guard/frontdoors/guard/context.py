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
import dataclasses
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError, warn_at_user
from resource_guard.estimate.user_step import manual_update_stand_in
from resource_guard.frontdoors.eval_preflight import EvalPreflights
from resource_guard.frontdoors.guard.args import (
    check_guard_args,
    check_iterate,
    check_log_dir,
    torch_device_of,
)
from resource_guard.frontdoors.guard.batches import MicroBatches, iterate_batches, to_device
from resource_guard.frontdoors.guard.evaluation import EvalMode, preflight_eval
from resource_guard.frontdoors.guard.first_batch import plan_first_batch
from resource_guard.frontdoors.guard.observed import LoopWatch
from resource_guard.frontdoors.guard.setup import build_monitor
from resource_guard.frontdoors.guard.stepper import Stepper
from resource_guard.frontdoors.guard.summary import run_summary
from resource_guard.frontdoors.run import Run
from resource_guard.step.precision import autocast_context, parse_precision
from resource_guard.step.training import LossFn

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

    ``log_every_n_steps`` / ``log_interval_s``: how often the monitor logs: by default every step for the
    first 20, then about every ``log_interval_s`` seconds (2); an int ``n``: after step 1 and every
    ``n``-th step.
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
        log_every_n_steps: int | None = None,
        log_interval_s: float = 2.0,
    ) -> None:
        precision, catalog, self._batch_dim, self._recording = check_guard_args(
            model, optimizer, loss_fn=loss_fn, sample_batch=sample_batch, precision=precision,
            target_batch_size=target_batch_size, device=device, checkpointing=checkpointing,
            memory_limit=memory_limit, headroom=headroom, log_dir=log_dir, clip_grad_norm=clip_grad_norm,
            monitor=monitor, profile=profile, catalog=catalog, memory_history=memory_history,
            max_seq_len=max_seq_len, check_shapes=check_shapes, keep_outputs=keep_outputs,
            batch_dim=batch_dim, log_every_n_steps=log_every_n_steps, log_interval_s=log_interval_s,
        )  # fmt: skip
        self._cadence: dict[str, Any] = {
            "log_every_n_steps": log_every_n_steps,
            "log_interval_s": log_interval_s,
        }
        self.model, self.optimizer, self.loss_fn, self._keep_outputs = model, optimizer, loss_fn, keep_outputs
        self.optimizers: tuple[torch.optim.Optimizer, ...] = (
            tuple(optimizer)
            if isinstance(optimizer, (list, tuple))
            else ()
            if optimizer is None
            else (optimizer,)
        )
        # what the estimate steps: a manual-update loop's in-place, stateless update when there is none
        self._planned_optimizers = self.optimizers or (manual_update_stand_in(model),)
        self._worst = (max_seq_len, worst_case_batch, check_shapes)
        self._sample_batch, self._eval_sample = sample_batch, eval_sample_batch  # the latter: see `evaluate`
        self._target = target_batch_size
        self._plan_kwargs: dict[str, Any] = {
            "device": device, "precision": precision, "checkpointing": checkpointing,
            "memory_limit": memory_limit, "headroom": headroom, "catalog": catalog,
        }  # fmt: skip
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._clip = clip_grad_norm
        self._monitor_on, self._profile, self._history = monitor, profile, memory_history
        self._flops_per_sample: float | None = None
        self.plan: Plan | None = None
        self.device: torch.device | None = None
        self.micro_steps = 0
        self._run = Run("resource_guard")  # the monitor, from the run's start to its report
        self._shapes: Any = None  # the ShapeGuard, once planned
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

    @property
    def report(self) -> Any:
        """The monitor's report after exit (``None`` when monitoring is off)."""
        return self._run.report

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
        else:  # until the loop calls g.iterate: watch it as it is (frontdoors/guard/unchanged.py)
            from resource_guard.frontdoors.guard.unchanged import watch_unchanged

            self._watch = watch_unchanged(self)
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
    # the run's first batch: planned, applied, monitored (the parts: frontdoors/guard/setup.py)

    def _setup(self, batch: Any, loader: Any = None) -> None:
        plan_first_batch(self, batch, loader)

    def _start_monitor(self, shapes: Any) -> Any:
        """The run monitor of this plan: phases, the profiler window, the report at exit."""
        assert self.plan is not None  # planned before any monitor starts
        made, device = self.plan, self.device or torch.device("cpu")
        notes = [check.line() for check in self._evals.checks]  # pre-flighted with the plan: reported
        profile, history, cadence = self._profile, self._history, self._cadence
        return self._run.start(
            lambda: build_monitor(self._log_dir, made, device, profile, history, **cadence),
            made, shapes=shapes, optimizers=self.optimizers, notes=notes,
        )  # fmt: skip

    def _with_reasons(self, *lines: str) -> Plan:
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
        check_iterate(self.optimizers, self._batch_dim)  # before step 0
        watch, self._watch = self._watch, None
        if watch is not None:  # the loop drives the guard: the hooks go
            watch.remove()
            if watch.planned:
                raise ConfigurationError(
                    "the model ran a training forward inside `with guard(...)` before `g.iterate(...)`: "
                    "either loop with `g.iterate` from the first batch, or leave the loop unchanged."
                )
        return iterate_batches(self, loader)

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
            self._run.call("note", line)

    # ------------------------------------------------------------------------------------------------
    # tear-down (the parts: frontdoors/guard/summary.py)

    def _teardown(self, exc: BaseException | None) -> None:
        self._eval_mode.restore()  # an evaluation left by an exception: train and grad mode back
        watch = self._watch
        if watch is not None:
            watch.remove()
            watch.finish()
            self.micro_steps = watch.forwards
            if watch.planned:
                self._run.call("note", watch.line())
        self._run.close(exc)
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
