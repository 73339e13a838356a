"""What a device would show for an estimated step: the CUDA caching allocator's effect, context, fit.

The estimate counts live tensor bytes. On a CUDA device, PyTorch's caching allocator
(``c10/cuda/CUDACachingAllocator.cpp``) rounds and pools them; this module replays the step's
allocation events through a model of it. Constants and their sources:

- ``_MIN_BLOCK = 512``: every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``).
- ``_SMALL_SIZE = 1 MiB``: requests up to 1 MiB come from the small pool (``kSmallSize``), carved from
  2 MiB segments (``_SMALL_SEGMENT``, ``kSmallBuffer``).
- Larger requests under 10 MiB (``kMinLargeAlloc``) are carved from 20 MiB segments (``kLargeBuffer``);
  from 10 MiB up a segment of the request rounded to 2 MiB (``kRoundLarge``) is allocated.
- A free block is split when the remainder is ≥ 512 bytes (small pool) or > 1 MiB (large pool);
  freed neighbours merge; a request takes the best-fitting free block of its pool.
- CUDA context (``CUDA_CONTEXT_BYTES``, 450 MiB): what a process holds outside the caching allocator
  (driver state, the kernels loaded). With lazy module loading, PyTorch's default since 1.13 / CUDA
  11.7 (pytorch/pytorch#86509), published figures are 287 MB (#86509's own measurement), "around
  400MB" (PyTorch's CUDA maintainer in pytorch/pytorch#109888) and 426 MiB (PyTorch 2.10 + CUDA 13.0
  on an RTX 6000 Ada, nvidia-smi, unslothai/unsloth-zoo#1053); 450 MiB is at the top of that range.
  Eager loading (``CUDA_MODULE_LOADING=EAGER``, or torch < 1.13) loads every kernel up front: 667 MB
  in #86509, 1343 MiB on a V100 with torch 1.10 (Hugging Face's "Efficient training on a single GPU",
  used by ``benchmarks/public_gpu.py``); that is not what this figure stands for.
- A later step with the gradients kept (``gradients_kept=True``: micro-steps 2..k of gradient
  accumulation, or a loop that zeroes instead of freeing them, ``zero_grad(set_to_none=False)``, the
  default before torch 2.0): the traced step starts without gradients and frees them at its end; a
  later one starts with them allocated, and backward computes each new gradient into a temporary
  that autograd adds into the old one (``AccumulateGrad``: ``variable_grad += new_grad``) and frees.
  :func:`~resource_guard.estimate.allocation.later_step.later_step` rewrites the step's events so: the
  storages
  born in the step and alive when its trailing frees begin (its gradients) become initial
  allocations, their births a birth and free.
- Per rank (:func:`rank_overhead`, :func:`rank_device_fit`): a sharded rank's persistent state is a
  few exact-size blocks allocated once, so the allocator's overhead is that of the step's own churn
  (activations, temporaries, gradients as they come and go), replayed without the persistent
  allocations; it never grows with the number of ranks.
- Verdict (:attr:`DeviceFit.verdict`): ``"fits"`` within ``capacity × (1 − headroom)``; ``"fits tight"``
  above that but within capacity (fragmentation beyond the model, other processes on the GPU, NCCL
  buffers or a longer sample could push it over); ``"does not fit"`` above capacity.
- cuBLAS workspace: PyTorch's default ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:2:16:8`` (8.125 MiB)
  before Hopper and ``:4096:8`` (32 MiB) on compute capability ≥ 9.0, plus a 1 MiB cuBLASLt workspace
  (``TORCH_CUBLASLT_WORKSPACE_SIZE``); they are allocated through the caching allocator and kept.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from resource_guard.devices import DeviceSpec, resolve_device
from resource_guard.errors import ConfigurationError
from resource_guard.estimate.allocation.later_step import later_peak_from_timeline, later_step, running_peak

__all__ = [
    "AllocatorPeaks",
    "CUDA_CONTEXT_BYTES",
    "DeviceFit",
    "FITS",
    "FITS_TIGHT",
    "DOES_NOT_FIT",
    "StepMemory",
    "device_fit",
    "rank_device_fit",
    "rank_overhead",
    "simulate_caching_allocator",
]

MiB = 2**20
_MIN_BLOCK = 512
_SMALL_SIZE = 1 * MiB
_SMALL_SEGMENT = 2 * MiB
_LARGE_SEGMENT = 20 * MiB
_MIN_LARGE_ALLOC = 10 * MiB
_ROUND_LARGE = 2 * MiB
CUDA_CONTEXT_BYTES = 450 * MiB
FITS, FITS_TIGHT, DOES_NOT_FIT = "fits", "fits tight", "does not fit"


def _cublas_workspace_bytes(compute_capability: str | None) -> int:
    major = int(compute_capability.split(".")[0]) if compute_capability else 8
    cublas = 32 * MiB if major >= 9 else 2 * 4096 * 1024 + 8 * 16 * 1024
    return cublas + 1 * MiB


@dataclass(frozen=True)
class AllocatorPeaks:
    """Peaks of the caching allocator model.

    ``allocated``: rounded live blocks; ``reserved``: segments.
    """

    allocated_peak_bytes: int
    reserved_peak_bytes: int
    segments: int


class _Block:
    __slots__ = ("size", "offset", "segment", "free", "prev", "next", "small")

    def __init__(self, size: int, offset: int, segment: int, small: bool) -> None:
        self.size, self.offset, self.segment, self.small = size, offset, segment, small
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


def _round(size: int) -> int:
    return max(_MIN_BLOCK, (size + _MIN_BLOCK - 1) // _MIN_BLOCK * _MIN_BLOCK)


def simulate_caching_allocator(events: Any, initial: Any = ()) -> AllocatorPeaks:
    """Replay ``(id, +bytes | -bytes)`` events through the caching-allocator model.

    ``initial`` holds ``(id, bytes)`` of allocations alive before the events (parameters, state, ...).

    Example:
        >>> simulate_caching_allocator([(0, 100), (1, 3 * 2**20), (0, -100)]).reserved_peak_bytes
        23068672
    """
    pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # sorted free-block keys
    by_key: dict[tuple[int, int, int], _Block] = {}
    live: dict[int, _Block] = {}
    state = {"allocated": 0, "reserved": 0, "segments": 0, "peak_alloc": 0, "peak_res": 0}

    def add_free(b: _Block) -> None:
        b.free = True
        k = b.key()
        by_key[k] = b
        bisect.insort(pools[b.small], k)

    def take_free(b: _Block) -> None:
        k = b.key()
        pool = pools[b.small]
        pool.pop(bisect.bisect_left(pool, k))
        del by_key[k]
        b.free = False

    def malloc(uid: int, size: int) -> None:
        size = _round(size)
        small = size <= _SMALL_SIZE
        pool = pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            block = by_key[pool[i]]
            take_free(block)
        else:
            if small:
                seg_size = _SMALL_SEGMENT
            elif size < _MIN_LARGE_ALLOC:
                seg_size = _LARGE_SEGMENT
            else:
                seg_size = (size + _ROUND_LARGE - 1) // _ROUND_LARGE * _ROUND_LARGE
            state["segments"] += 1
            state["reserved"] += seg_size
            block = _Block(seg_size, 0, state["segments"], small)
            block.free = False
        remaining = block.size - size
        if (small and remaining >= _MIN_BLOCK) or (not small and remaining > _SMALL_SIZE):
            rest = _Block(remaining, block.offset + size, block.segment, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            add_free(rest)
        live[uid] = block
        state["allocated"] += block.size
        state["peak_alloc"] = max(state["peak_alloc"], state["allocated"])
        state["peak_res"] = max(state["peak_res"], state["reserved"])

    def free(uid: int) -> None:
        block = live.pop(uid, None)
        if block is None:
            return
        state["allocated"] -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                take_free(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        add_free(block)

    for uid, size in initial:
        malloc(uid, size)
    for uid, delta in events:
        if delta > 0:
            if uid in live:  # a resize: the storage grew
                size = live[uid].size + delta
                free(uid)
                malloc(uid, size)
            else:
                malloc(uid, delta)
        else:
            free(uid)
    return AllocatorPeaks(state["peak_alloc"], state["peak_res"], state["segments"])


@dataclass(frozen=True)
class DeviceFit:
    """Whether one training step fits a device, and what the device would show.

    Attributes:
        device: the device the figures are for.
        capacity_bytes: the device's memory (or, for a detected device, what is free).
        allocated_peak_bytes: what ``torch.cuda.max_memory_allocated`` would report.
        reserved_peak_bytes: what ``torch.cuda.max_memory_reserved`` would report.
        context_bytes: CUDA context and libraries (0 off CUDA).
        workspace_bytes: cuBLAS/cuBLASLt workspaces (included in allocated and reserved).
        device_total_bytes: the device-level total, as nvidia-smi would show it.
        usable_bytes: ``capacity_bytes × (1 − headroom)``.
        fits: ``device_total_bytes ≤ usable_bytes`` (fits with the headroom kept free).
        headroom_bytes: ``capacity_bytes − device_total_bytes`` (negative when it does not fit).
        notes: how the figures were derived.

    :attr:`verdict` has three states: ``"fits"`` (``fits``), ``"fits tight"`` (inside the headroom, at
    most the capacity: :attr:`tight_risks` says what could push it over) and ``"does not fit"``.
    """

    device: DeviceSpec
    capacity_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    context_bytes: int
    workspace_bytes: int
    device_total_bytes: int
    usable_bytes: int
    fits: bool
    headroom_bytes: int
    notes: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        """``"fits"``, ``"fits tight"`` (above the headroom line, within capacity) or ``"does not fit"``."""
        if self.device_total_bytes <= self.usable_bytes:
            return FITS
        return FITS_TIGHT if self.device_total_bytes <= self.capacity_bytes else DOES_NOT_FIT

    @property
    def tight_risks(self) -> tuple[str, ...]:
        """For a tight fit: what could push it over (empty otherwise)."""
        if self.verdict != FITS_TIGHT:
            return ()
        margin = self.capacity_bytes - self.device_total_bytes
        return (
            f"only {margin / MiB:,.0f} MiB ({margin / max(self.capacity_bytes, 1):.1%}) below capacity",
            "fragmentation beyond the allocator model (try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)",
            "other processes on the GPU, NCCL communicator buffers, a longer sample than the one traced",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.name,
            "capacity_bytes": self.capacity_bytes,
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "context_bytes": self.context_bytes,
            "workspace_bytes": self.workspace_bytes,
            "device_total_bytes": self.device_total_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "verdict": self.verdict,
            "headroom_bytes": self.headroom_bytes,
            "notes": list(self.notes),
        }


class StepMemory(Protocol):
    """What :func:`device_fit` reads of an estimate (a :class:`~resource_guard.MemoryEstimate`)."""

    @property
    def peak_bytes(self) -> int: ...
    @property
    def device_kind(self) -> str: ...
    @property
    def phase_peak_bytes(self) -> Mapping[str, int]: ...
    @property
    def allocations(self) -> Sequence[tuple[int, int]]: ...
    @property
    def initial_allocations(self) -> Sequence[tuple[int, int]]: ...


def device_fit(
    estimate: StepMemory,
    device: str | DeviceSpec = "auto",
    *,
    headroom: float = 0.1,
    catalog: Any = None,
    gradients_kept: bool = False,
) -> DeviceFit:
    """Figures of ``estimate`` on ``device`` (a catalog name, ``"auto"``, ``"cpu"``, ``"cuda:N"``).

    ``gradients_kept``: the figures of a later step that starts with the gradients allocated
    (gradient accumulation's micro-steps 2..k; ``zero_grad(set_to_none=False)``); see
    :func:`~resource_guard.estimate.allocation.later_step.later_step`.
    """
    if not 0 <= headroom < 0.9:
        raise ConfigurationError(f"`for_device(headroom={headroom!r})` must be in [0, 0.9)")
    spec = resolve_device(device, catalog) if isinstance(device, str) else device
    notes: list[str] = []
    events, initial = estimate.allocations, estimate.initial_allocations
    traced_peak = estimate.peak_bytes
    if gradients_kept:
        # an extrapolated estimate's events are its shallow sample's: its timeline stands for the model
        if events and getattr(estimate, "allocator_overhead", None) is None:
            grads = getattr(estimate, "gradient_allocations", ())
            sparse = dict(getattr(estimate, "sparse_gradient_allocations", ()))
            later_initial, later_events = later_step(events, initial, grads, sparse)
            if sparse:
                notes.append(
                    "sparse gradients grow with each micro-step (old and new rows concatenated): the "
                    "second micro-step's figures; the k-th holds k times the rows"
                )
            traced_peak += running_peak(later_initial, later_events) - running_peak(initial, events)
            events, initial = later_events, later_initial
        else:
            traced_peak = later_peak_from_timeline(estimate)
        notes.append("a later step: the gradients allocated from its start (accumulation, zeroed gradients)")
    peak = traced_peak
    gpu_kind = spec.kind in ("cuda", "rocm")
    if gpu_kind != (estimate.device_kind in ("cuda", "rocm")):
        path = "optimizer:foreach" if gpu_kind else "optimizer:for-loop"
        if path in estimate.phase_peak_bytes:
            others = [v for k, v in estimate.phase_peak_bytes.items() if not k.startswith("optimizer")]
            peak = max([estimate.phase_peak_bytes[path], *others]) + traced_peak - estimate.peak_bytes
            notes.append(
                f"estimated for {estimate.device_kind}; the {path.split(':')[1]} optimizer path used here"
            )
    capacity = spec.free_bytes if spec.free_bytes is not None else spec.memory_bytes
    own = getattr(estimate, "allocator_overhead", None)
    if gpu_kind and own is not None:  # extrapolated: the churn's overhead, scaled with the blocks
        workspace = _cublas_workspace_bytes(spec.compute_capability)
        allocated = peak + own[0] + workspace
        reserved = allocated + own[1]
        context = CUDA_CONTEXT_BYTES
        total = reserved + context
        notes.append("caching allocator: the rounding and fragmentation of the sampled blocks, extrapolated")
    elif gpu_kind:
        workspace = _cublas_workspace_bytes(spec.compute_capability)
        sim = simulate_caching_allocator(events, initial)
        rounding = sim.allocated_peak_bytes - traced_peak
        allocated = peak + max(rounding, 0) + workspace
        reserved = max(sim.reserved_peak_bytes + (peak - traced_peak), allocated)
        context = CUDA_CONTEXT_BYTES
        total = reserved + context
        notes.append("caching allocator modelled: 512 B rounding, 2/20 MiB segments, ≥10 MiB exact blocks")
    else:
        allocated = reserved = peak
        workspace = context = 0
        total = peak
        if spec.kind == "mps" or spec.unified_memory:
            notes.append("unified memory: the step shares capacity with the system")
    return _fit(spec, capacity, headroom, allocated, reserved, context, workspace, total, notes)


def _churn(events: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The forward/backward churn of a step's events: what is born and dies before the gradients are
    complete, without the storages that live to the step's end (the gradients, freed by ``zero_grad``
    in the trailing run of frees, or never) and without what follows the last gradient's birth."""
    end = len(events)
    while end > 0 and events[end - 1][1] < 0:
        end -= 1
    born = {uid for uid, delta in events if delta > 0}
    freed_early = {uid for uid, delta in events[:end] if delta < 0}
    kept = {uid for uid in born if uid not in freed_early}  # alive at the end of the step's work
    last = max((i for i, (uid, delta) in enumerate(events) if delta > 0 and uid in kept), default=end - 1)
    return [(uid, delta) for uid, delta in events[: last + 1] if uid in born and uid not in kept]


def rank_overhead(estimate: StepMemory) -> tuple[int, int]:
    """``(rounding, fragmentation)`` bytes the caching allocator adds to one rank's own churn.

    A rank's persistent state (parameter, gradient and optimizer-state shards, gathered units of a
    fixed size) is a few exact blocks reused step after step; what fragments is the forward/backward
    churn of activations and temporaries (:func:`_churn` of the step's events), which a rank runs in
    full whatever the world size. It is replayed alone: rounding is its rounded peak over its live
    peak, fragmentation its reserved peak over its rounded peak. An estimate that carries its own
    ``allocator_overhead`` (extrapolated from shallow traces) gives it.
    """
    own = getattr(estimate, "allocator_overhead", None)
    if own is not None:
        return int(own[0]), int(own[1])
    churn = _churn(estimate.allocations)
    running = live_peak = 0
    for _, delta in churn:
        running += delta
        live_peak = max(live_peak, running)
    sim = simulate_caching_allocator(churn)
    rounding = max(sim.allocated_peak_bytes - live_peak, 0)
    return rounding, max(sim.reserved_peak_bytes - sim.allocated_peak_bytes, 0)


def rank_device_fit(
    estimate: StepMemory,
    device: DeviceSpec,
    rank_bytes: int,
    *,
    headroom: float = 0.1,
    overhead: tuple[int, int] | None = None,
    notes: tuple[str, ...] = (),
) -> DeviceFit:
    """What one rank of a multi-device run would show: its own live bytes plus the allocator's
    overhead of the step's churn (:func:`rank_overhead`), workspace and context.

    ``rank_bytes`` is the rank's peak of live tensor bytes; ``overhead`` a precomputed
    :func:`rank_overhead` of ``estimate``.
    """
    if not 0 <= headroom < 0.9:
        raise ConfigurationError(f"`rank_device_fit(headroom={headroom!r})` must be in [0, 0.9)")
    capacity = device.free_bytes if device.free_bytes is not None else device.memory_bytes
    out = list(notes)
    if device.kind in ("cuda", "rocm"):
        rounding, frag = overhead if overhead is not None else rank_overhead(estimate)
        workspace = _cublas_workspace_bytes(device.compute_capability)
        allocated = rank_bytes + rounding + workspace
        reserved = allocated + frag
        context = CUDA_CONTEXT_BYTES
        out.append(
            f"per-rank allocator: {rounding / MiB:,.1f} MiB rounding and {frag / MiB:,.1f} MiB fragmentation "
            "of the step's own churn"
        )
    else:
        allocated = reserved = rank_bytes
        workspace = context = 0
    total = reserved + context
    return _fit(device, capacity, headroom, allocated, reserved, context, workspace, total, out)


def _fit(
    device: DeviceSpec,
    capacity: float,
    headroom: float,
    allocated: float,
    reserved: float,
    context: float,
    workspace: float,
    total: float,
    notes: Sequence[str],
) -> DeviceFit:
    """The :class:`DeviceFit` of a step's figures on ``device`` with ``headroom`` kept free."""
    usable = int(capacity * (1 - headroom))
    return DeviceFit(
        device=device,
        capacity_bytes=int(capacity),
        allocated_peak_bytes=int(allocated),
        reserved_peak_bytes=int(reserved),
        context_bytes=int(context),
        workspace_bytes=int(workspace),
        device_total_bytes=int(total),
        usable_bytes=usable,
        fits=total <= usable,
        headroom_bytes=int(capacity - total),
        notes=tuple(notes),
    )
