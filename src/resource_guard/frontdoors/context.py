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
import warnings
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError, DoesNotFitError, ResourceGuardWarning
from resource_guard.frontdoors.eval_preflight import EvalPreflights
from resource_guard.observe.growth import batch_signature
from resource_guard.observe.oom import is_oom
from resource_guard.step.batching import split_batch
from resource_guard.step.precision import autocast_context, parse_precision
from resource_guard.step.training import LossFn, StandInLoss, batch_size_of, map_tensors

if TYPE_CHECKING:
    from resource_guard.devices import DeviceSpec
    from resource_guard.planning.planner import Plan

__all__ = ["Guard", "check_log_dir", "guard", "torch_device_of"]


def torch_device_of(spec: DeviceSpec) -> torch.device:
    """The torch device a (detected) :class:`DeviceSpec` names.

    Raises:
        ConfigurationError: ``spec`` is a catalog device that is not on this machine.
    """
    if spec.kind == "cpu":
        return torch.device("cpu")
    if spec.kind == "mps":
        return torch.device("mps")
    if spec.source == "detected" and spec.index is not None:
        return torch.device("cuda", spec.index)
    raise ConfigurationError(
        f"device {spec.name!r} is a catalog entry, not a device on this machine: training needs a real "
        "device. Use device='auto' (or 'cuda:N' / 'cpu'), with `memory_limit=` to plan under a cap; use "
        "`plan(..., device=...)` or `resource-guard preflight --device` for what-if questions."
    )


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            # Adam's `step` stays on the CPU unless capturable/fused: leave scalars where they are
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                state[key] = value.to(device)


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

    ``eval_sample_batch``: one batch of the evaluation loop (its own batch size and shapes), whose step
    is pre-flighted with the plan, before any training step, as it will run after the first optimizer
    step (see :meth:`evaluate`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        *,
        sample_batch: Any = None,
        loss_fn: LossFn | None = None,
        target_batch_size: int | None = None,
        device: str | DeviceSpec = "auto",
        precision: str = "auto",
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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigurationError(
                f"`guard(model=...)` must be a torch.nn.Module, got {type(model).__name__}."
            )
        several = isinstance(optimizer, (list, tuple))  # a GAN's loop: g.backward(loss, optimizer=...)
        if several:
            from resource_guard.estimate.user_step import check_optimizers

            check_optimizers(model, optimizer, loss_fn, "guard")
        elif not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(
                f"`guard(optimizer=...)` must be a torch.optim.Optimizer or a list of them, got "
                f"{type(optimizer).__name__}."
            )
        from resource_guard.devices import parse_memory_limit
        from resource_guard.planning.planner import _check_args

        _check_args(headroom, target_batch_size, 1, "auto", checkpointing, call="guard")
        if memory_limit is not None:
            parse_memory_limit(memory_limit, "guard")
        catalog = _check_device_and_catalog(device, catalog)
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ConfigurationError(f"`guard(clip_grad_norm={clip_grad_norm!r})` must be > 0 or None.")
        if not isinstance(memory_history, bool):
            raise ConfigurationError(f"`guard(memory_history={memory_history!r})` must be True or False.")
        if precision != "auto":
            parse_precision(precision)  # an unknown name fails here, before anything else
        from resource_guard.frontdoors.shape_guard import check_worst_case_args

        check_worst_case_args("guard", max_seq_len, check_shapes)
        self._worst = (max_seq_len, worst_case_batch, check_shapes)
        self._shapes: Any = None  # the ShapeGuard, once planned
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.optimizers = tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (optimizer,)
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
        self.optimizer_steps = 0
        self.micro_steps = 0
        self.report: Any = None
        self._monitor: Any = None
        self._scaler: torch.amp.GradScaler | None = None
        self._ckpt: Any = None
        self._entered = False
        self._eval_restore: tuple[bool, bool] | None = None  # train and grad mode to restore after evaluate
        self._evals = EvalPreflights()
        self._pending = 0  # samples accumulated since the last optimizer step
        self._current_micro = 0  # size of the micro-batch being processed
        self._rows_by_signature: dict[Any, int | None] = {}
        self._started = 0.0

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
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._teardown(exc)
        except Exception as error:  # our own clean-up never replaces the user's exception
            warnings.warn(f"resource_guard: clean-up failed: {error!r}", ResourceGuardWarning, stacklevel=2)
        # returning None lets the user's exception (if any) through unchanged

    # ------------------------------------------------------------------------------------------------
    # set-up

    def _setup(self, batch: Any, loader: Any = None) -> None:
        from resource_guard.planning.planner import plan

        target = self._target if self._target is not None else batch_size_of(batch)
        if target is None:
            raise ConfigurationError(
                "cannot tell the batch size of the sample batch (its tensors do not share dim 0); pass "
                "`target_batch_size=`."
            )
        self._target = target
        loss_fn = self.loss_fn if self.loss_fn is not None else StandInLoss()  # several: a UserStep
        made = plan(
            self.model,
            list(self.optimizers) if len(self.optimizers) > 1 else self.optimizers[0],
            batch,
            loss_fn,
            target_batch_size=target,
            allow_rough=True,  # the run starts either way: plan on the bound, its warning says why
            **self._plan_kwargs,
        )
        if len(self.optimizers) > 1 and made.accumulation_steps != 1:  # each loss is the loop's own
            raise DoesNotFitError(
                f"with {len(self.optimizers)} optimizers the loop's own step runs on the whole batch (no "
                f"accumulation), and a batch of {target} does not fit: the largest that fits is "
                f"{made.micro_batch_size}. Lower the batch size.",
                made,
            )
        if isinstance(loss_fn, StandInLoss) and loss_fn.used:
            made = dataclasses.replace(made, reasons=(*made.reasons, StandInLoss.REASON))
        device = torch_device_of(made.device)
        self.plan, self.device = made, device
        if self._eval_sample is not None:  # the evaluation to come, before any step
            self._preflight_eval(self._eval_sample, later=True)
        if self._monitor_on:  # model FLOPs, before checkpointing adds its recomputation
            self._flops_per_sample = _flops_per_sample(self.model, batch, loss_fn, self.optimizers)
        self.model.to(device)
        for optimizer in self.optimizers:
            _move_optimizer_state(optimizer, device)
        if made.checkpointing:
            from resource_guard.planning.checkpointing import apply_checkpointing

            self._ckpt = apply_checkpointing(self.model)
        spec = parse_precision(made.precision)
        if spec.param_dtype != torch.float32:
            self.model.to(spec.param_dtype)
        if spec.loss_scaling:
            self._scaler = torch.amp.GradScaler(device.type)
        if self._worst[2]:  # the shape guard; the worst case known before any step (it may split)
            from resource_guard.frontdoors.shape_guard import start_shape_guard

            try:
                self._shapes, notes = start_shape_guard(
                    self.model, self.optimizer, batch, loss_fn, made, *self._worst[:2], loader=loader
                )
            except DoesNotFitError:
                raise
            except Exception as error:  # our check never stops the run
                warnings.warn(f"resource_guard: the shape check is off: {error!r}", ResourceGuardWarning, 2)
                notes = []
            self.plan = dataclasses.replace(self.plan, reasons=(*self.plan.reasons, *notes))
        if self._monitor_on:
            self._start_monitor(batch)
            for check in self._evals.checks:  # pre-flighted with the plan: into the report too
                self._call_monitor("note", check.line())

    def _start_monitor(self, batch: Any) -> None:
        try:
            from resource_guard.observe.monitor import RunMonitor

            plan = self.plan
            assert plan is not None
            self._monitor = RunMonitor(
                self._log_dir,
                device=self.device or "cpu",
                estimate=plan.estimate,
                capacity_bytes=_monitor_capacity(plan, self.device),
                planned_capacity_bytes=plan.fit.capacity_bytes,
                device_spec=plan.device,
                profile=self._profile,
                precision=plan.precision,
                memory_history=self._history,
                # Lightning's default: a log boundary (aggregation, one TensorBoard flush) costs ~0.3 ms,
                # ~6 us a step over 50 steps, ~30 us over 10
                log_every_n_steps=50,
            )
            self._monitor.shape_stats = self._shapes.stats if self._shapes is not None else None
            self._monitor.start()
        except ConfigurationError:
            raise
        except Exception as error:
            warnings.warn(
                f"resource_guard: monitoring is off for this run: {error!r}",
                ResourceGuardWarning,
                stacklevel=3,
            )
            self._monitor = None

    # ------------------------------------------------------------------------------------------------
    # the loop

    def iterate(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the loader's batches as device-resident micro-batches of the planned size.

        The first batch plans the run when no ``sample_batch`` was given. The time spent waiting for
        each batch is measured; batches from a loader with ``pin_memory=True`` are copied with
        ``non_blocking=True``. At the end, a partial effective batch (fewer samples than the target)
        still takes an optimizer step, with its gradients rescaled to that batch's mean.
        """
        if not self._entered:
            raise ConfigurationError("call `g.iterate(...)` inside `with guard(...) as g:`.")
        non_blocking = bool(getattr(loader, "pin_memory", False))
        self._expect_steps(loader)
        for batch in loader:
            if self.plan is None:
                self._setup(batch, loader)
                self._expect_steps(loader)
            if self._flops_per_sample is not None and self._monitor is not None:
                # the monitor's step is one loader batch: MFU from the FLOPs of that many samples
                self._monitor.flops_per_step = self._flops_per_sample * (batch_size_of(batch) or 1)
                self._flops_per_sample = None
            self._call_monitor("batch_ready", batch)
            device = self.device
            assert device is not None and self.plan is not None
            moved = _to_device(batch, device, non_blocking)
            micro_size = self._micro_batch_size(moved)
            rows = self._rows(moved)
            if rows is not None and rows <= micro_size:  # the hot path: no slicing
                self._current_micro = rows
                yield moved
                self.micro_steps += 1
            else:
                for micro in split_batch(moved, micro_size):
                    self._current_micro = batch_size_of(micro) or 1
                    yield micro
                    self.micro_steps += 1
            if len(self.optimizers) > 1 and self._scaler is not None:
                self._scaler.update()  # once per batch, after every optimizer stepped
            self._call_monitor("step_end")
        if self._pending:
            self._finish_partial_step()

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
        self._eval_restore = (self.model.training, torch.is_grad_enabled())
        try:
            for i, batch in enumerate(loader):
                if i == 0:
                    self._preflight_eval(batch)
                    self.model.eval()
                    torch.set_grad_enabled(False)
                yield _to_device(batch, device, non_blocking)
        finally:
            self._end_evaluation()

    def _preflight_eval(self, batch: Any, later: bool = False) -> None:
        """``later``: as the step will run between epochs: the optimizer state exists, the gradients were
        freed by the optimizer step's ``zero_grad``; else beside what the run holds now."""
        plan = self.plan
        assert plan is not None
        from resource_guard.estimate import UserStep

        # the evaluation's forward: the guard's loss function, else (none, or a whole training step) the
        # stand-in loss over the model's output
        loss_fn = (
            self.loss_fn if self.loss_fn is not None and not isinstance(self.loss_fn, UserStep) else None
        )
        optimizers = list(self.optimizers) if len(self.optimizers) > 1 else self.optimizers[0]
        check = self._evals.check(
            self.model,
            batch,
            loss_fn if loss_fn is not None else StandInLoss(),
            loop="evaluation",
            device=plan.device,
            optimizer=optimizers if later or any(o.state for o in self.optimizers) else None,
            gradients_kept=False if later else None,
            precision=plan.precision,
            headroom=plan.headroom,
        )
        if check is not None:  # new: into the plan's reasons and the report
            self.plan = dataclasses.replace(plan, reasons=(*plan.reasons, check.line()))
            self._call_monitor("note", check.line())

    def _end_evaluation(self) -> None:
        restore, self._eval_restore = self._eval_restore, None
        if restore is not None:
            self.model.train(restore[0])
            torch.set_grad_enabled(restore[1])

    def _micro_batch_size(self, batch: Any) -> int:
        """The micro-batch for this batch's shape: the shape guard's (one dict lookup once seen), else the
        plan's. With several optimizers the loop's own step takes the whole batch: one that would not fit
        stops the run before it (``DoesNotFitError``) instead of being split."""
        assert self.plan is not None
        if self._shapes is None:
            return self.plan.micro_batch_size
        if len(self.optimizers) > 1:
            self._shapes.stop_if_too_big(batch)
            return self.plan.micro_batch_size
        return int(self._shapes.micro_batch_size(batch))

    def _rows(self, batch: Any) -> int | None:
        """``batch_size_of(batch)``, looked up by the batch's signature (shapes and dtypes) once seen."""
        signature = batch_signature(batch)
        if signature is None:
            return batch_size_of(batch)
        rows = self._rows_by_signature.get(signature, -1)
        if rows == -1:
            rows = batch_size_of(batch)
            if len(self._rows_by_signature) < 4096:
                self._rows_by_signature[signature] = rows
        return rows

    def _expect_steps(self, loader: Iterable[Any]) -> None:
        """The monitor's step count at the end of this pass over ``loader`` (the report's ETA), if sized."""
        if self._monitor is not None and isinstance(loader, Sized):
            with contextlib.suppress(TypeError):  # a loader whose len() is undefined
                self._monitor.total_steps = self._monitor.steps + len(loader)

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
        if self.plan is None or self._target is None:
            raise ConfigurationError("`g.backward(loss)` must follow a batch from `g.iterate(loader)`.")
        if len(self.optimizers) > 1 or (optimizer is not None and optimizer is not self.optimizers[0]):
            return self._backward_of(loss, optimizer)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigurationError(f"`g.backward(loss)` needs a scalar loss tensor, got {shape}.")
        size = self._current_micro or 1
        scaled = loss if size == self._target else loss * (size / self._target)  # x 1.0: no extra op
        if self._scaler is not None:
            scaled = self._scaler.scale(scaled)
        scaled.backward()
        self._pending += size
        if self._pending >= self._target:
            self._optimizer_step()
            return True
        return False

    def _finish_partial_step(self) -> None:
        assert self._target is not None
        factor = self._target / self._pending
        grads = [p.grad for g in self.optimizers[0].param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
        self._optimizer_step()

    def _backward_of(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> bool:
        """``g.backward(loss, optimizer=opt)``: backward of the whole batch's loss, then ``opt``'s step."""
        if not any(optimizer is o for o in self.optimizers):
            raise ConfigurationError(
                f"`g.backward(loss, optimizer={type(optimizer).__name__ if optimizer else None})` must "
                f"name one of the guard's {len(self.optimizers)} optimizers."
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigurationError("`g.backward(loss, optimizer=...)` needs a scalar loss tensor.")
        (self._scaler.scale(loss) if self._scaler is not None else loss).backward()
        self._optimizer_step(optimizer, update=False)  # the scaler updates once per batch, in iterate
        return True

    def _optimizer_step(self, optimizer: torch.optim.Optimizer | None = None, update: bool = True) -> None:
        optimizer = optimizer if optimizer is not None else self.optimizers[0]
        if self._scaler is not None:
            if self._clip is not None:
                self._scaler.unscale_(optimizer)
                self._clip_grads(optimizer)
            self._scaler.step(optimizer)
            if update:
                self._scaler.update()
        else:
            if self._clip is not None:
                self._clip_grads(optimizer)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._pending = 0
        self.optimizer_steps += 1

    def _clip_grads(self, optimizer: torch.optim.Optimizer) -> None:
        assert self._clip is not None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, self._clip)

    def _call_monitor(self, name: str, *args: Any) -> None:
        if self._monitor is None:
            return
        try:
            getattr(self._monitor, name)(*args)
        except Exception as error:  # a failure in our monitoring never stops training
            warnings.warn(
                f"resource_guard: monitoring stopped: {error!r}", ResourceGuardWarning, stacklevel=3
            )
            self._monitor = None

    # ------------------------------------------------------------------------------------------------
    # tear-down

    def _teardown(self, exc: BaseException | None) -> None:
        self._end_evaluation()  # an evaluation left by an exception: train and grad mode back
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            try:
                self.report = monitor.close(exc)
            except Exception as error:
                warnings.warn(
                    f"resource_guard: monitor close failed: {error!r}", ResourceGuardWarning, stacklevel=3
                )
        if self._ckpt is not None:
            self._ckpt.remove()
            self._ckpt = None
        if self._log_dir is not None and self.plan is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            (self._log_dir / "guard.json").write_text(json.dumps(self.summary(exc), indent=2, default=str))

    def summary(self, exc: BaseException | None = None) -> dict[str, Any]:
        """What was planned and what was measured (peak memory where the device reports it)."""
        plan = self.plan
        measured = _measured_peak_bytes(self.device)
        out: dict[str, Any] = {
            "optimizer_steps": self.optimizer_steps,
            "micro_steps": self.micro_steps,
            "wall_s": time.perf_counter() - self._started,
            "outcome": "ok" if exc is None else type(exc).__name__,
            "oom": is_oom(exc),
            "measured_peak_bytes": measured,
        }
        if self._shapes is not None:
            out["shapes"] = self._shapes.stats()
        if plan is not None:
            out["plan"] = plan.to_dict()
            out["estimated_peak_bytes"] = plan.fit.allocated_peak_bytes
            if measured is not None and plan.fit.allocated_peak_bytes:
                out["estimate_error"] = plan.fit.allocated_peak_bytes / measured - 1
        return out


def _check_device_and_catalog(device: Any, catalog: Any) -> Any:
    """Refuse a device name that is neither local-looking nor in the catalog, without probing hardware.

    Returns the catalog loaded from a path (or as given). Whether a local device exists is checked at
    enter, where probing the hardware belongs.
    """
    import re

    from resource_guard.devices import Catalog, DeviceSpec, load_catalog

    if catalog is not None and not isinstance(catalog, Catalog):
        if not isinstance(catalog, (str, os.PathLike)):
            raise ConfigurationError(
                f"`guard(catalog={catalog!r})` must be a path to a YAML device catalog or a Catalog."
            )
        catalog = load_catalog(catalog)  # a missing or malformed file fails here, with the reason
    if isinstance(device, DeviceSpec):
        return catalog
    if not isinstance(device, str):
        raise ConfigurationError(f"`guard(device={device!r})` must be a device name or a DeviceSpec.")
    name = device.strip().lower()
    if name in ("auto", "cpu", "mps") or re.fullmatch(r"cuda(:\d+)?", name):
        return catalog
    known = catalog if catalog is not None else load_catalog()
    try:
        known.get(device)
    except ConfigurationError as error:
        raise ConfigurationError(
            f"`guard(device={device!r})`: {error} Local devices: 'auto', 'cpu', 'cuda', 'cuda:N', 'mps'."
        ) from None
    return catalog


def _flops_per_sample(
    model: nn.Module, batch: Any, loss_fn: LossFn | None, optimizers: tuple[Any, ...] = ()
) -> float | None:
    """FLOPs of forward + backward per sample, counted on fake tensors (for MFU); None if unknown.

    ``loss_fn`` is the one the plan used (the stand-in when none was given; its few FLOPs beside the
    model's are within MFU's precision); a ``UserStep`` of several ``optimizers``: its every pass.
    """
    from resource_guard.estimate.user_step import UserStep, count_user_step_flops
    from resource_guard.observe.throughput import count_flops

    size = batch_size_of(batch)
    if loss_fn is None or not size:
        return None
    if isinstance(loss_fn, UserStep):
        try:
            flops: float | None = count_user_step_flops(model, optimizers, batch, loss_fn)
        except Exception as error:  # MFU is a nicety
            warnings.warn(f"resource_guard: no MFU: {error!r}", ResourceGuardWarning, stacklevel=3)
            return None
    else:
        flops = count_flops(model, batch, loss_fn)
    return flops / size if flops else None


def _monitor_capacity(plan: Plan, device: torch.device | None) -> int:
    """The capacity the run's measured peak is compared with.

    On the CPU the monitor measures the process's RSS, interpreter and libraries included, so a
    ``memory_limit`` (which caps tensor bytes) is no fair yardstick for it: the host's RAM is.
    """
    if device is not None and device.type == "cpu":
        from resource_guard.devices import resolve_device

        return resolve_device("cpu").memory_bytes
    return plan.fit.capacity_bytes


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    parts = batch.values() if type(batch) is dict else batch if type(batch) in (tuple, list) else None
    if parts is not None and all(isinstance(t, torch.Tensor) and t.device == device for t in parts):
        return batch  # a flat batch already there: nothing to rebuild
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


def _measured_peak_bytes(device: torch.device | None) -> int | None:
    if device is not None and device.type == "cuda":
        try:
            return int(torch.cuda.max_memory_allocated(device))
        except Exception:
            return None
    return None


def check_log_dir(path: str | os.PathLike[str], call: str = "guard") -> None:
    """Make ``path`` (and parents) and prove it writable, or raise a ConfigurationError naming ``call``."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".resource_guard_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigurationError(
            f"`{call}(log_dir={str(path)!r})` is not writable ({error.strerror or error}); pick another "
            "directory."
        ) from None


def guard(
    model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], **kwargs: Any
) -> Guard:
    """Plan and run a plain-PyTorch training loop; see :class:`Guard` for the arguments.

    Several optimizers (a GAN's loop) come as a list, with ``loss_fn=UserStep(step)``: the step the
    pre-flight estimates (:mod:`~resource_guard.estimate.user_step`), and ``g.backward(loss,
    optimizer=opt)`` in the loop.
    """
    return Guard(model, optimizer, **kwargs)
