"""Per-rank memory of data-parallel strategies (DDP, FSDP full shard, SHARD_GRAD_OP, HSDP), from one trace.

Each is derived from a single-device :class:`~resource_guard.MemoryEstimate` at the per-rank
micro-batch, phase by phase over its timeline (bytes by category after every operator), so the
activations and temporaries at each moment are the traced ones, not a rule of thumb.

**DDP** keeps a full replica per rank, plus the reducer's gradient buckets. ``bucket_cap_mb``
(default 25 MiB; the first bucket 1 MiB) only decides how gradients are grouped for the all-reduce:
together the buckets hold every trainable gradient once, allocated when DDP is constructed and kept
for the whole run. With the default ``gradient_as_bucket_view=False`` the ``.grad`` tensors are
separate, so a rank holds ``traced step + all gradient bytes``; with ``gradient_as_bucket_view=True``
the gradients are views into the buckets. DDP has no parameter policy: ``*-mixed`` is autocast over
fp32 weights, as traced.

**FSDP** (``"fsdp"``: ``FULL_SHARD`` / ``fully_shard``; ``"fsdp_grad_op"``: ``SHARD_GRAD_OP`` /
``reshard_after_forward=False``, ZeRO-2; ``"hsdp"``: ``HYBRID_SHARD`` / a 2-D mesh, sharded within a
node of ``gpus_per_node`` and replicated across nodes) shards parameters, gradients and optimizer
state; its mixed-precision policy (:mod:`~resource_guard.estimate.fsdp.sharding`) decides the dtype of the
gathered units, the reduce and the master shards. Units are the repeated blocks
(:func:`~resource_guard.planning.checkpointing.find_checkpoint_blocks`, what an auto-wrap policy
wraps) and the root (every parameter outside them). Per phase::

    rank = (master params + master grads + optimizer state) / shard group
           + traced activations, temporaries, inputs, buffers (optimizer-phase temporaries on shards)
           + gathered units (two for full shard; all of them for SHARD_GRAD_OP)
           + the largest unit's unsharded gradient in backward (and its fp32 copy for an fp32 reduce)

NCCL's communicator buffers are not counted (the headroom and the "fits tight" verdict are for them).

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.estimate import CATEGORIES
from resource_guard.estimate.allocation.allocator import rank_device_fit, rank_overhead
from resource_guard.estimate.fsdp.sharding import (
    FsdpPrecision,
    PhasePeaks,
    fsdp_precision,
    full_gradient_bytes,
    phase_peaks,
    sharded_rank_bytes,
    timeline_points,
)
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
    "overhead_envelope",
    "phase_peaks",
    "rank_memory",
    "rank_fit",
    "gpus_needed",
]

STRATEGIES = ("single", "ddp", "fsdp", "fsdp_grad_op", "hsdp")
SHARDED = {"fsdp": "full", "fsdp_grad_op": "grad_op", "hsdp": "hybrid"}
GPUS_PER_NODE = 8
DEFAULT_BUCKET_CAP_MB = 25
_INDEX = {c: i for i, c in enumerate(CATEGORIES)}


@dataclass(frozen=True)
class RankMemory:
    """Live tensor bytes on one rank.

    Attributes:
        strategy: one of :data:`STRATEGIES`.
        world_size: number of ranks.
        per_rank_bytes: peak live bytes on one rank (what ``max_memory_allocated`` would show).
        peak_phase: the phase where it peaks.
        model_state_bytes: parameters + gradients + optimizer state a rank keeps (sharded for FSDP).
        bucket_bytes: DDP gradient buckets (0 otherwise).
        unit_bytes: FSDP: the largest unit's unsharded parameter bytes (0 otherwise).
        notes: how the figure was derived (the precision policy first, for FSDP).
        precision_policy: FSDP: the mixed-precision policy assumed (``None`` otherwise).
    """

    strategy: str
    world_size: int
    per_rank_bytes: int
    peak_phase: str | None
    model_state_bytes: int
    bucket_bytes: int = 0
    unit_bytes: int = 0
    notes: tuple[str, ...] = ()
    precision_policy: FsdpPrecision | None = None


@dataclass(frozen=True)
class GpuCount:
    """Answer to "how many devices would it take": ``count`` ranks with ``strategy`` (per-rank figures)."""

    count: int
    strategy: str
    device: str
    per_rank_bytes: int
    usable_bytes: int


def unit_param_bytes(model: nn.Module, precision: str | FsdpPrecision) -> tuple[int, ...]:
    """Unsharded parameter bytes of each FSDP unit, largest first: the repeated blocks, then the root.

    ``precision``: a Lightning precision name (the parameters' dtype under it) or an FSDP policy
    (its gathered ``param_dtype``).
    """
    cast = (
        precision.param_dtype
        if isinstance(precision, FsdpPrecision)
        else parse_precision(precision).param_dtype
    )

    def nbytes(p: torch.Tensor) -> int:
        if p.is_floating_point() and cast != torch.float32:
            return p.numel() * cast.itemsize
        if p.is_floating_point():
            return p.numel() * max(p.element_size(), cast.itemsize)
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


def rank_memory(
    estimate: MemoryEstimate,
    strategy: str,
    world_size: int,
    *,
    units: Sequence[int] = (),
    gradient_as_bucket_view: bool = False,
    policy: FsdpPrecision | None = None,
    gpus_per_node: int = GPUS_PER_NODE,
    peaks: PhasePeaks | None = None,
) -> RankMemory:
    """Peak live bytes per rank of ``estimate``'s step under ``strategy`` over ``world_size`` ranks.

    Args:
        estimate: a single-device estimate at the per-rank micro-batch; for an FSDP policy that
            gathers 16-bit parameters, traced under :func:`~resource_guard.estimate.fsdp.sharding.trace_spec`.
        strategy: one of :data:`STRATEGIES`.
        world_size: number of ranks (>= 1).
        units: FSDP unit sizes in gathered bytes (:func:`unit_param_bytes`); required for FSDP.
        gradient_as_bucket_view: DDP's option of that name.
        policy: FSDP's mixed-precision policy; default: the trace's own dtypes (autocast over fp32
            parameters for ``*-mixed``).
        gpus_per_node: the shard group of ``"hsdp"``.
        peaks: :func:`phase_peaks` of ``estimate``, when already computed.
    """
    if strategy not in STRATEGIES:
        raise ConfigurationError(f"`strategy={strategy!r}` must be one of {', '.join(STRATEGIES)}")
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ConfigurationError(f"`world_size={world_size!r}` must be an int >= 1")
    b = estimate.breakdown
    grads_full = full_gradient_bytes(estimate)
    state = b.get("parameters", 0) + b.get("optimizer_state", 0)
    if strategy == "single":
        return RankMemory("single", world_size, estimate.peak_bytes, estimate.peak_phase, state + grads_full)
    if strategy == "ddp":
        best, phase = -1, None
        for ph, values in timeline_points(estimate):
            grads = values[_INDEX["gradients"]]
            total = sum(values) + (grads_full - grads if gradient_as_bucket_view else grads_full)
            if total > best:
                best, phase = total, ph
        how = "as views of the buckets" if gradient_as_bucket_view else "copied into buckets"
        notes: tuple[str, ...] = (
            f"full replica; gradients {how} ({grads_full} bytes in {DEFAULT_BUCKET_CAP_MB} MiB buckets)",
        )
        return RankMemory("ddp", world_size, best, phase, state + grads_full, grads_full, 0, notes)
    if not units:
        raise ConfigurationError(f"`rank_memory(strategy={strategy!r})` needs the unit sizes (`units=`).")
    policy = policy if policy is not None else fsdp_precision(estimate.precision, "autocast")
    sharding = SHARDED[strategy]
    group = min(world_size, gpus_per_node) if sharding == "hybrid" else world_size
    total, phase, rank_state, notes = sharded_rank_bytes(
        peaks if peaks is not None else phase_peaks(estimate), policy, units, group, sharding
    )
    largest = max(units)
    return RankMemory(strategy, world_size, total, phase, rank_state, 0, largest, notes, policy)


def overhead_envelope(overheads: dict[int, tuple[int, int]], micro: int) -> tuple[int, int]:
    """The allocator overhead used at ``micro``: the largest of those traced at micro-batches up to it.

    The caching allocator's rounding and fragmentation are not monotone in the batch (a segment more
    or less), so a plan could otherwise prefer a larger micro-batch on allocator noise; a rank never
    needs less for a larger micro-batch by this model.
    """
    below = [o for m, o in overheads.items() if m <= micro]
    if not below:
        raise ConfigurationError(f"`overhead_envelope`: no overhead traced at or below micro-batch {micro}")
    return max(o[0] for o in below), max(o[1] for o in below)


def rank_fit(
    fit: DeviceFit,
    estimate: MemoryEstimate,
    rank: RankMemory,
    *,
    overhead: tuple[int, int] | None = None,
) -> DeviceFit:
    """What a device would show for one rank of ``rank``: its own bytes plus the allocator overhead
    of the step's churn (never the whole unsharded step's). ``fit`` gives the device and headroom."""
    if rank.strategy == "single":
        return fit
    headroom = 1 - fit.usable_bytes / fit.capacity_bytes if fit.capacity_bytes else 0.0
    notes = (f"{rank.strategy} over {rank.world_size} ranks: per-rank bytes", *rank.notes)
    return rank_device_fit(
        estimate, fit.device, rank.per_rank_bytes, headroom=max(0.0, round(headroom, 6)),
        overhead=overhead, notes=notes,
    )  # fmt: skip


def gpus_needed(
    estimate: MemoryEstimate,
    device: DeviceSpec,
    *,
    units: Sequence[int],
    headroom: float = 0.1,
    max_count: int = 4096,
    policy: FsdpPrecision | None = None,
) -> GpuCount | None:
    """The smallest number of ``device`` that runs ``estimate``'s step, and how (None: no count does).

    One device if the step fits; else the smallest FSDP world size whose per-rank memory fits (DDP
    needs a full replica per rank, so it never fits where one device does not).
    """
    single = estimate.for_device(device, headroom=headroom)
    if single.fits:
        return GpuCount(1, "single", device.name, single.device_total_bytes, single.usable_bytes)

    peaks, overhead = phase_peaks(estimate), rank_overhead(estimate)

    def fits(n: int) -> DeviceFit:
        rank = rank_memory(estimate, "fsdp", n, units=units, policy=policy, peaks=peaks)
        return rank_fit(single, estimate, rank, overhead=overhead)

    if not fits(max_count).fits:
        return None
    lo, hi = 1, max_count  # fits(hi) holds, fits(lo) does not; per-rank bytes fall as n grows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid).fits else (mid, hi)
    final = fits(hi)
    return GpuCount(hi, "fsdp", device.name, final.device_total_bytes, final.usable_bytes)
