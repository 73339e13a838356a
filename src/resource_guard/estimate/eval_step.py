"""The memory of one evaluation step (validation or test), traced on fake tensors, and measured for real.

An evaluation step is the forward (and the loss, when a loss function is given) with the model in
eval mode under ``torch.no_grad()``: dropout draws no mask, batch norm reads its running statistics,
and autograd saves nothing, so the step's own memory is its largest transient (often the logits and
the loss's float32 log-probabilities). It runs on top of what the run holds at that moment, which the
caller states:

- the parameters and buffers, always;
- the optimizer's state, when ``optimizer`` is given: as in a steady-state step, it exists (it is
  created by the first optimizer step; before it, pass ``optimizer=None``);
- the gradients, when kept. Lightning 2.x zeroes gradients *before* backward (its automatic
  optimization's closure: training step, ``optimizer.zero_grad()``, backward; then
  ``optimizer.step()``), so every trainable parameter's ``.grad`` is allocated when ``fit`` validates
  after a training step: ``gradients_kept=True``. A plain loop that calls ``optimizer.zero_grad()``
  after the step (``set_to_none=True``, torch's default since 2.0), as ``guard`` does, evaluates
  without them; one that zeroes at the top of its loop keeps them. ``gradients_kept=None`` takes what
  the model holds now: the parameters whose ``.grad`` is not ``None``.

The trace reuses the training step's machinery: the model, optimizer and batch are copied onto fake
tensors (:class:`~resource_guard.estimate.trace.fake_world.FakeStep`), the forward runs as on the target
(:func:`~resource_guard.estimate.trace.fake_world.target_forward`: CUDA's autocast policy and attention
kernel on a GPU target) and a :class:`~resource_guard.estimate.trace.tracer.StorageTracker` counts live
bytes by category. :func:`measure_eval_step` is the ground truth on this CPU, measured as
:func:`~resource_guard.estimate.host.measure.measure_training_step` measures a training step.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> est = estimate_eval_memory(model, torch.randn(32, 64), optimizer=opt, gradients_kept=True,
    ...                            device="cpu")
    >>> est.breakdown["gradients"] == est.breakdown["parameters"], est.peak_phase
    (True, 'eval')
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
import warnings
from typing import Any

import torch
from torch import nn

from resource_guard.devices import DeviceSpec
from resource_guard.errors import ConfigurationError, ResourceGuardWarning
from resource_guard.estimate.analytic import analytic_estimate
from resource_guard.estimate.emulate.target import Target
from resource_guard.estimate.estimator import _default_kind, _device_kind, _first_line, unwrap_model
from resource_guard.estimate.fsdp.fsdp2 import is_fully_sharded
from resource_guard.estimate.host import kernels as _kernels
from resource_guard.estimate.host.cpu_support import CpuStepCheck
from resource_guard.estimate.host.measure import MeasuredStep, allocation_deltas, live_bytes, peak_of
from resource_guard.estimate.host.quiet import quiet_profile, torch_logs_silenced
from resource_guard.estimate.result import TRACED, TRACED_RECOVERED, MemoryEstimate
from resource_guard.estimate.trace.composite import CompositeOps
from resource_guard.estimate.trace.fake_world import FakeStep, isolated_global_state, target_forward
from resource_guard.estimate.trace.libraries import as_real_step
from resource_guard.estimate.trace.recovery import fake_mode as _fake_mode
from resource_guard.estimate.trace.recovery import fake_numpy
from resource_guard.estimate.trace.tracer import StorageTracker
from resource_guard.step.precision import PrecisionSpec, autocast_context, parse_precision
from resource_guard.step.training import (
    LossFn,
    OptimizerArg,
    batch_size_of,
    call_loss_fn,
    default_loss_fn,
    iter_tensors,
    training_step,
)

__all__ = ["EVAL_PHASE", "estimate_eval_memory", "measure_eval_step"]

EVAL_PHASE = "eval"
"""``MemoryEstimate.peak_phase`` of an evaluation step."""


def _stateless(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Stands for "no optimizer" in the fake world: plain SGD keeps no state and is never stepped."""
    return torch.optim.SGD(params or [nn.Parameter(torch.empty(0))], lr=0.0)


def _check(model: Any, optimizer: Any, batch: Any, loss_fn: Any, gradients_kept: Any) -> None:
    who = "estimate_eval_memory"
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"`{who}(model=...)` must be a torch.nn.Module, got {type(model).__name__}.")
    if is_fully_sharded(model):
        raise ConfigurationError(
            f"`{who}(model=...)`: an FSDP2 (fully_shard) module's evaluation step is not estimated; pass "
            "the module before fully_shard (its replica's step is an upper bound per rank)."
        )
    if optimizer is not None and not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise ConfigurationError(
            f"`{who}(optimizer=...)` must be a torch.optim.Optimizer, a factory `params -> Optimizer` or "
            f"None (no optimizer state resident), got {type(optimizer).__name__}."
        )
    if batch is None:
        raise ConfigurationError(f"`{who}(batch=None)`: pass one batch as the evaluation loop receives it.")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigurationError(
            f"`{who}(loss_fn={loss_fn!r})` must be a callable `(model, batch) -> output` or None (the "
            "forward alone)."
        )
    if gradients_kept not in (None, True, False):
        raise ConfigurationError(
            f"`{who}(gradients_kept={gradients_kept!r})` must be True, False or None (the gradients the "
            "model holds now)."
        )


def _trace(
    model: nn.Module,
    optimizer: OptimizerArg | None,
    batch: Any,
    loss_fn: LossFn | None,
    spec: PrecisionSpec,
    kind: str,
    target: Target,
    with_grad: list[bool],
) -> MemoryEstimate:
    started = time.perf_counter()
    step_spec, step_loss_fn, forward = target_forward(target, spec, loss_fn)
    cpu_check = CpuStepCheck() if kind == "cpu" else None  # what of the step this CPU can run
    composite = CompositeOps(kind, cpu_autocast=step_spec.autocast_dtype)
    tracker = StorageTracker(
        functools.partial(_kernels.kernel_extra, device_kind=kind, cpu_check=cpu_check),
        composite=composite,
    )
    with as_real_step(), fake_numpy(tracker.recovery), _fake_mode(), tracker, forward:
        world = FakeStep(model, optimizer if optimizer is not None else _stateless, batch, spec, tracker)
        hooks = cpu_check.watch(world.model) if cpu_check is not None else []
        if optimizer is not None:
            world.warm_up_optimizer()
            for opt in world.optimizers:  # every optimizer's state (a GAN's two)
                for st in opt.state.values():
                    for v in st.values():
                        if isinstance(v, torch.Tensor):
                            tracker.track(v, "optimizer_state")
        for p, kept in zip(world.params, with_grad):
            if kept:
                p.grad = torch.zeros_like(p)
                tracker.track(p.grad, "gradients")
        for t in iter_tensors(world.batch):
            tracker.track(t, "inputs")
        world.model.eval()
        initial = tracker.live_storages()
        tracker.recording = True
        tracker.start_phase("forward")  # the phase whose new storages count as activations
        with torch.no_grad(), autocast_context(step_spec, "cpu"):
            out = (step_loss_fn or default_loss_fn)(world.model, world.batch)
        del out
        tracker.start_phase("done")
        tracker.detach()
        for hook in hooks:
            hook.remove()
    best = max(tracker.peaks.values(), key=lambda r: r.bytes)
    params = {id(p): p for p in model.parameters()}.values()
    recovered = tracker.recovery.summary()
    notes = [f"recovered {line}" for line in recovered] + composite.notes()
    unsupported = cpu_check.unsupported if cpu_check is not None else ()
    unknown = cpu_check.unknown if cpu_check is not None else ()
    notes += cpu_check.notes() if cpu_check is not None else []
    resident = "parameters" + (", optimizer state" if optimizer is not None else "")
    resident += ", gradients" if any(with_grad) else ""
    persistent = sum(best.breakdown[c] for c in ("parameters", "optimizer_state", "other"))
    return MemoryEstimate(
        peak_bytes=best.bytes,
        breakdown=best.breakdown,
        method=TRACED if not recovered else TRACED_RECOVERED,
        precision=spec.name,
        device_kind=kind,
        peak_phase=EVAL_PHASE,
        peak_op=best.op,
        batch_size=batch_size_of(batch),
        parameter_count=sum(p.numel() for p in params),
        trainable_parameter_count=sum(p.numel() for p in params if p.requires_grad),
        persistent_bytes=persistent,
        phase_peak_bytes={EVAL_PHASE: best.bytes},
        warnings=tuple(notes),
        cpu_unsupported=tuple(u.describe() for u in unsupported),
        cpu_unknown=tuple(u.describe() for u in unknown),
        allocations=tuple(tracker.events),
        initial_allocations=initial,
        trace_seconds=time.perf_counter() - started,
        assumed_target=f"{forward.describe(spec.name)}; evaluation step (eval mode, no_grad) over {resident}",
        recovered_ops=recovered,
    )


def estimate_eval_memory(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    optimizer: OptimizerArg | None = None,
    gradients_kept: bool | None = None,
    precision: str = "32-true",
    device: str | DeviceSpec | None = None,
) -> MemoryEstimate:
    """Estimate the memory of one evaluation step (see the module docstring for what is resident).

    Args:
        model: the model, on any device including ``meta``.
        batch: one evaluation batch, as the evaluation loop receives it.
        loss_fn: ``(model, batch) -> output``, traced under ``no_grad`` (its output may be anything);
            default: the forward alone (``model(**batch)``, ``model(*batch)`` or ``model(batch)``).
        optimizer: the run's optimizer (or a factory ``params -> Optimizer``): its steady-state state
            is resident. ``None``: no optimizer state (before the first step, ``trainer.validate``).
        gradients_kept: ``True``: every trainable parameter's gradient is allocated (Lightning's
            ``fit``); ``False``: none; ``None``: those the model holds now.
        precision: a Lightning precision name; ``*-mixed`` runs the forward under autocast.
        device: the target device kind or catalog name, as for
            :func:`~resource_guard.estimate.estimator.estimate_memory`.

    Returns:
        A :class:`~resource_guard.MemoryEstimate` of the step, ``peak_phase == "eval"``; its
        ``assumed_target`` names what was taken as resident. :meth:`~resource_guard.MemoryEstimate.for_device`
        gives what a device would show. When the step cannot be traced: the training step's analytic
        upper bound (an evaluation step keeps less), ``method == "analytic"``.
    """
    model, unwrapped = unwrap_model(model)
    _check(model, optimizer, batch, loss_fn, gradients_kept)
    spec = parse_precision(precision)
    kind = _device_kind(device) if device is not None else _default_kind(model)
    target = Target.of(device, kind)
    params = list(model.parameters())
    if gradients_kept is None:
        with_grad = [p.requires_grad and p.grad is not None for p in params]
    else:
        with_grad = [p.requires_grad and gradients_kept for p in params]
    with isolated_global_state():
        try:
            with torch_logs_silenced():
                est = _trace(model, optimizer, batch, loss_fn, spec, kind, target, with_grad)
        except ConfigurationError:
            raise
        except Exception as exc:  # the step cannot continue past an operator: a bound that holds
            reason = f"tracing the evaluation step failed ({type(exc).__name__}: {_first_line(exc)})"
            warnings.warn(f"{reason}; the training step's analytic bound", ResourceGuardWarning, stacklevel=2)
            with torch_logs_silenced():
                est = analytic_estimate(model, optimizer or _stateless, batch, spec, kind, reason=reason)
            est = dataclasses.replace(est, assumed_target=f"as on {target.describe()}, {spec.name}")
    return dataclasses.replace(est, warnings=unwrapped + est.warnings) if unwrapped else est


def measure_eval_step(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    gradients_kept: bool = False,
    precision: str = "32-true",
) -> MeasuredStep:
    """The real peak of one evaluation step on this CPU (the ground truth of :func:`estimate_eval_memory`).

    With ``optimizer``, one real training step runs first (its state then exists); with
    ``gradients_kept``, one more forward and backward leaves every gradient allocated. Then the model
    goes to eval mode and the step runs under ``torch.no_grad()`` inside torch.profiler's memory
    records, as :func:`~resource_guard.estimate.host.measure.measure_training_step` measures a training
    step. The model's train/eval mode is restored; the model and optimizer are trained for real when
    given: pass throwaway copies.

    Example:
        >>> m = nn.Linear(8, 2)
        >>> r = measure_eval_step(m, torch.randn(4, 8))
        >>> r.peak_bytes > r.start_bytes > 0
        True
    """
    spec = parse_precision(precision)
    scale = 2.0**16 if spec.loss_scaling else None
    was_training = model.training
    if optimizer is not None:
        model.train()
        training_step(model, optimizer, batch, loss_fn, spec, "cpu", loss_scale=scale)
    if gradients_kept:
        model.train()
        with autocast_context(spec, "cpu"):
            loss = call_loss_fn(model, batch, loss_fn)
        (loss.float() * scale if scale is not None else loss).backward()
        del loss
    model.eval()
    try:
        gc.collect()
        start = live_bytes(model, optimizer, batch) if optimizer is not None else live_bytes(model, batch)
        with quiet_profile() as prof:
            with torch.no_grad(), autocast_context(spec, "cpu"):
                out = (loss_fn or default_loss_fn)(model, batch)
            del out
    finally:
        model.train(was_training)
    deltas = allocation_deltas(prof)
    peak = peak_of(deltas)
    return MeasuredStep(start + peak, start, peak, sum(1 for _, s in deltas if s > 0))
