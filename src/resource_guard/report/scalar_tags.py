"""The TensorBoard scalar tags of the monitor: few, ordered by importance, named with their units.

TensorBoard's Time Series tab groups cards by a tag's first path component (``resource_guard``) and
orders the cards of a group by their tag (numbers compared as numbers), so each tag's second component
is a numbered section: ``1_step`` (the step time), ``2_phase_pct`` (each phase's share of the step),
``3_phase_ms`` (each phase in ms per step), ``4_memory`` (MiB), ``5_throughput``, ``6_util`` (%),
``7_gpu`` (the GPU's gauges), ``8_host``. A tag is written only where its figure exists on this device
(no ``gpu`` tags on a CPU run) and a phase only once it took :data:`MIN_PHASE_SHARE` of the step (the
remainder ``other`` and a loop's few microseconds between steps are no card of their own).

The monitor's interval row keeps its own keys (:data:`~resource_guard.observe.stats.METRIC_KEYS`, in
seconds and bytes, what the report is computed from); :func:`scalar_values` maps a row to these tags.

Example:
    >>> tags = scalar_values({"time/step_s": 0.25, "memory/peak_bytes": 2**21}, cuda=False)
    >>> tags["1_step/time_ms"], tags["4_memory/rss_peak_mib"]
    (250.0, 2.0)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

__all__ = [
    "MEMORY_TAGS",
    "MIN_PHASE_SHARE",
    "PHASE_MS",
    "PHASE_PCT",
    "STEP_MS",
    "LEGACY_TAGS",
    "phase_values",
    "scalar_values",
]

MiB = float(2**20)
STEP_MS = "1_step/time_ms"
PHASE_PCT = "2_phase_pct/"  # + the phase's name
PHASE_MS = "3_phase_ms/"  # + the phase's name
MIN_PHASE_SHARE = 0.005  # a phase gets its scalars from the first interval it took 0.5% of the step in

# interval-row key -> (tag on a CUDA run, tag on a CPU run, scale); None: not written there. The CUDA
# figures (allocator, NVML, events) are NaN on a CPU run: not written either
_ROW_TAGS: dict[str, tuple[str | None, str | None, float]] = {
    "time/step_s": (STEP_MS, STEP_MS, 1e3),
    "time/device_compute_s": ("1_step/device_compute_ms", "1_step/device_compute_ms", 1e3),
    "memory/peak_bytes": ("4_memory/allocated_peak_mib", "4_memory/rss_peak_mib", 1 / MiB),
    "memory/allocated_bytes": ("4_memory/allocated_mib", "4_memory/heap_in_use_mib", 1 / MiB),
    "memory/reserved_bytes": ("4_memory/reserved_mib", "4_memory/reserved_mib", 1 / MiB),
    "memory/reserved_gap_bytes": ("4_memory/reserved_gap_mib", "4_memory/reserved_gap_mib", 1 / MiB),
    "memory/alloc_retries": ("4_memory/alloc_retries", "4_memory/alloc_retries", 1.0),
    "memory/estimate_error": ("4_memory/estimate_error_pct", "4_memory/estimate_error_pct", 100.0),
    "throughput/samples_per_s": ("5_throughput/samples_per_s", "5_throughput/samples_per_s", 1.0),
    "throughput/tokens_per_s": ("5_throughput/tokens_per_s", "5_throughput/tokens_per_s", 1.0),
    "util/mfu": ("6_util/mfu_pct", "6_util/mfu_pct", 100.0),
    "gpu/util_percent": ("6_util/gpu_pct", "6_util/gpu_pct", 1.0),
    "host/process_cpu_percent": ("6_util/process_cpu_pct", "6_util/process_cpu_pct", 1.0),
    "host/system_cpu_percent": ("6_util/system_cpu_pct", "6_util/system_cpu_pct", 1.0),
    "gpu/memory_used_bytes": ("7_gpu/memory_used_mib", "7_gpu/memory_used_mib", 1 / MiB),
    "gpu/power_w": ("7_gpu/power_w", "7_gpu/power_w", 1.0),
    "gpu/temperature_c": ("7_gpu/temperature_c", "7_gpu/temperature_c", 1.0),
    "gpu/sm_clock_mhz": ("7_gpu/sm_clock_mhz", "7_gpu/sm_clock_mhz", 1.0),
    # on the CPU the peak above is the RSS's high-water mark: its mean is not written beside it
    "host/process_rss_bytes": ("8_host/rss_mib", None, 1 / MiB),
}
# under DDP, the slowest rank's figure beside the job's (the row's ``<key>_max``)
_MAX_TAGS = {
    "time/step_s": ("1_step/time_ms_slowest_rank", 1e3),
    "time/data_wait_share": ("1_step/data_wait_pct_slowest_rank", 100.0),
}
_DATA_WAIT_PCT = "1_step/data_wait_pct"  # only without phases (with them: 2_phase_pct/data_wait)
_GPU_FIELDS = {  # a sampled GPU's gauge -> (tag field, scale), when one process samples several
    "util_percent": ("util_pct", 1.0),
    "memory_used_bytes": ("memory_used_mib", 1 / MiB),
    "power_w": ("power_w", 1.0),
    "temperature_c": ("temperature_c", 1.0),
    "sm_clock_mhz": ("sm_clock_mhz", 1.0),
}
# the memory tags the tab's Memory view draws, with their labels
MEMORY_TAGS = {
    "4_memory/allocated_mib": "allocated",
    "4_memory/reserved_mib": "reserved",
    "4_memory/allocated_peak_mib": "allocated peak",
    "4_memory/rss_peak_mib": "process RSS peak",
    "4_memory/heap_in_use_mib": "heap in use (whole process)",
    "8_host/rss_mib": "process RSS",
}
# a run written before these tags (resource_guard < #38): new tag -> (old tag, scale to the new unit)
LEGACY_TAGS = {
    STEP_MS: ("time/step_s", 1e3),
    "4_memory/allocated_mib": ("memory/allocated_bytes", 1 / MiB),
    "4_memory/reserved_mib": ("memory/reserved_bytes", 1 / MiB),
    "4_memory/allocated_peak_mib": ("memory/peak_bytes", 1 / MiB),
    "8_host/rss_mib": ("host/process_rss_bytes", 1 / MiB),
    **{f"{PHASE_MS}{p}": (f"phase/{p}_s", 1e3) for p in (
        "data_wait", "forward", "backward", "optimizer", "host", "evaluation", "checkpoint", "logging",
        "communication", "other",
    )},
}  # fmt: skip


def _finite(value: float | None) -> bool:
    return value is not None and not math.isnan(value) and not math.isinf(value)


def scalar_values(
    row: Mapping[str, float],
    *,
    cuda: bool,
    maxes: Mapping[str, float] | None = None,
    gpus: Mapping[str, float] | None = None,
    phases_timed: bool = False,
    plan: Mapping[str, int | None] | None = None,
) -> dict[str, float]:
    """The scalars of one interval: ``row`` (the job's, :data:`~resource_guard.observe.stats.METRIC_KEYS`)
    under the tags above, NaN left out.

    Args:
        cuda: the run's memory figures are the CUDA allocator's (else the process's RSS and heap).
        maxes: under DDP, the slowest rank's ``time/step_s`` and ``time/data_wait_share``.
        gpus: ``gpu<i>/<field>`` means when one process samples several GPUs.
        phases_timed: the step is split by phase (its data wait is then ``2_phase_pct/data_wait``).
        plan: on a CUDA run, the plan's ``capacity_bytes`` and ``usable_bytes``: written beside the
            allocator's figures (``4_memory/capacity_mib``, ``4_memory/usable_mib``), the lines the
            custom-scalars memory chart holds them against.
    """
    out: dict[str, float] = {}
    for key, (cuda_tag, cpu_tag, scale) in _ROW_TAGS.items():
        tag = cuda_tag if cuda else cpu_tag
        value = row.get(key)
        if tag is not None and _finite(value):
            out[tag] = float(value) * scale  # type: ignore[arg-type]
    share = row.get("time/data_wait_share")
    if not phases_timed and _finite(share):
        out[_DATA_WAIT_PCT] = float(share) * 100.0  # type: ignore[arg-type]
    for key, value in (maxes or {}).items():
        if key in _MAX_TAGS and _finite(value):
            tag, scale = _MAX_TAGS[key]
            out[tag] = float(value) * scale
    for key, value in (gpus or {}).items():
        index, _, field = key.partition("/")
        if field in _GPU_FIELDS and index.startswith("gpu") and _finite(value):
            name, scale = _GPU_FIELDS[field]
            out[f"7_gpu/{index[3:]}/{name}"] = float(value) * scale
    if cuda and plan:
        for name in ("capacity", "usable"):
            value = plan.get(f"{name}_bytes")
            if value:
                out[f"4_memory/{name}_mib"] = value / MiB
    return out


def phase_values(
    per_step_s: Mapping[str, float], step_s: float | None, seen: Collection[str]
) -> tuple[dict[str, float], set[str]]:
    """Each phase in ms per step and as a share of the step (%): only the phases that took at least
    :data:`MIN_PHASE_SHARE` of the step (any time, without ``step_s``) now or earlier in the run
    (``seen``, returned with this interval's added), so that no flat zero is written.

    Example:
        >>> values, seen = phase_values({"forward": 0.03, "backward": 0.07, "evaluation": 0.0}, 0.1, ())
        >>> {tag: round(v, 3) for tag, v in sorted(values.items())}
        {'2_phase_pct/backward': 70.0, '2_phase_pct/forward': 30.0, '3_phase_ms/backward': 70.0, \
'3_phase_ms/forward': 30.0}
        >>> sorted(seen)
        ['backward', 'forward']
    """
    floor = MIN_PHASE_SHARE * step_s if step_s and step_s > 0 else 0.0
    now = set(seen) | {p for p, v in per_step_s.items() if v > 0 and v >= floor}
    out: dict[str, float] = {}
    for phase, value in per_step_s.items():
        if phase not in now:
            continue
        out[PHASE_MS + phase] = value * 1e3
        if step_s and step_s > 0:
            out[PHASE_PCT + phase] = value / step_s * 100.0
    return out, now
