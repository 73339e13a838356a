"""Estimate a deep model from two shallow traces: its repeated blocks are identical, so they add linearly.

An 80-layer decoder runs the same block 80 times; every byte a block adds (its parameters, gradients,
optimizer state, the activations it saves for backward, the allocator's overhead on them) is the same
for each. :func:`estimate_by_blocks` traces the model with only its first ``k₁`` and ``k₂`` blocks
(1 and 2 by default) of the repeated container (the rest of the model unchanged) and extrapolates
linearly to the full depth ``L``::

    x(L) = x(k₂) + (L − k₂) / (k₂ − k₁) · (x(k₂) − x(k₁))          (never below x(k₂))

for the parameter counts and, per phase, the moments that are the same at every depth (the highest
transient bytes: the end of the forward, the start of the backward; after the backward, the highest
total); the peak is the highest of those moments. The caching allocator's
overhead on the step's churn is the larger sample's (:class:`BlockEstimate`). The blocks must be the
children of one ``nn.ModuleList`` / ``nn.Sequential`` whose forward only iterates them (what
:func:`~resource_guard.planning.checkpointing.find_checkpoint_blocks` finds). Not used, the full
trace runs instead, when the model has few blocks or ``optimizer`` is an optimizer instance (it holds
the parameters of every block). ``tests/estimate/test_blocks.py`` checks it against the full trace.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])
    >>> est = estimate_by_blocks(model, torch.optim.AdamW, torch.randn(8, 64), lambda m, b: m(b).sum(),
    ...                          blocks=[str(i) for i in range(12)], device="cpu")
    >>> est.parameter_count == sum(p.numel() for p in model.parameters())
    True
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.allocation.allocator import rank_overhead
from resource_guard.estimate.estimator import estimate_memory
from resource_guard.estimate.result import MemoryEstimate
from resource_guard.estimate.trace.tracer import CATEGORIES
from resource_guard.step.precision import PrecisionSpec
from resource_guard.step.training import LossFn, OptimizerArg

__all__ = ["BlockEstimate", "SAMPLE_BLOCKS", "estimate_by_blocks", "extrapolate", "sampleable"]

SAMPLE_BLOCKS = (1, 2)
_TRANSIENT = tuple(CATEGORIES.index(c) for c in ("activations", "temporaries", "inputs", "other"))


@dataclass(frozen=True)
class BlockEstimate(MemoryEstimate):
    """A :class:`MemoryEstimate` extrapolated from shallow traces.

    Attributes:
        blocks_sampled: the depths traced, ``(k₁, k₂)``; ``blocks_total``: the model's depth.
        allocator_overhead: ``(rounding, fragmentation)`` bytes of the caching allocator over the
            step's churn: the larger of the two samples', not extrapolated (the next identical block
            reuses the blocks the previous one freed, so the holes do not add up with depth; checked
            against the full trace in the tests). The ``allocations`` events are the deeper sample's.
    """

    blocks_sampled: tuple[int, int] = (0, 0)
    blocks_total: int = 0
    allocator_overhead: tuple[int, int] | None = None


def _container(model: nn.Module, blocks: Sequence[str]) -> nn.Module:
    parents = {name.rpartition(".")[0] for name in blocks}
    if len(parents) != 1:
        raise ConfigurationError(
            f"`estimate_by_blocks(blocks=...)` must be children of one container, got {parents}"
        )
    container = model.get_submodule(parents.pop())
    children = [n for n, _ in container.named_children()]
    if (
        not isinstance(container, (nn.ModuleList, nn.Sequential))
        or [b.rpartition(".")[2] for b in blocks] != children
    ):
        raise ConfigurationError(
            "`estimate_by_blocks(blocks=...)` must be every child, in order, of one nn.ModuleList or "
            "nn.Sequential"
        )
    return container


def sampleable(model: nn.Module, blocks: Sequence[str]) -> bool:
    """Whether ``blocks`` are every child, in order, of one ``ModuleList``/``Sequential`` of ``model``."""
    try:
        _container(model, blocks)
    except (ConfigurationError, AttributeError):
        return False
    return len(blocks) > 0


@contextlib.contextmanager
def _truncated(container: nn.Module, k: int) -> Iterator[None]:
    """The container holds only its first ``k`` children inside (the model is restored on exit)."""
    saved = container._modules
    container._modules = OrderedDict(list(saved.items())[:k])
    try:
        yield
    finally:
        container._modules = saved


def _lerp(a: float, b: float, f: float) -> int:
    return int(max(b, b + f * (b - a)))


def _vec(a: Sequence[int], b: Sequence[int], f: float) -> tuple[int, ...]:
    return tuple(_lerp(x, y, f) for x, y in zip(a, b))


_STABLE = ("optimizer", "zero_grad", "done")  # phases whose highest total is the same moment at any depth


def _phase_points(est: MemoryEstimate) -> dict[str, list[tuple[int, ...]]]:
    """Per phase, the points that are the same moment of the step at any depth: the highest transient
    (the end of the forward, the start of the backward), and after the backward the highest total."""
    best: dict[str, list[tuple[int, ...]]] = {}
    for phase, values in est.timeline:
        key = phase.split(":")[0]
        cur = best.setdefault(key, [tuple(values)] * (2 if key in _STABLE else 1))
        if sum(values[i] for i in _TRANSIENT) > sum(cur[0][i] for i in _TRANSIENT):
            cur[0] = tuple(values)
        if key in _STABLE and sum(values) > sum(cur[1]):
            cur[1] = tuple(values)
    return best


def extrapolate(a: MemoryEstimate, b: MemoryEstimate, ks: tuple[int, int], total: int) -> BlockEstimate:
    """``b``'s figures extrapolated to ``total`` blocks from ``a`` (``ks[0]`` blocks), ``b`` (``ks[1]``).

    Only moments that are the same at every depth are extrapolated (:func:`_phase_points`): a
    point's value changes by one block's bytes per block there. The peak is the highest of them.
    Inside the backward, the gradients grow as the activations shrink; the peak is at its start
    (activations) or its end (every gradient: the optimizer phase's start), which both are.
    """
    f = (total - ks[1]) / (ks[1] - ks[0])
    pa, pb = _phase_points(a), _phase_points(b)
    timeline = tuple(
        (phase, _vec(pa.get(phase, pts)[i], pts[i], f)) for phase, pts in pb.items() for i in range(len(pts))
    )
    top_phase, top = max(timeline, key=lambda pt: sum(pt[1]))
    phases: dict[str, int] = {}
    for phase, values in timeline:
        phases[phase] = max(phases.get(phase, 0), sum(values))
    for k, v in b.phase_peak_bytes.items():
        if ":" in k:  # the optimizer's code paths: after the backward, the same moment at any depth
            phases[k] = _lerp(a.phase_peak_bytes.get(k, v), v, f)
    ra, rb = rank_overhead(a), rank_overhead(b)
    scaled = (
        f"extrapolated from traces of {ks[0]} and {ks[1]} of {total} identical blocks "
        f"({a.trace_seconds + b.trace_seconds:.2f} s)"
    )
    return BlockEstimate(
        peak_bytes=sum(top),
        breakdown=dict(zip(CATEGORIES, top)),
        method=f"{b.method} (blocks)",
        precision=b.precision,
        device_kind=b.device_kind,
        peak_phase=top_phase,
        peak_op=b.peak_op if b.peak_phase == top_phase else None,
        batch_size=b.batch_size,
        parameter_count=_lerp(a.parameter_count, b.parameter_count, f),
        trainable_parameter_count=_lerp(a.trainable_parameter_count, b.trainable_parameter_count, f),
        persistent_bytes=_lerp(a.persistent_bytes, b.persistent_bytes, f),
        phase_peak_bytes=phases,
        warnings=(*b.warnings, scaled),
        timeline=timeline,
        allocations=b.allocations,
        initial_allocations=b.initial_allocations,
        trace_seconds=a.trace_seconds + b.trace_seconds,
        blocks_sampled=ks,
        blocks_total=total,
        allocator_overhead=(max(ra[0], rb[0]), max(ra[1], rb[1])),
    )


def estimate_by_blocks(
    model: nn.Module,
    optimizer: OptimizerArg,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    blocks: Sequence[str],
    precision: str | PrecisionSpec = "32-true",
    device: str | None = None,
    samples: tuple[int, int] = SAMPLE_BLOCKS,
) -> MemoryEstimate:
    """:func:`~resource_guard.estimate.estimator.estimate_memory` of ``model``, traced at two shallow depths.

    Args:
        model, optimizer, batch, loss_fn, precision, device: as for ``estimate_memory``.
        blocks: qualified names of the repeated blocks: every child of one ``ModuleList``/``Sequential``.
        samples: the two depths traced (``k₁ < k₂``).

    Returns:
        A :class:`BlockEstimate`, or the full trace's estimate when extrapolating would not pay
        (fewer than ``k₂ + 2`` blocks, or an optimizer instance rather than a factory).
    """
    k1, k2 = samples
    if not 0 < k1 < k2:
        raise ConfigurationError(f"`estimate_by_blocks(samples={samples!r})` must be two depths 0 < k1 < k2")
    # an optimizer instance (or a user step's list of them) holds the full model's parameters
    full = len(blocks) < k2 + 2 or isinstance(optimizer, (torch.optim.Optimizer, list, tuple))
    if full:
        return estimate_memory(model, optimizer, batch, loss_fn, precision=precision, device=device)  # type: ignore[arg-type]
    container = _container(model, blocks)
    traced = []
    for k in samples:
        with _truncated(container, k):
            traced.append(
                estimate_memory(model, optimizer, batch, loss_fn, precision=precision, device=device)  # type: ignore[arg-type]
            )
    if any(not t.traced for t in traced):  # a fallback is conservative for the full model only
        return estimate_memory(model, optimizer, batch, loss_fn, precision=precision, device=device)  # type: ignore[arg-type]
    return extrapolate(traced[0], traced[1], (k1, k2), len(blocks))
