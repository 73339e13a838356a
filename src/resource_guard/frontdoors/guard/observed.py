"""The guard around an unchanged loop: ``with guard(model, optimizer):`` and no other line changed.

When the loop never calls ``g.iterate``, the guard watches it through public hooks only:

- the model's forward pre-hook (``register_forward_pre_hook(with_kwargs=True)``) sees each forward's
  inputs before it runs: the first training forward is pre-flighted on those inputs (the step traced as
  the loop runs it, see :class:`LoopLoss`), and :class:`~resource_guard.errors.DoesNotFitError` is
  raised from the hook, before that forward runs, when it does not fit; every training forward counts
  (its samples and tokens too) and starts the forward phase; a forward in eval mode or under
  ``no_grad`` starts the evaluation phase and is not counted;
- the forward post-hook hooks the output (the loss when the model returns one) with a tensor hook
  that fires when backward reaches it: the backward phase starts there; each trainable parameter's
  post-accumulate-grad hook stamps the time, so the backward phase ends at the last gradient
  accumulated and the time after it is the loop's own (host) code;
- each optimizer's step pre- and post-hooks (``register_step_pre_hook`` / ``register_step_post_hook``)
  time the optimizer phase; a step ends when every optimizer has stepped once (one optimizer: each
  step). Forwards inside a step (an LBFGS closure) are counted as closure evaluations and timed as
  part of the optimizer phase. The time from a step's end to the next training forward is the loop's
  data and host time between steps, charged to ``data_wait``;
- with no optimizer (``guard(model, None)``: the loop updates the parameters by hand), a step is one
  or more backwards followed by the next training forward (or the end of the loop): the first
  gradient accumulated marks a backward, and the training forward after it closes the step. Its
  manual update runs in the loop's own (host) time; a loop that accumulates over several backwards
  without an optimizer is counted one step per backward.

Nothing is applied: the model is not moved, the precision not changed, the batch not split; the plan
is advice (its micro-batch and accumulation say what ``g.iterate``/``g.backward`` would run). A failure
inside a hook never stops the loop: the hook warns once and the watch goes quiet.

Example:
    >>> model = torch.nn.Linear(4, 1)
    >>> loop_precision(model, "cpu")
    '32-true'
    >>> loop_precision(model.double(), "cpu")
    '64-true'
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError, DoesNotFitError, warn_at_user
from resource_guard.frontdoors.guard.batch_dim import rows_along, to_batch_first
from resource_guard.step.training import (
    StandInLoss,
    _as_loss,
    batch_size_of,
    iter_tensors,
)

__all__ = [
    "LoopLoss",
    "LoopWatch",
    "CLOSURE_LOSSES_HELD",
    "batch_dim_of",
    "closure_loss_plan",
    "forward_batch",
    "gradients_kept_plan",
    "loop_precision",
    "outputs_as_kept",
    "own_precision",
    "plan_as_run",
    "plan_recorded",
]

_clock = time.perf_counter
_TRUE = {torch.float64: "64-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}


def own_precision(plan: Any, whose: str = "the loop's own") -> Any:
    """``plan`` with its precision reason saying where the precision came from: the planner, given the
    loop's precision, says "as asked", which the user never did."""
    import dataclasses

    said = f"precision {plan.precision}: {whose}; `precision='auto'` lets the guard choose, a name sets it"
    asked = f"precision {plan.precision}: as asked"
    reasons = [said if r.startswith(asked) else r for r in plan.reasons]
    if said not in reasons:
        reasons.append(said)
    return dataclasses.replace(plan, reasons=tuple(reasons))


def loop_precision(model: nn.Module, device_type: str) -> str:
    """The precision the loop runs in now: its autocast, else its parameters' dtype (fp32: ``32-true``)."""
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return "bf16-mixed" if dtype == torch.bfloat16 else "16-mixed"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return _TRUE.get(dtype, "32-true")


def outputs_as_kept(loss_fn: Any, keep: bool) -> Any:
    """``loss_fn`` whose traced step keeps the model's outputs alive through backward (``keep``, the
    default of a loop holding them in a variable) or frees them once the loss is computed.

    The guard's own loss objects carry it as an attribute; a user's function is wrapped
    (:class:`~resource_guard.step.training.OutputsDropped`); a user step (several optimizers) is its
    own step and stays as it is.
    """
    from resource_guard.estimate.user_step import UserStep
    from resource_guard.step.training import OutputsDropped

    if keep or isinstance(loss_fn, UserStep):
        return loss_fn
    if isinstance(loss_fn, StandInLoss):
        loss_fn.keep_outputs = False
        return loss_fn
    return OutputsDropped(loss_fn)


def forward_batch(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """A forward's inputs as a batch the estimate calls the model with the same way.

    Positional only: the tuple (``model(*batch)``); keywords only: the dict (``model(**batch)``); both:
    ``(args, kwargs)``, which :class:`LoopLoss` unpacks.
    """
    if not kwargs:
        return tuple(args)
    if not args:
        return dict(kwargs)
    return (tuple(args), dict(kwargs))


class LoopLoss(StandInLoss):
    """The loss of the step as the loop runs it, from the inputs of its first forward.

    With a ``loss_fn`` given to the guard, the loss is ``loss_fn(model, inputs)`` alone (``inputs``: the
    forward's positional arguments as a tuple, or its keyword arguments as a dict): it makes the step's
    one forward, as the loop does. Else the model is called exactly as the loop called it and the loss is
    the one it returns (a scalar, a scalar in a returned tuple such as nanoGPT's ``(logits, loss)``,
    ``output.loss`` / ``output["loss"]``), else the stand-in over the outputs
    (:class:`~resource_guard.step.training.StandInLoss`, stated in the plan).
    """

    keep_outputs = True  # the traced step's outputs stay alive through backward (``guard(keep_outputs=)``)

    def __init__(self, both: bool, loss_fn: Callable[[nn.Module, Any], Any] | None = None) -> None:
        super().__init__()
        self.both, self.loss_fn = both, loss_fn

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:  # the loss as the loop computes it: loss_fn makes the one forward
            outputs: list[Any] = []
            handle = model.register_forward_hook(lambda _m, _a, out: outputs.append(out))
            try:
                loss = _as_loss(self.loss_fn(model, batch))
            finally:
                handle.remove()
            _hold_next_batch(outputs[0] if outputs else loss, batch)
            return loss
        output = model(*batch[0], **batch[1]) if self.both else _call(model, batch)
        _hold_next_batch(output, batch)
        own = _returned_loss(output)
        if own is not None:
            return own
        return self.stand_in(output)

    def __repr__(self) -> str:
        return "LoopLoss()"


def _hold_next_batch(output: Any, batch: Any) -> None:
    """The next batch, alive beside the step: nanoGPT's loop fetches it between forward and backward,
    a loader's iterator yields it while the last one is still bound. A copy of the batch's tensors rides
    on the first output tensor, so it lives as long as the loop keeps the outputs (``keep_outputs``)."""
    first = next(iter(iter_tensors(output)), None)
    if first is not None:
        first._resource_guard_next_batch = [t.clone() for t in iter_tensors(batch)]  # type: ignore[attr-defined]


def _call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def _returned_loss(output: Any) -> torch.Tensor | None:
    """The model's own loss as a 0-d tensor (see :func:`_loss_tensor`)."""
    loss = _loss_tensor(output)
    return None if loss is None else loss.reshape(())


def _loss_tensor(output: Any) -> torch.Tensor | None:
    """The loss tensor the model returns, itself (not a view): a one-element output, the one float
    one-element tensor of a returned tuple (nanoGPT's ``(logits, loss)``), ``output.loss`` or
    ``output["loss"]``; else ``None``."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else None
    if isinstance(output, (tuple, list)) and not hasattr(output, "_fields"):
        scalars = [
            t for t in output if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()
        ]
        return scalars[0] if len(scalars) == 1 else None
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class _Hook:
    """A hook shared, not copied, by ``copy.deepcopy(model)`` (the estimate copies the model)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return self


class LoopWatch:
    """The hooks of an unchanged loop and what they count; see the module docstring.

    Args:
        model: the guarded model.
        optimizers: the guard's optimizers.
        first_forward: called with the first training forward's ``(args, kwargs)`` before it runs (the
            pre-flight); a :class:`~resource_guard.errors.DoesNotFitError` it raises stops the loop.
        gradients_kept: called once, before the first training forward that starts with gradients
            allocated (the loop's own accumulation: micro-steps 2..k; or ``zero_grad(set_to_none=False)``),
            with that forward's number within its step (1-based); it may raise ``DoesNotFitError`` too.
            Looked for in the loop's first three steps.
        record: with several optimizers and no user step (a GAN's loop): the loop's first step is
            recorded (:class:`~resource_guard.frontdoors.guard.recorded.StepRecorder`, the model's
            children watched instead of the model) and ``record(recorder)`` is called once it ends, in
            place of ``first_forward``; a ``DoesNotFitError`` it raises stops the loop before its next
            forward.
        closure_loss: called once, after the first step of a closure optimizer, with the bytes of the
            storage of the loss the loop's closure returned (a reduced ``mse_loss`` keeps its whole
            unreduced buffer); it may raise ``DoesNotFitError``, which stops the loop before its next
            forward.

    The guard sets :attr:`monitor` (its ``batch_ready``/``step_end`` are called) and :attr:`clock` (the
    monitor's phase clock) once the run is planned.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: tuple[torch.optim.Optimizer, ...],
        first_forward: Callable[[tuple[Any, ...], dict[str, Any]], None],
        gradients_kept: Callable[[int], None] | None = None,
        closure_loss: Callable[[int], None] | None = None,
        record: Callable[[Any], None] | None = None,
    ) -> None:
        from resource_guard.frontdoors.guard.recorded import StepRecorder, recorded_children

        self.model, self.optimizers, self._first_forward = model, optimizers, first_forward
        self._record = record
        self.recorder = StepRecorder(model, optimizers) if record is not None else None
        # the modules whose forwards are the loop's: the model, or (recording) the models it holds
        self._modules = [c for _, c in recorded_children(model)] if record is not None else [model]
        self._module_ids = {id(m) for m in self._modules}
        self._gradients_kept = gradients_kept
        self._closure_loss = closure_loss
        from resource_guard.estimate.closure_step import needs_closure

        # the optimizers whose step takes a closure: only their first step is wrapped (no per-step work
        # for the others)
        self._closure_ids = {id(o) for o in optimizers if needs_closure(o)}
        self._loss_bytes: int | None = None  # the storage of the first loss a closure returned
        self._pending: BaseException | None = None  # a verdict to raise at the next forward
        self.grads_kept_at: int | None = None  # the forward of a step that first ran on gradients kept
        self.monitor: Any = None
        self.clock: Any = None
        self.shapes: Any = None  # the ShapeGuard: a later forward's shape checked before it runs
        self.flops_per_sample: float | None = None  # for MFU, once a step's samples are known
        self.forwards = 0  # training forwards outside optimizer steps
        self.closure_forwards = 0  # training forwards inside an optimizer step (LBFGS's closure)
        self.eval_forwards = 0
        self.steps = 0  # optimizer steps of the loop (every optimizer stepped once)
        self.forwards_per_step: dict[int, int] = {}  # accumulation found: forwards a step -> steps
        self.samples_per_step: int | None = None  # samples of the first complete step
        self.batch_dim = 0  # where the batch is in the forward's inputs (set at the pre-flight)
        self.planned = False
        self.broken = False
        self._inside = False  # our own pre-flight runs the (copied) model: not the loop's
        self._in_step = 0  # optimizer steps running (a closure's forwards run inside)
        self._step_forwards = 0
        self._step_samples = 0
        self._stepped: set[int] = set()
        self._last_grad = 0.0
        self._backward_pending = False  # no optimizer: a backward ran since the last training forward
        self._handles: list[Any] = []

    # -- hooks -----------------------------------------------------------------------------------
    def install(self) -> None:
        model = self.model
        self._handles = []
        for module in self._modules:
            self._handles.append(
                module.register_forward_pre_hook(_Hook(self._before_forward), with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(_Hook(self._after_forward)))
        if self.recorder is not None:
            self.recorder.start()
        for optimizer in self.optimizers:
            self._handles.append(optimizer.register_step_pre_hook(_Hook(self._before_step)))
            self._handles.append(optimizer.register_step_post_hook(_Hook(self._after_step)))
        stamp = _Hook(self._grad_accumulated)
        seen: set[int] = set()
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(stamp))

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        if self.recorder is not None:
            self.recorder.stop()

    def _fail(self, error: BaseException) -> None:
        """A failure of ours: one warning, then every hook returns at once."""
        self.broken = True
        warn_at_user(f"resource_guard: watching the loop stopped: {error!r}; training goes on unobserved")

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.broken or self._inside or id(module) not in self._module_ids:
            return
        if self._pending is not None:  # the closure's loss refit said no: stop before this forward
            pending, self._pending = self._pending, None
            raise pending
        try:
            training = module.training and torch.is_grad_enabled()
            if not training:
                self.eval_forwards += 1
                if self.clock is not None and not self._in_step:
                    self.clock.switch("evaluation")
                return
            if not self.planned and self._record is None:
                self.planned = True
                self._inside = True
                try:
                    self._first_forward(args, kwargs)
                finally:
                    self._inside = False
            elif self.shapes is not None and not self._in_step:
                self._check_shape(args, kwargs)
            if self._in_step:
                self.closure_forwards += 1
                return
            if self._backward_pending:  # manual updates: the backward before this forward ended a step
                self._end_backward()
                self._close_step()
            self.forwards += 1
            self._step_forwards += 1
            if (
                self._record is None
                and self.grads_kept_at is None
                and self.steps < 3
                and self._grads_allocated()
            ):
                self.grads_kept_at = self._step_forwards
                if self._gradients_kept is not None:
                    self._inside = True
                    try:
                        self._gradients_kept(self._step_forwards)
                    finally:
                        self._inside = False
            if self.clock is not None:
                self._end_backward()  # an accumulating loop: the previous micro-batch's backward
                self.clock.switch("forward")
            if self.monitor is not None and (self._record is None or self._step_forwards == 1):
                batch = forward_batch(args, kwargs)  # recorded: the step's first forward has its batch
                rows = rows_along(batch, self.batch_dim)
                self._step_samples += rows or 0
                if self.batch_dim and rows:  # samples and tokens counted batch-first
                    batch = to_batch_first(batch, self.batch_dim, rows)
                self.monitor.batch_ready(batch)
        except (DoesNotFitError, ConfigurationError):
            raise  # the pre-flight's verdict, or a batch it cannot read: stop before this forward runs
        except Exception as error:
            self._fail(error)

    def _check_shape(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A later training forward: its shape against the plan (cached per shape; a new one traced),
        :class:`~resource_guard.errors.DoesNotFitError` before it runs when it does not fit. The loop
        cannot be told to split its batch: the error says how to let the guard do it."""
        batch = forward_batch(args, kwargs)
        if self.batch_dim:
            rows = rows_along(batch, self.batch_dim)
            if rows is None:
                return
            batch = to_batch_first(batch, self.batch_dim, rows)
        self._inside = True
        try:
            self.shapes.stop_if_too_big(batch)
        finally:
            self._inside = False

    def _grads_allocated(self) -> bool:
        return any(p.grad is not None for p in self.model.parameters() if p.requires_grad)

    def _after_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.broken or self._inside or self._in_step or id(module) not in self._module_ids:
            return
        try:
            if not (module.training and torch.is_grad_enabled()) or self.clock is None:
                return
            self.clock.switch("host")  # the loop's loss and own code, until backward reaches the output
            tensors = [t for t in iter_tensors(output) if t.requires_grad]
            first = _loss_tensor(output)
            target = first if first is not None and first.requires_grad else next(iter(tensors), None)
            if target is not None:
                target.register_hook(_Hook(self._backward_reached))
        except Exception as error:
            self._fail(error)

    def _backward_reached(self, grad: torch.Tensor) -> None:
        if self.broken or self._in_step or self.clock is None:
            return
        try:
            self.clock.switch("backward")
            self._last_grad = 0.0
        except Exception as error:
            self._fail(error)

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        if not self._inside:
            self._last_grad = _clock()
            if not self.optimizers and not self._in_step:
                self._backward_pending = True

    def _end_backward(self) -> None:
        """The backward phase ends at the last gradient accumulated; the rest was the loop's own code."""
        clock = self.clock
        if clock is not None and clock.current == "backward" and self._last_grad:
            clock.switch_at("host", self._last_grad)
        self._last_grad = 0.0

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if self.broken or self._inside:
            return None
        try:
            if not self._in_step:
                self._end_backward()
                if self.clock is not None:
                    self.clock.switch("optimizer")
            self._in_step += 1
            if self._closure_loss is not None and id(optimizer) in self._closure_ids:
                return _closure_seen(args, kwargs, self._saw_loss)
        except Exception as error:
            self._fail(error)
        return None

    def _saw_loss(self, loss: Any) -> None:
        if self._loss_bytes is None and isinstance(loss, torch.Tensor):
            self._loss_bytes = int(loss.untyped_storage().nbytes())

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.broken or self._inside:
            return
        try:
            self._in_step = max(0, self._in_step - 1)
            self._stepped.add(id(optimizer))
            if self._in_step or len(self._stepped) < len(self.optimizers):
                return
            self._stepped.clear()
            self._close_step()
            if self.recorder is not None and self._record is not None and not self.planned:
                self._recorded()
            if self._loss_bytes is not None and self._closure_loss is not None:
                report, self._closure_loss = self._closure_loss, None
                self._inside = True
                try:
                    report(self._loss_bytes)
                except DoesNotFitError as verdict:  # raised from the loop's next forward, not its step
                    self._pending = verdict
                finally:
                    self._inside = False
        except Exception as error:
            self._fail(error)

    def _recorded(self) -> None:
        """The first step of a loop with several optimizers ended: its recording becomes the plan."""
        recorder, record = self.recorder, self._record
        assert recorder is not None and record is not None
        recorder.stop()
        self.planned = True
        self._inside = True
        try:
            record(recorder)
        except DoesNotFitError as verdict:  # raised from the loop's next forward, not its step
            self._pending = verdict
        finally:
            self._inside = False
            recorder.fresh = []  # the loop's tensors of that step: not held any longer

    def finish(self) -> None:
        """The loop ended: a manual-update loop's last step (a backward with no forward after it) counts."""
        if self._backward_pending and not self.broken:
            try:
                self._end_backward()
                self._close_step()
            except Exception as error:
                self._fail(error)

    def _close_step(self) -> None:
        """One optimizer step of the loop is complete (every optimizer stepped, or a manual update's
        backward followed by the next forward): its forwards and samples counted, the monitor told."""
        self._backward_pending = False
        self.steps += 1
        forwards, self._step_forwards = self._step_forwards, 0
        self.forwards_per_step[forwards] = self.forwards_per_step.get(forwards, 0) + 1
        if self.samples_per_step is None and self._step_samples:
            self.samples_per_step = self._step_samples
            if self.monitor is not None and self.flops_per_sample:
                self.monitor.flops_per_step = self.flops_per_sample * self._step_samples
        self._step_samples = 0
        if self.clock is not None:
            self.clock.switch("data_wait")  # until the next forward: the loader and the loop's code
        if self.monitor is not None:
            self.monitor.step_end()

    # -- what was seen -----------------------------------------------------------------------------
    @property
    def accumulation(self) -> int | None:
        """Forwards per optimizer step, the commonest count (the loop's own accumulation); None for a
        recorded step of several optimizers, whose forwards are its models' (a GAN's D, G, D, D)."""
        if not self.forwards_per_step or self._record is not None:
            return None
        found = max(self.forwards_per_step.items(), key=lambda kv: (kv[1], kv[0]))[0]
        return found or None  # 0: the forwards run inside the step (a closure)

    def line(self) -> str:
        """The report's note of what the hooks counted."""
        accumulation = self.accumulation
        kind = (
            "optimizer step(s)"
            if self.optimizers
            else "step(s) (manual updates: a backward, then the next forward)"
        )
        words = (
            f"unchanged loop observed through hooks: {self.steps} {kind}, {self.forwards} training forward(s)"
        )
        if accumulation is not None:
            words += f"; the loop accumulates {accumulation} forward(s) a step"
            if self.samples_per_step:
                words += f" ({self.samples_per_step} samples a step)"
        if self.closure_forwards:
            words += f"; {self.closure_forwards} forward(s) inside optimizer steps (closure evaluations)"
        if self.recorder is not None:
            words += (
                f"; {len(self.optimizers)} optimizers: a step ends when each has stepped, its first one "
                f"recorded ({len(self.recorder.events)} events) and replayed for the plan"
            )
        return words + "; the time between a step and the next forward is counted as data wait (data + host)"

    def facts(self) -> dict[str, Any]:
        """What the hooks counted, JSON-ready (``guard.json``'s ``observed``)."""
        return {
            "mode": "hooks (unchanged loop)",
            "optimizer_steps": self.steps,
            "steps_counted": "optimizer step hooks"
            if self.optimizers
            else "a backward, then the next forward",
            "forwards": self.forwards,
            "accumulation": self.accumulation,
            "forwards_per_step": {str(k): v for k, v in sorted(self.forwards_per_step.items())},
            "closure_forwards": self.closure_forwards,
            "eval_forwards": self.eval_forwards,
            "samples_per_step": self.samples_per_step,
            "gradients_kept_from_forward": self.grads_kept_at,
            "watch_failed": self.broken,
        }


def _closure_seen(args: Any, kwargs: Any, saw: Callable[[Any], None]) -> tuple[Any, Any] | None:
    """``step(closure)``'s arguments with the closure wrapped to show ``saw`` what it returns (a step
    pre-hook may return new arguments; its ``args`` start with the optimizer itself); None when the step
    was given no callable closure."""
    closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if not callable(closure):
        return None

    def seen() -> Any:
        loss = closure()
        saw(loss)
        return loss

    if "closure" in kwargs:
        return tuple(args), {**kwargs, "closure": seen}
    return (args[0], seen, *args[2:]), dict(kwargs)


#: losses of the loop a closure optimizer's step holds at once: its first closure's (``LBFGS.step``
#: returns it, so it lives through the step), the one being computed, and the last step's returned one
#: (``loss = optimizer.step(closure)``)
CLOSURE_LOSSES_HELD = 3


def closure_loss_plan(plan: Any, loss_bytes: int) -> tuple[Any, str]:
    """``plan`` refitted for the losses a closure optimizer's step holds (:data:`CLOSURE_LOSSES_HELD`),
    each with the storage the loop's loss really has (``loss_bytes``: a reduced ``mse_loss`` returns a
    0-d loss on its whole unreduced buffer, which the stand-in loss of the pre-flight does not have).

    Raises:
        DoesNotFitError: the step with those losses is predicted not to fit.
    """
    import dataclasses

    from resource_guard.estimate.closure_step import ClosureState, with_closure_state

    extra = CLOSURE_LOSSES_HELD * loss_bytes
    held = f"losses a closure optimizer's step holds: {CLOSURE_LOSSES_HELD} × {loss_bytes:,} bytes"
    estimate = with_closure_state(plan.estimate, ClosureState(extra, 0, held))
    fit = estimate.for_device(plan.device, headroom=plan.headroom)
    mib = 2**20
    line = (
        f"the loop's closure returns a loss on {loss_bytes:,} bytes of storage; a closure optimizer's "
        f"step holds up to {CLOSURE_LOSSES_HELD} of them (its first closure's, the one computed, the last "
        f"step's): predicted peak {fit.allocated_peak_bytes / mib:,.2f} MiB"
    )
    made = dataclasses.replace(plan, estimate=estimate, fit=fit, reasons=(*plan.reasons, line))
    if not fit.fits:
        raise DoesNotFitError(
            f"{line}; that does not fit {fit.device.name} ({fit.usable_bytes / mib:,.1f} MiB usable). "
            "Lower the batch, or return a detached scalar from the closure.\n\n" + made.summary(),
            made,
        )
    return made, line


def batch_dim_of(model: nn.Module, batch: Any, declared: int | None) -> tuple[int, int, str | None]:
    """``(dim, rows, reason)``: where the batch of the loop's inputs is and its size.

    ``declared`` (``guard(batch_dim=)``) is taken as it is; else the model's first sequence layer says
    (:func:`~resource_guard.frontdoors.guard.batch_dim.infer_batch_dim`), falling back to dim 0 when the
    inputs do not share the dim it names but share dim 0 (a model that transposes its inputs itself).

    Raises:
        ConfigurationError: the batch size cannot be told (the message names ``batch_dim=``).
    """
    from resource_guard.frontdoors.guard.batch_dim import ambiguous_batch_error, infer_batch_dim, rows_along

    if declared is not None:
        rows = rows_along(batch, declared)
        if rows is None:
            raise ambiguous_batch_error(batch, declared, f"`batch_dim={declared}` declared", model)
        return declared, rows, f"batch dim {declared}: declared (`batch_dim={declared}`)"
    dim, reason = infer_batch_dim(model)
    rows = rows_along(batch, dim)
    if rows is not None:
        return dim, rows, reason
    if dim != 0:
        rows = batch_size_of(batch)
        if rows is not None:
            return 0, rows, f"batch dim 0: the inputs share dim 0, not dim {dim} ({reason})"
    raise ambiguous_batch_error(batch, dim, reason, model)


def plan_as_run(
    model: nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[nn.Module, Any], Any] | None,
    plan_kwargs: Mapping[str, Any],
    keep_outputs: bool = True,
    batch_dim: int | None = None,
) -> tuple[Any, torch.device, LoopLoss, int]:
    """The plan of the step the loop is about to run: the first forward's inputs, the loop's precision
    and device, no checkpointing. Returns ``(plan, torch device, loss, batch dim)``.

    A batch whose batch is dim 1 (declared, or said by the model: :func:`batch_dim_of`) is planned as
    batch-first views, the model wrapped to move them back
    (:class:`~resource_guard.frontdoors.guard.batch_dim.BatchFirstView`).

    Raises:
        DoesNotFitError: that step does not fit (the plan's micro-batch, the largest that fits, is in
            the message and the error's ``report``).
        ConfigurationError: the inputs' batch size cannot be told (the message names ``batch_dim=``).
    """
    import dataclasses

    from resource_guard.frontdoors.guard.batch_dim import BatchFirstView, to_batch_first
    from resource_guard.frontdoors.guard.setup import make_plan

    batch = forward_batch(args, kwargs)
    dim, rows, dim_reason = batch_dim_of(model, batch, batch_dim)
    traced: nn.Module = model
    if dim != 0:
        traced, batch = BatchFirstView(model, dim, batch), to_batch_first(batch, dim, rows)
    own = next((p.device for p in model.parameters()), torch.device("cpu"))
    kw = dict(plan_kwargs)
    if kw.get("device", "auto") == "auto":
        kw["device"] = str(own)
    kw["precision"] = loop_precision(model, own.type)
    kw["checkpointing"] = False  # the loop runs without it; the plan says what would change
    loss = LoopLoss(bool(args) and bool(kwargs), loss_fn)
    loss.keep_outputs = keep_outputs
    with torch.autocast(own.type, enabled=False):  # the trace applies the loop's precision itself
        made, device = make_plan(traced, optimizers, batch, loss, rows, kw)
    made = own_precision(made, "the loop's own (its autocast, else its parameters' dtype)")
    if dim_reason is not None:
        made = dataclasses.replace(made, reasons=(*made.reasons, dim_reason))
    if made.micro_batch_size < rows:
        raise _batch_too_big(
            made, rows, "the loop's first forward",
            "Lower the batch size, or let the guard split it: loop `for batch in g.iterate(loader):` and "
            f"call `g.backward(loss)` (micro-batches of {made.micro_batch_size} × "
            f"{made.accumulation_steps} accumulation keep the batch of {rows}).",
        )  # fmt: skip
    return made, device, loss, dim


def _batch_too_big(made: Any, rows: int, what: str, remedy: str) -> DoesNotFitError:
    """The error of a step whose batch of ``rows`` does not fit: the largest that does, the remedy."""
    return DoesNotFitError(
        f"{what}, a batch of {rows} in {made.precision}, is predicted not to fit {made.device.name} "
        f"({made.fit.usable_bytes / 2**20:,.1f} MiB usable); the largest batch that fits is "
        f"{made.micro_batch_size}. {remedy}\n\n{made.summary()}",
        made,
    )


def plan_recorded(
    model: nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    recorder: Any,
    plan_kwargs: Mapping[str, Any],
) -> tuple[Any, torch.device, Any]:
    """The plan of the step an unchanged loop with several optimizers ran first, recorded by ``recorder``
    (:mod:`~resource_guard.frontdoors.guard.recorded`): replayed as a
    :class:`~resource_guard.estimate.user_step.UserStep` over the loop's own tensors of that step, in the
    loop's precision and on its device. Returns ``(plan, torch device, the user step)``.

    Raises:
        DoesNotFitError: that step does not fit (the loop's batch cannot be split: no accumulation).
        ConfigurationError: the step's forwards took no tensor of the loop's (nothing to plan from).
    """
    import dataclasses

    from resource_guard.estimate.user_step import UserStep
    from resource_guard.frontdoors.guard.recorded import Backward, Forward, Step, replay_step
    from resource_guard.frontdoors.guard.setup import make_plan

    batch = tuple(recorder.fresh)
    if not batch:
        raise ConfigurationError(
            "the loop's first step gave its models no tensor of its own: nothing to plan the step from. "
            "Pass `loss_fn=UserStep(fn)` and `sample_batch=` to describe it."
        )
    rows = batch_size_of(batch) or batch_size_of(batch[0]) or 1
    events = recorder.events
    step = UserStep(replay_step(events), name="the loop's first step, recorded")
    own = next((p.device for p in model.parameters()), torch.device("cpu"))
    kw = dict(plan_kwargs)
    if kw.get("device", "auto") == "auto":
        kw["device"] = str(own)
    own_dtype = kw.get("precision") is None
    if own_dtype:
        kw["precision"] = loop_precision(model, own.type)
    kw["checkpointing"] = False
    # the loop's batch cannot be split (no accumulation): what the search said of smaller micro-batches
    # (a BatchNorm's trace failing at one row, say) is about steps that never run, and is not repeated
    with torch.autocast(own.type, enabled=False), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            made, device = make_plan(model, optimizers, batch, step, rows, kw)
        except DoesNotFitError as error:
            raise DoesNotFitError(
                f"the loop's step (recorded from its first step), a batch of {rows}, is predicted not to "
                f"fit; {error}",
                error.report,
            ) from None
    if own_dtype:
        made = own_precision(made, "the loop's own (its autocast, else its parameters' dtype)")
    if made.micro_batch_size >= rows:
        for warning in said:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    count = lambda kind: sum(isinstance(e, kind) for e in events)  # noqa: E731
    children = ", ".join(dict.fromkeys(e.child for e in events if isinstance(e, Forward)))
    line = (
        f"{len(optimizers)} optimizers, the loop unchanged: its first step recorded through hooks "
        f"({count(Forward)} forwards of {children}, {count(Backward)} backwards, {count(Step)} optimizer "
        "steps) and replayed on fake tensors, twice (the second pass starts with the gradients the first "
        "left): pre-flighted before the second step; the losses computed outside the models stand in as a "
        "cross-entropy over the outputs each backward reached"
    )
    made = dataclasses.replace(made, reasons=(*made.reasons, line))
    if made.micro_batch_size < rows:
        raise _batch_too_big(
            made, rows, "the loop's step (recorded from its first step)", "Lower the batch size."
        )
    return made, device, step


def gradients_kept_plan(plan: Any, forward: int) -> tuple[Any, str]:
    """``plan`` refitted for the loop's later micro-steps, which start with the gradients allocated (its
    own accumulation, or gradients zeroed instead of freed), and the report's line saying so.

    Raises:
        DoesNotFitError: those micro-steps are predicted not to fit (before the forward that starts
            the first of them runs).
    """
    import dataclasses

    fit = plan.estimate.for_device(plan.device, headroom=plan.headroom, gradients_kept=True)
    mib = 2**20
    line = (
        f"the loop runs forward {forward} of a step with the gradients allocated (its own gradient "
        "accumulation, or gradients zeroed instead of freed): predicted peak "
        f"{fit.allocated_peak_bytes / mib:,.2f} MiB (a step that starts without them: "
        f"{plan.fit.allocated_peak_bytes / mib:,.2f} MiB)"
    )
    made = dataclasses.replace(plan, fit=fit, reasons=(*plan.reasons, line))
    if not fit.fits:
        raise DoesNotFitError(
            f"{line}; that does not fit {fit.device.name} ({fit.usable_bytes / mib:,.1f} MiB usable). "
            "Lower the micro-batch, or let the guard split the batch: loop `for batch in "
            "g.iterate(loader):` and call `g.backward(loss)`.\n\n" + made.summary(),
            made,
        )
    return made, line
