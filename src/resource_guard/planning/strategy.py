"""Per-rank memory of data-parallel strategies (DDP, FSDP full-shard), measured from one traced step.

Both are derived from a single-device :class:`~resource_guard.MemoryEstimate` at the per-rank
micro-batch, point by point over its timeline (bytes by category after every operator), so the
activations, temporaries and gradients at each moment are the traced ones, not a rule of thumb.

**DDP** keeps a full replica per rank, plus the reducer's gradient buckets. ``bucket_cap_mb``
(default 25 MiB; the first bucket 1 MiB) only decides how gradients are grouped for the all-reduce:
together the buckets hold every trainable gradient once, allocated when DDP is constructed and kept
for the whole run. With the default ``gradient_as_bucket_view=False`` the ``.grad`` tensors are
separate, so a rank holds ``traced step + all gradient bytes``; with ``gradient_as_bucket_view=True``
the gradients are views into the buckets, so a rank holds the traced step with the gradients counted
in full at every moment (``traced - gradients live + all gradient bytes``).

**FSDP full shard** (``FULL_SHARD`` / ``fully_shard``) over ``N`` ranks keeps ``1/N`` of the
parameters, gradients and optimizer state; buffers are replicated. A unit's parameters are
all-gathered for its forward and again for its backward, and freed after: at any time the two largest
units may be unsharded (the running one and the prefetched one), and in the backward the running
unit's full gradient exists until it is reduce-scattered. Units are the repeated blocks
(:func:`~resource_guard.planning.checkpointing.find_checkpoint_blocks`, what an auto-wrap policy wraps)
and the root (every parameter outside them: embeddings, head). Per point of the timeline::

    rank = (parameters + optimizer_state + gradients) / N + buffers + activations + inputs
           + temporaries (÷ N in the optimizer phase, which runs on shards)
           + two largest units' parameters (forward, backward) + largest unit's gradient (backward)

Unit bytes use the parameters' dtype under the precision (fp32 for ``*-mixed``): FSDP mixed precision
would gather in 16 bits, so this is conservative. NCCL's communicator buffers are not counted (the
planner's headroom is for them).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from resource_guard.estimate import estimate_memory
    >>> model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    >>> est = estimate_memory(model, torch.optim.AdamW, torch.randn(8, 256), lambda m, b: m(b).sum())
    >>> units = unit_param_bytes(model, "32-true")
    >>> fsdp = rank_memory(est, "fsdp", 4, units=units)
    >>> ddp = rank_memory(est, "ddp", 4)
    >>> fsdp.per_rank_bytes < est.peak_bytes < ddp.per_rank_bytes
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.estimate import CATEGORIES
from resource_guard.planning.checkpointing import find_checkpoint_blocks
from resource_guard.step.precision import parse_precision

if TYPE_CHECKING:
    from resource_guard.devices import DeviceSpec
    from resource_guard.estimate import DeviceFit, MemoryEstimate

__all__ = [
    "STRATEGIES",
    "DEFAULT_BUCKET_CAP_MB",
    "RankMemory",
    "GpuCount",
    "unit_param_bytes",
    "rank_memory",
    "rank_fit",
    "gpus_needed",
]

STRATEGIES = ("single", "ddp", "fsdp")
DEFAULT_BUCKET_CAP_MB = 25
_INDEX = {c: i for i, c in enumerate(CATEGORIES)}


@dataclass(frozen=True)
class RankMemory:
    """Live tensor bytes on one rank.

    Attributes:
        strategy: ``"single"``, ``"ddp"`` or ``"fsdp"``.
        world_size: number of ranks.
        per_rank_bytes: peak live bytes on one rank (what ``max_memory_allocated`` would show).
        peak_phase: the phase where it peaks.
        model_state_bytes: parameters + gradients + optimizer state a rank keeps (sharded for FSDP).
        bucket_bytes: DDP gradient buckets (0 otherwise).
        unit_bytes: FSDP: the largest unit's unsharded parameter bytes (0 otherwise).
        notes: how the figure was derived.
    """

    strategy: str
    world_size: int
    per_rank_bytes: int
    peak_phase: str | None
    model_state_bytes: int
    bucket_bytes: int = 0
    unit_bytes: int = 0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuCount:
    """Answer to "how many devices would it take": ``count`` ranks with ``strategy`` (per-rank figures)."""

    count: int
    strategy: str
    device: str
    per_rank_bytes: int
    usable_bytes: int


def unit_param_bytes(model: nn.Module, precision: str) -> tuple[int, ...]:
    """Unsharded parameter bytes of each FSDP unit, largest first: the repeated blocks, then the root."""
    spec = parse_precision(precision)

    def nbytes(p: torch.Tensor) -> int:
        if p.is_floating_point() and spec.param_dtype != torch.float32:
            return p.numel() * spec.param_dtype.itemsize
        return p.numel() * p.element_size()

    blocks = find_checkpoint_blocks(model)
    seen: set[int] = set()
    units: list[int] = []
    for name in blocks:
        size = 0
        for p in model.get_submodule(name).parameters():
            if id(p) not in seen:
                seen.add(id(p))
                size += nbytes(p)
        units.append(size)
    root = sum(nbytes(p) for p in {id(p): p for p in model.parameters()}.values() if id(p) not in seen)
    units.append(root)
    return tuple(sorted((u for u in units if u > 0), reverse=True)) or (0,)


def _points(estimate: MemoryEstimate) -> list[tuple[str, Sequence[int]]]:
    peak = tuple(estimate.breakdown.get(c, 0) for c in CATEGORIES)
    points: list[tuple[str, Sequence[int]]] = [(estimate.peak_phase or "forward", peak)]
    points.extend((phase.split(":")[0], values) for phase, values in estimate.timeline)
    return points


def _full_gradient_bytes(estimate: MemoryEstimate) -> int:
    """Bytes of every trainable gradient: the traced parameter bytes scaled by the trainable fraction."""
    if estimate.parameter_count == 0:
        return 0
    share = estimate.trainable_parameter_count / estimate.parameter_count
    return int(estimate.breakdown.get("parameters", 0) * share)


def rank_memory(
    estimate: MemoryEstimate,
    strategy: str,
    world_size: int,
    *,
    units: Sequence[int] = (),
    gradient_as_bucket_view: bool = False,
) -> RankMemory:
    """Peak live bytes per rank of ``estimate``'s step under ``strategy`` over ``world_size`` ranks.

    Args:
        estimate: a single-device estimate at the per-rank micro-batch.
        strategy: ``"single"``, ``"ddp"`` or ``"fsdp"``.
        world_size: number of ranks (>= 1).
        units: FSDP unit sizes in bytes (:func:`unit_param_bytes`); required for ``"fsdp"``.
        gradient_as_bucket_view: DDP's option of that name.
    """
    if strategy not in STRATEGIES:
        raise ConfigurationError(f"`strategy={strategy!r}` must be one of {', '.join(STRATEGIES)}")
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ConfigurationError(f"`world_size={world_size!r}` must be an int >= 1")
    b = estimate.breakdown
    grads_full = _full_gradient_bytes(estimate)
    state = b.get("parameters", 0) + b.get("optimizer_state", 0)
    if strategy == "single":
        return RankMemory("single", world_size, estimate.peak_bytes, estimate.peak_phase, state + grads_full)
    if strategy == "ddp":
        best, phase = -1, None
        for ph, values in _points(estimate):
            grads = values[_INDEX["gradients"]]
            total = sum(values) + (grads_full - grads if gradient_as_bucket_view else grads_full)
            if total > best:
                best, phase = total, ph
        how = "as views of the buckets" if gradient_as_bucket_view else "copied into buckets"
        notes = (
            f"full replica; gradients {how} ({grads_full} bytes in {DEFAULT_BUCKET_CAP_MB} MiB buckets)",
        )
        return RankMemory("ddp", world_size, best, phase, state + grads_full, grads_full, 0, notes)
    if not units:
        raise ConfigurationError("`rank_memory(strategy='fsdp')` needs the unit sizes (`units=`).")
    ranked = sorted(units, reverse=True)
    gathered = ranked[0] + (ranked[1] if len(ranked) > 1 else 0)
    n = world_size
    best, phase = -1, None
    for ph, v in _points(estimate):
        sharded = (v[_INDEX["parameters"]] + v[_INDEX["optimizer_state"]] + v[_INDEX["gradients"]]) / n
        temporaries = v[_INDEX["temporaries"]] / (n if ph == "optimizer" else 1)
        transient = v[_INDEX["activations"]] + v[_INDEX["inputs"]] + v[_INDEX["other"]] + temporaries
        unsharded = gathered if ph in ("forward", "backward") else 0
        unsharded += ranked[0] if ph == "backward" else 0
        total = int(sharded + transient + (unsharded if n > 1 else 0))
        if total > best:
            best, phase = total, ph
    notes = (f"{len(ranked)} units, largest {ranked[0]} bytes unsharded; 2 units gathered at a time",)
    return RankMemory("fsdp", n, best, phase, (state + grads_full) // n, 0, ranked[0], notes)


def rank_fit(fit: DeviceFit, estimate: MemoryEstimate, rank: RankMemory) -> DeviceFit:
    """``fit`` (the single-device figures of ``estimate``) shifted to the per-rank bytes of ``rank``."""
    delta = rank.per_rank_bytes - estimate.peak_bytes
    total = fit.device_total_bytes + delta
    return dataclasses.replace(
        fit,
        allocated_peak_bytes=fit.allocated_peak_bytes + delta,
        reserved_peak_bytes=fit.reserved_peak_bytes + delta,
        device_total_bytes=total,
        fits=total <= fit.usable_bytes,
        headroom_bytes=fit.capacity_bytes - total,
        notes=(*fit.notes, f"{rank.strategy} over {rank.world_size} ranks: per-rank bytes", *rank.notes),
    )


def gpus_needed(
    estimate: MemoryEstimate,
    device: DeviceSpec,
    *,
    units: Sequence[int],
    headroom: float = 0.1,
    max_count: int = 4096,
) -> GpuCount | None:
    """The smallest number of ``device`` that runs ``estimate``'s step, and how (None: no count does).

    One device if the step fits; else the smallest FSDP world size whose per-rank memory fits (DDP
    needs a full replica per rank, so it never fits where one device does not).
    """
    single = estimate.for_device(device, headroom=headroom)
    if single.fits:
        return GpuCount(1, "single", device.name, single.device_total_bytes, single.usable_bytes)

    def fits(n: int) -> DeviceFit:
        return rank_fit(single, estimate, rank_memory(estimate, "fsdp", n, units=units))

    if not fits(max_count).fits:
        return None
    lo, hi = 1, max_count  # fits(hi) holds, fits(lo) does not; per-rank bytes fall as n grows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid).fits else (mid, hi)
    final = fits(hi)
    return GpuCount(hi, "fsdp", device.name, final.device_total_bytes, final.usable_bytes)
