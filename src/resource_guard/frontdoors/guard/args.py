"""Checks of ``guard(...)``'s arguments, made in the constructor without probing hardware."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import torch

from resource_guard.errors import ConfigurationError
from resource_guard.frontdoors.vocabulary import check_log_dir

if TYPE_CHECKING:
    from resource_guard.devices import DeviceSpec

__all__ = [
    "check_device_and_catalog",
    "check_guard_args",
    "check_iterate",
    "check_log_dir",
    "torch_device_of",
]


def torch_device_of(spec: DeviceSpec) -> torch.device:
    """The torch device a (detected) :class:`DeviceSpec` names.

    Raises:
        ConfigurationError: ``spec`` is a catalog device that is not on this machine.

    Example:
        >>> from resource_guard.devices import resolve_device
        >>> torch_device_of(resolve_device("cpu"))
        device(type='cpu')
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


def check_device_and_catalog(device: Any, catalog: Any) -> Any:
    """Refuse a device name that is neither local-looking nor in the catalog, without probing hardware.

    Returns the catalog loaded from a path (or as given). Whether a local device exists is checked at
    enter, where probing the hardware belongs.
    """
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


def check_guard_args(
    model: Any, optimizer: Any, *, loss_fn: Any, sample_batch: Any, precision: Any, target_batch_size: Any,
    device: Any, checkpointing: Any, memory_limit: Any, headroom: Any, log_dir: Any, clip_grad_norm: Any,
    monitor: Any, profile: Any, catalog: Any, memory_history: Any, max_seq_len: Any, check_shapes: Any,
    keep_outputs: Any, batch_dim: Any, log_every_n_steps: Any = None, log_interval_s: Any = 2.0,
) -> tuple[str | None, Any, int | None, bool]:  # fmt: skip
    """``guard(...)``'s arguments checked, each refused with ``ConfigurationError`` quoting the call:
    the precision (normalized), the catalog (loaded), the batch dim and whether the loop's first step is
    to be recorded (several optimizers, no ``UserStep``: a GAN's unchanged loop)."""
    from torch import nn

    from resource_guard.estimate.user_step import UserStep, check_optimizers
    from resource_guard.frontdoors.guard.batch_dim import check_batch_dim
    from resource_guard.frontdoors.shape_guard import check_worst_case_args
    from resource_guard.frontdoors.vocabulary import check_shared
    from resource_guard.planning.planner import _check_args

    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"`guard(model=...)` must be a torch.nn.Module, got {type(model).__name__}.")
    several = isinstance(optimizer, (list, tuple))  # a GAN's loop: g.backward(loss, optimizer=...)
    recording = several and not isinstance(loss_fn, UserStep)
    if several:
        check_optimizers(model, optimizer, loss_fn, "guard", recorded=recording)
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
    # the settings every door shares, in the same words (frontdoors/vocabulary.py)
    precision = check_shared(
        "guard", memory_limit=memory_limit, precision=precision, target_batch_size=target_batch_size,
        max_seq_len=max_seq_len, log_dir=log_dir, profile=profile, monitor=monitor,
        log_every_n_steps=log_every_n_steps, log_interval_s=log_interval_s,
    )  # fmt: skip
    _check_args(headroom, target_batch_size, 1, "auto", checkpointing, call="guard")
    catalog = check_device_and_catalog(device, catalog)
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ConfigurationError(f"`guard(clip_grad_norm={clip_grad_norm!r})` must be > 0 or None.")
    for name, value in (("memory_history", memory_history), ("keep_outputs", keep_outputs)):
        if not isinstance(value, bool):
            raise ConfigurationError(f"`guard({name}={value!r})` must be True or False.")
    dim = check_batch_dim(batch_dim)
    if dim == 1 and sample_batch is not None:
        raise ConfigurationError(
            "`guard(..., batch_dim=1, sample_batch=...)`: `g.iterate` cuts batches along dim 0. Leave "
            "the sequence-first loop unchanged under `with guard(model, optimizer, batch_dim=1):` (the "
            "guard pre-flights its first forward), or give batch-first batches to `g.iterate`."
        )
    check_worst_case_args("guard", max_seq_len, check_shapes)
    return precision, catalog, dim, recording


def check_iterate(optimizers: tuple[torch.optim.Optimizer, ...], batch_dim: int | None) -> None:
    """Refuse, before step 0, a loop ``g.iterate``/``g.backward`` cannot drive: batches cut along the
    wrong dim, no optimizer to step, or an optimizer that steps with a closure."""
    from resource_guard.estimate.closure_step import needs_closure

    if batch_dim == 1:  # the batches would be cut along the wrong dim
        raise ConfigurationError(
            "`g.iterate(...)` with `guard(..., batch_dim=1)`: `g.iterate` cuts batches along dim 0. "
            "Leave the sequence-first loop unchanged (the guard pre-flights, times and reports it), or "
            "give `g.iterate` batch-first batches and drop `batch_dim=1`."
        )
    if not optimizers:  # g.backward would have nothing to step
        raise ConfigurationError(
            "`g.iterate(...)` with `guard(model, None)`: the loop updates the parameters by hand, so "
            "`g.backward` has no optimizer to step. Leave the loop unchanged under `with guard(model, "
            "None):` (the guard pre-flights, times and reports it), or pass the optimizer."
        )
    closure = next((type(o).__name__ for o in optimizers if needs_closure(o)), None)
    if closure is not None:  # g.backward steps with no closure to re-evaluate
        raise ConfigurationError(
            f"{closure} steps with a closure that re-evaluates the model (`optimizer.step(closure)`), "
            "which `g.iterate`/`g.backward` cannot give it. Leave the loop unchanged under "
            "`with guard(model, optimizer):` and call `optimizer.step(closure)` yourself: the guard "
            "pre-flights the closure's step (its history included), times and reports it."
        )
