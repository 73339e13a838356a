"""The report's rules about memory over time: ``memory-growth`` and ``fragmentation``.

- memory-growth: allocated memory at step ends, at equal batch shapes, rises steadily
  (:class:`~resource_guard.observe.growth.MemoryTrend`): a straight line explains the readings
  (R² >= ``GROWTH_MIN_R_SQUARED``), most consecutive readings go up (>= ``GROWTH_MIN_RISING_SHARE``), and
  the rise is at least ``GROWTH_MIN_BYTES`` and ``GROWTH_MIN_FRACTION`` of the first reading. Critical
  when, at that rate, the capacity is reached within as many steps again as the run has watched.
- fragmentation (CUDA): the caching allocator had to free its cache and retry a ``cudaMalloc``
  (``num_alloc_retries`` > 0: a warning, each retry is a synchronising stall at the edge of an OOM), or
  it kept at least ``FRAGMENTATION_GAP_FRACTION`` of what it reserved unallocated while the reserved
  memory was at least ``FRAGMENTATION_MIN_RESERVED_FRACTION`` of the capacity (info).

Both are in :data:`resource_guard.report.rules.RULES`.

Example:
    >>> from resource_guard.report.types import RunStats
    >>> rule_fragmentation(RunStats(device_kind="cuda", alloc_retries=3, reserved_bytes=2**30)).id
    'fragmentation'
"""

from __future__ import annotations

from typing import Any

from resource_guard.devices import format_bytes
from resource_guard.report.types import Finding, RunStats

__all__ = [
    "GROWTH_MIN_R_SQUARED",
    "GROWTH_MIN_RISING_SHARE",
    "GROWTH_MIN_BYTES",
    "GROWTH_MIN_FRACTION",
    "FRAGMENTATION_GAP_FRACTION",
    "FRAGMENTATION_MIN_RESERVED_FRACTION",
    "rule_memory_growth",
    "rule_fragmentation",
]

GROWTH_MIN_R_SQUARED = 0.8
GROWTH_MIN_RISING_SHARE = 0.6
GROWTH_MIN_BYTES = 4 * 2**20
GROWTH_MIN_FRACTION = 0.02
FRAGMENTATION_GAP_FRACTION = 0.25
FRAGMENTATION_MIN_RESERVED_FRACTION = 0.5

_SOURCES = {
    "cuda_allocated": "torch.cuda.memory_allocated",
    "cpu_malloc_in_use": "the process's malloc bytes in use (glibc mallinfo2)",
    "rss": "the process's resident set size",
}


def rule_memory_growth(s: RunStats) -> Finding | None:
    """Allocated memory at step ends rises steadily at the same batch shapes: something is kept."""
    g = s.memory_growth
    if not g:
        return None
    slope, rise, first = g.get("bytes_per_step") or 0.0, g.get("rise_bytes") or 0, g.get("first_bytes") or 0
    if slope <= 0 or rise < GROWTH_MIN_BYTES or rise < GROWTH_MIN_FRACTION * first:
        return None
    if (g.get("r_squared") or 0.0) < GROWTH_MIN_R_SQUARED:
        return None
    if (g.get("rising_share") or 0.0) < GROWTH_MIN_RISING_SHARE:
        return None
    evidence: dict[str, Any] = dict(g)
    evidence["measured_as"] = _SOURCES.get(str(g.get("source")), g.get("source"))
    severity = "warning"
    capacity = s.measured_capacity_bytes
    if capacity and g.get("last_bytes") is not None:
        left = (capacity - g["last_bytes"]) / slope
        evidence["steps_to_capacity"] = max(0, int(left))
        evidence["capacity_bytes"] = capacity
        if left <= max(1, g.get("steps") or 0):
            severity = "critical"
    advice = (
        "A loss or output kept with its graph: log and accumulate `loss.item()` (or `loss.detach()`), "
        "never the loss tensor itself (`total += loss` keeps every step's graph).",
        "A list of tensors that grows every step (outputs, predictions, attention maps kept for a "
        "metric): append `t.detach().cpu()` or reduce them as you go, and clear the list each epoch.",
        "Tensors cached on the module or in a closure across steps (e.g. hidden states of an RNN not "
        "detached between batches); `torch.cuda.memory._record_memory_history()` and a snapshot "
        "(memory_history=True) show what each step leaves behind.",
    )
    per_step = format_bytes(int(slope))
    title = (
        f"Memory growth: +{per_step} per step at the same batch shapes over {g.get('steps')} steps "
        f"(+{format_bytes(int(rise))} in all)"
    )
    return Finding("memory-growth", severity, title, evidence, advice)


def rule_fragmentation(s: RunStats) -> Finding | None:
    """The CUDA caching allocator retried allocations, or holds much reserved memory unallocated."""
    if s.device_kind != "cuda":
        return None
    retries = s.alloc_retries or 0
    reserved, gap = s.reserved_bytes, s.reserved_gap_bytes
    share = gap / reserved if reserved and gap is not None else None
    tight = bool(
        reserved and s.capacity_bytes and reserved >= FRAGMENTATION_MIN_RESERVED_FRACTION * s.capacity_bytes
    )
    wide = share is not None and share >= FRAGMENTATION_GAP_FRACTION and tight
    if retries <= 0 and not wide:
        return None
    advice = []
    if not s.expandable_segments:
        advice.append(
            "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment before the process "
            "starts (before its first CUDA allocation): segments then grow in place instead of being "
            "split, so freed blocks of one size can serve requests of another."
        )
    else:
        advice.append(
            "expandable_segments is on already: add garbage_collection_threshold:0.8 to "
            "PYTORCH_CUDA_ALLOC_CONF so cached blocks are released before an allocation has to retry."
        )
    advice += [
        "Keep batch shapes steady (pad to a few bucket lengths): every new shape leaves free blocks of "
        "sizes the next step cannot use.",
        "Leave more headroom: a smaller micro-batch with gradient accumulation, or a larger `headroom=`.",
    ]
    evidence = {
        "alloc_retries": retries,
        "reserved_bytes": reserved,
        "reserved_gap_bytes": gap,
        "gap_share_of_reserved": None if share is None else round(share, 4),
        "capacity_bytes": s.capacity_bytes,
        "expandable_segments": s.expandable_segments,
    }
    if retries > 0:
        title = f"Fragmentation: the CUDA allocator freed its cache and retried {retries} allocation(s)"
    else:
        assert share is not None and gap is not None  # wide implies both
        title = f"Fragmentation: {share:.0%} of reserved memory ({format_bytes(gap)}) is not allocated"
    return Finding("fragmentation", "warning" if retries > 0 else "info", title, evidence, tuple(advice))
