"""The guard's set-up: the plan from a batch, the model and optimizer state moved to the device,
checkpointing and the GradScaler applied, and the run monitor (:func:`build_monitor`)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from resource_guard.errors import DoesNotFitError, warn_at_user
from resource_guard.frontdoors.guard.args import torch_device_of
from resource_guard.step.precision import parse_precision
from resource_guard.step.training import LossFn, StandInLoss, batch_size_of

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = [
    "Prepared",
    "build_monitor",
    "flops_per_sample",
    "make_plan",
    "move_optimizer_state",
    "prepare_model",
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


def build_monitor(
    log_dir: os.PathLike[str] | None,
    plan: Plan,
    device: torch.device,
    profile: Any,
    memory_history: bool,
    *,
    log_every_n_steps: int | None = None,
    log_interval_s: float = 2.0,
) -> Any:
    """The :class:`~resource_guard.observe.monitor.RunMonitor` of the guard's plan (not started; see
    :func:`~resource_guard.frontdoors.run.new_monitor`)."""
    from resource_guard.frontdoors.run import new_monitor

    return new_monitor(
        plan,
        device,
        log_dir,
        profile=profile,
        precision=plan.precision,
        memory_history=memory_history,
        log_every_n_steps=log_every_n_steps,
        log_interval_s=log_interval_s,
    )


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
