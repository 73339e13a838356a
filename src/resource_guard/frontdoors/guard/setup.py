"""The guard's set-up: the plan from a batch, the model and optimizer state moved to the device,
checkpointing and the GradScaler applied, and the run monitor started."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError, DoesNotFitError, warn_at_user
from resource_guard.frontdoors.guard.args import torch_device_of
from resource_guard.step.precision import parse_precision
from resource_guard.step.training import LossFn, StandInLoss, batch_size_of

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = [
    "Prepared",
    "flops_per_sample",
    "make_plan",
    "monitor_capacity",
    "move_optimizer_state",
    "prepare_model",
    "start_monitor",
]


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare_model` applied: the checkpointing handle and the GradScaler (or ``None``)."""

    checkpointing: Any = None
    scaler: torch.amp.GradScaler | None = None


def make_plan(
    model: nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    batch: Any,
    loss_fn: LossFn,
    target: int,
    plan_kwargs: dict[str, Any],
) -> tuple[Plan, torch.device]:
    """The plan for ``batch`` (``allow_rough``: the run starts either way) and its torch device."""
    from resource_guard.planning.planner import plan

    made = plan(
        model,
        list(optimizers) if len(optimizers) > 1 else optimizers[0],
        batch,
        loss_fn,
        target_batch_size=target,
        allow_rough=True,  # the run starts either way: plan on the bound, its warning says why
        **plan_kwargs,
    )
    if len(optimizers) > 1 and made.accumulation_steps != 1:  # each loss is the loop's own
        raise DoesNotFitError(
            f"with {len(optimizers)} optimizers the loop's own step runs on the whole batch (no "
            f"accumulation), and a batch of {target} does not fit: the largest that fits is "
            f"{made.micro_batch_size}. Lower the batch size.",
            made,
        )
    if isinstance(loss_fn, StandInLoss) and loss_fn.used:
        made = dataclasses.replace(made, reasons=(*made.reasons, StandInLoss.REASON))
    return made, torch_device_of(made.device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move the optimizer's state tensors to ``device`` (scalars such as Adam's ``step`` stay)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            # Adam's `step` stays on the CPU unless capturable/fused: leave scalars where they are
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                state[key] = value.to(device)


def prepare_model(
    model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], plan: Plan, device: torch.device
) -> Prepared:
    """Model and optimizer state to ``device``; the plan's checkpointing, parameter dtype and scaler."""
    model.to(device)
    for optimizer in optimizers:
        move_optimizer_state(optimizer, device)
    out = Prepared()
    if plan.checkpointing:
        from resource_guard.planning.checkpointing import apply_checkpointing

        out.checkpointing = apply_checkpointing(model)
    spec = parse_precision(plan.precision)
    if spec.param_dtype != torch.float32:
        model.to(spec.param_dtype)
    if spec.loss_scaling:
        out.scaler = torch.amp.GradScaler(device.type)
    return out


def start_monitor(
    log_dir: os.PathLike[str] | None,
    plan: Plan,
    device: torch.device | None,
    *,
    profile: Any,
    memory_history: bool,
    shapes: Any,
    optimizers: tuple[torch.optim.Optimizer, ...] = (),
) -> Any:
    """A started :class:`~resource_guard.observe.monitor.RunMonitor`, or ``None`` (one warning) when it
    cannot start; a log dir that cannot be written raises."""
    try:
        from resource_guard.observe.monitor import RunMonitor

        monitor = RunMonitor(
            log_dir,
            device=device or "cpu",
            estimate=plan.estimate,
            capacity_bytes=monitor_capacity(plan, device),
            planned_capacity_bytes=plan.fit.capacity_bytes,
            device_spec=plan.device,
            profile=profile,
            precision=plan.precision,
            memory_history=memory_history,
            # Lightning's default: a log boundary (aggregation, one TensorBoard flush) costs ~0.3 ms,
            # ~6 us a step over 50 steps, ~30 us over 10
            log_every_n_steps=50,
            phase_timing=True,  # the guard switches the monitor's phase clock at its boundaries
        )
        monitor.shape_stats = shapes.stats if shapes is not None else None
        from resource_guard.report.plan_advice import plan_rows

        monitor.plan_rows = plan_rows(plan)  # the advice quotes the configuration it recommends
        monitor.optimizers = optimizers
        monitor.start()
        return monitor
    except ConfigurationError:
        raise
    except Exception as error:
        warn_at_user(f"resource_guard: monitoring is off for this run: {error!r}")
        return None


def flops_per_sample(
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
            warn_at_user(f"resource_guard: no MFU: {error!r}")
            return None
    else:
        flops = count_flops(model, batch, loss_fn, remedy=None)  # guard takes no flops_per_step
    return flops / size if flops else None


def monitor_capacity(plan: Plan, device: torch.device | None) -> int:
    """The capacity the run's measured peak is compared with.

    On the CPU the monitor measures the process's RSS, interpreter and libraries included, so a
    ``memory_limit`` (which caps tensor bytes) is no fair yardstick for it: the host's RAM is.
    """
    if device is not None and device.type == "cpu":
        from resource_guard.devices import resolve_device

        return resolve_device("cpu").memory_bytes
    return plan.fit.capacity_bytes
