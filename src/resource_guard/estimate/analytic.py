"""Analytic fallback when a training step cannot be traced: a conservative count from shapes alone.

Parameters, gradients and optimizer state are exact (they follow from the parameters and the
optimizer's type). Activations cannot be known without running the model; the fallback assumes every
leaf module keeps an output as wide as the widest layer for every position of the batch, twice over,
which overstates typical models, and adds a quarter plus 1 MiB for what it cannot see.
Callers see ``method="analytic"`` and the reason in ``warnings``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from resource_guard.estimate.result import MemoryEstimate
from resource_guard.estimate.tracer import CATEGORIES
from resource_guard.step.precision import PrecisionSpec
from resource_guard.step.training import batch_size_of, iter_tensors

__all__ = ["analytic_estimate", "optimizer_states_per_param"]

_SLACK_BYTES = 2**20
_TWO_STATES = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Lamb", "LAMB", "Adafactor")


def optimizer_states_per_param(optimizer: Any) -> int:
    """How many parameter-sized tensors the optimizer keeps per parameter in steady state."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    name = cls.__name__
    groups = getattr(optimizer, "param_groups", None) or [getattr(optimizer, "defaults", {})]
    if name in _TWO_STATES:
        return 3 if any(g.get("amsgrad") for g in groups) else 2
    if name == "SGD":
        return 1 if any(g.get("momentum", 0) for g in groups) else 0
    if name in ("Adagrad", "Adadelta", "Rprop", "ASGD"):
        return 2 if name in ("Adadelta", "Rprop") else 1
    if name == "RMSprop":
        return 1 + any(g.get("momentum", 0) for g in groups) + any(g.get("centered") for g in groups)
    return 2  # unknown optimizer: assume Adam-like


def _widest(model: nn.Module) -> int:
    width = 1
    for m in model.modules():
        for attr in ("out_features", "out_channels", "embedding_dim", "hidden_size", "normalized_shape"):
            value = getattr(m, attr, None)
            if isinstance(value, int):
                width = max(width, value)
            elif isinstance(value, tuple) and value:
                width = max(width, math.prod(value))
    return width


def _positions(batch: Any) -> int:
    """Positions per batch: token ids count one each; float inputs count all but their last dimension."""
    best = 1
    for t in iter_tensors(batch):
        n = t.numel() if not t.is_floating_point() else t.numel() // max(1, t.shape[-1] if t.dim() else 1)
        best = max(best, n)
    return best


def analytic_estimate(
    model: nn.Module, optimizer: Any, batch: Any, spec: PrecisionSpec, device_kind: str, *, reason: str
) -> Any:
    """A conservative :class:`~resource_guard.MemoryEstimate` from shapes alone."""
    params = list({id(p): p for p in model.parameters()}.values())

    def size(t: torch.Tensor) -> int:
        dtype = spec.param_dtype if t.is_floating_point() else t.dtype
        return t.numel() * dtype.itemsize

    param_bytes = sum(size(p) for p in params)
    trainable_bytes = sum(size(p) for p in params if p.requires_grad)
    buffer_bytes = sum(size(b) for b in model.buffers())
    states = optimizer_states_per_param(optimizer)
    input_bytes = sum(t.numel() * t.element_size() for t in iter_tensors(batch))
    compute_bytes = spec.compute_dtype.itemsize
    leaves = sum(1 for m in model.modules() if not list(m.children()))
    activations = 2 * leaves * _positions(batch) * _widest(model) * compute_bytes
    if spec.autocast_dtype is not None:
        activations += trainable_bytes // 2  # autocast's low-precision copies of the weights
    temporaries = trainable_bytes if device_kind in ("cuda", "rocm") else trainable_bytes // 4
    known = (
        param_bytes + buffer_bytes + (1 + states) * trainable_bytes + input_bytes + activations + temporaries
    )
    temporaries += known // 4 + _SLACK_BYTES  # margin: never optimistic
    breakdown = dict.fromkeys(CATEGORIES, 0)
    breakdown.update(
        parameters=param_bytes,
        gradients=trainable_bytes,
        optimizer_state=states * trainable_bytes,
        activations=activations,
        temporaries=temporaries,
        inputs=input_bytes,
        other=buffer_bytes,
    )
    return MemoryEstimate(
        peak_bytes=sum(breakdown.values()),
        breakdown=breakdown,
        method="analytic",
        precision=spec.name,
        device_kind=device_kind,
        peak_phase=None,
        batch_size=batch_size_of(batch),
        parameter_count=sum(p.numel() for p in params),
        trainable_parameter_count=sum(p.numel() for p in params if p.requires_grad),
        persistent_bytes=param_bytes + buffer_bytes + states * trainable_bytes,
        warnings=(reason,),
    )
