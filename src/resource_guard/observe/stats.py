"""The numbers of a :class:`~resource_guard.RunMonitor`, as pure functions: the interval row
(:data:`METRIC_KEYS`, one row per log boundary; TensorBoard shows it under the tags of
:mod:`resource_guard.report.scalar_tags`), the job-level row across
ranks, and the run-level :class:`~resource_guard.report.findings.RunStats` the report is drawn from.

The monitor does the reading (clock, CUDA events, allocator peaks, the collective); these functions only
combine what it read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from resource_guard.observe.phases import phase_means
from resource_guard.observe.profiling import ProfileSummary
from resource_guard.observe.throughput import Interval
from resource_guard.report.findings import RunStats, available_cores
from resource_guard.report.scalar_tags import scalar_values
from resource_guard.report.types import PHASES

if TYPE_CHECKING:
    from resource_guard.devices import DeviceSpec

__all__ = [
    "METRIC_KEYS",
    "RANK_MAX_KEYS",
    "RANK_ROW_KEYS",
    "interval_row",
    "job_row",
    "node_phases",
    "rank_figures",
    "rank_row",
    "tensorboard_scalars",
    "run_stats",
]

_GPU_KEYS = ("util_percent", "memory_used_bytes", "power_w", "temperature_c", "sm_clock_mhz")
_HOST_KEYS = ("process_cpu_percent", "process_rss_bytes", "system_cpu_percent", "available_ram_bytes")
METRIC_KEYS = (
    ("steps", "time/step_s", "time/data_wait_s", "time/compute_s", "time/data_wait_share", "time/stalled")
    + ("time/device_compute_s", "throughput/samples_per_s", "throughput/tokens_per_s", "util/mfu")
    + ("memory/peak_bytes", "memory/estimate_error")
    + ("memory/allocated_bytes", "memory/reserved_bytes", "memory/reserved_gap_bytes", "memory/alloc_retries")
    + tuple(f"host/{k}" for k in _HOST_KEYS)
    + tuple(f"gpu/{k}" for k in _GPU_KEYS)
)
RANK_MAX_KEYS = ("time/step_s", "time/data_wait_share")  # logged with a ``_max`` tag under DDP
# the fullest (or most retried) rank counts for these, not the mean rank
_MAX_OVER_RANKS = (
    "memory/peak_bytes",
    "memory/allocated_bytes",
    "memory/reserved_bytes",
    "memory/reserved_gap_bytes",
    "memory/alloc_retries",
)
_NAN = math.nan


def interval_row(
    iv: Interval,
    gauges: Mapping[str, tuple[float, float]],
    *,
    stall_threshold: float,
    device_compute_s: float | None,
    peak_bytes: float | None,
    estimated_peak_bytes: int | None,
    gpu_index: int,
    memory: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """This rank's row for one interval (``NaN`` for unknown); ``gauges`` maps a key to (mean, max).

    ``estimated_peak_bytes`` (CUDA runs only) gives ``memory/estimate_error``; of the sampled GPUs,
    ``gpu_index`` is the one this rank trains on. ``memory`` holds the other ``memory/*`` keys read at
    this boundary (the last step-end reading, the CUDA allocator's reserved bytes, gap and retries).
    """
    row = dict.fromkeys(METRIC_KEYS, _NAN)
    wall = max(iv.wall_s, 1e-12)
    row.update({
        "steps": iv.steps, "time/step_s": wall / iv.steps, "time/data_wait_s": iv.data_wait_s / iv.steps,
        "time/compute_s": iv.compute_s / iv.steps, "time/data_wait_share": iv.data_wait_share,
        "throughput/samples_per_s": iv.samples / wall if iv.samples else _NAN,
        "throughput/tokens_per_s": iv.tokens / wall if iv.tokens else _NAN,
    })  # fmt: skip
    row["time/stalled"] = float(iv.data_wait_share >= stall_threshold)
    if device_compute_s is not None:
        row["time/device_compute_s"] = device_compute_s
    if peak_bytes is not None:
        row["memory/peak_bytes"] = float(peak_bytes)
        if estimated_peak_bytes:
            row["memory/estimate_error"] = (peak_bytes - estimated_peak_bytes) / estimated_peak_bytes
    for key, value in (memory or {}).items():
        if key in row and value is not None:
            row[key] = float(value)
    own_gpu = f"gpu{gpu_index}/"
    for key, (mean, _max) in gauges.items():
        if key.startswith("host/"):
            row[key] = mean
        elif key.startswith(own_gpu):
            row["gpu/" + key[len(own_gpu) :]] = mean
    return row


def job_row(
    row: Mapping[str, float],
    means: Sequence[float],
    maxes: Sequence[float],
    *,
    world_size: int,
    flops_per_step: float | None,
    peak_flops_per_s: float | None,
) -> dict[str, float]:
    """The job's row from the ranks' ``means`` and ``maxes`` of ``row``: peak memory of the fullest rank,
    throughput of all ranks, MFU from the mean step time."""
    agg = dict(zip(row, means))
    for key in _MAX_OVER_RANKS:
        agg[key] = maxes[METRIC_KEYS.index(key)]
    for key in ("throughput/samples_per_s", "throughput/tokens_per_s"):
        agg[key] = agg[key] * world_size  # the mean rank's rate × ranks = the job's rate
    if flops_per_step and peak_flops_per_s:
        agg["util/mfu"] = flops_per_step / agg["time/step_s"] / peak_flops_per_s
    return agg


def tensorboard_scalars(
    agg: Mapping[str, float],
    maxes: Sequence[float],
    gauges: Mapping[str, tuple[float, float]],
    *,
    world_size: int,
    cuda: bool = False,
    phases_timed: bool = False,
    plan: Mapping[str, int | None] | None = None,
) -> dict[str, float]:
    """The scalars to log for one interval, under their TensorBoard tags
    (:mod:`resource_guard.report.scalar_tags`): the job's row, the slowest rank under DDP, every GPU's
    gauges when more than one GPU was sampled."""
    slowest = {k: maxes[METRIC_KEYS.index(k)] for k in RANK_MAX_KEYS} if world_size > 1 else None
    gpus = None
    if len({k.split("/")[0] for k in gauges if k.startswith("gpu")}) > 1:
        gpus = {k: mean for k, (mean, _) in gauges.items() if k.startswith("gpu")}
    return scalar_values(agg, cuda=cuda, maxes=slowest, gpus=gpus, phases_timed=phases_timed, plan=plan)


def run_stats(
    intervals: Sequence[tuple[float, ...]],
    *,
    device: torch.device,
    cuda: bool,
    device_spec: DeviceSpec | None,
    flops_per_step: float | None,
    peak_flops_per_s: float | None,
    capacity_bytes: int | None,
    estimated_peak_bytes: int | None,
    precision: str | None,
    loader_info: Mapping[str, Any],
    world_size: int,
    stall_threshold: float,
    profile: ProfileSummary | None,
    notes: tuple[str, ...],
    oom: Mapping[str, Any] | None,
    memory_growth: Mapping[str, Any] | None = None,
    expandable_segments: bool | None = None,
) -> RunStats:
    """The run-level :class:`~resource_guard.report.findings.RunStats` from the logged interval rows.

    Means are weighted by each interval's wall time and leave out the first interval (the start-up
    step) when there are others; the peak memory is the maximum over all intervals. ``cuda`` says
    whether the peaks came from the CUDA allocator (else from the process RSS). The allocator's
    retries are its running count at the last boundary; reserved bytes are the highest reading, with
    the gap read at the same boundary.
    """
    rows = [dict(zip(METRIC_KEYS, r)) for r in intervals]
    steps = int(sum(r["steps"] for r in rows))
    body = rows[1:] if len(rows) > 1 else rows  # the first interval is the start-up step
    walls = [r["time/step_s"] * r["steps"] for r in body]
    wall = sum(walls)

    def weighted(key: str) -> float | None:
        pairs = [(r[key], w) for r, w in zip(body, walls) if not math.isnan(r[key])]
        total = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / total if pairs and total > 0 else None

    body_steps = sum(r["steps"] for r in body)
    peaks = [r["memory/peak_bytes"] for r in rows if not math.isnan(r["memory/peak_bytes"])]
    reserved_rows = [r for r in rows if not math.isnan(r["memory/reserved_bytes"])]
    top = max(reserved_rows, key=lambda r: r["memory/reserved_bytes"], default=None)
    retries = [r["memory/alloc_retries"] for r in rows if not math.isnan(r["memory/alloc_retries"])]
    gap = top["memory/reserved_gap_bytes"] if top is not None else math.nan
    spec = device_spec
    step_time = wall / body_steps if body_steps else None
    mfu = None
    if flops_per_step and peak_flops_per_s and step_time:
        mfu = flops_per_step / step_time / peak_flops_per_s
    cc = spec.compute_capability if spec is not None else None
    tensor_cores = device.type == "cuda" and (
        (cc is not None and float(cc) >= 7.0)
        or bool(spec and {"fp16", "bf16", "tf32"} & set(spec.peak_tflops))
    )
    return RunStats(
        steps=steps,
        duration_s=sum(r["time/step_s"] * r["steps"] for r in rows) if rows else None,
        step_time_s=step_time,
        data_wait_s=weighted("time/data_wait_s"),
        data_wait_share=weighted("time/data_wait_share"),
        max_interval_data_wait_share=max((r["time/data_wait_share"] for r in body), default=None),
        samples_per_s=weighted("throughput/samples_per_s"),
        tokens_per_s=weighted("throughput/tokens_per_s"),
        flops_per_step=flops_per_step,
        mfu=mfu,
        peak_memory_bytes=int(max(peaks)) if peaks else None,
        peak_memory_source=None if not peaks else ("cuda_allocated" if cuda else "rss"),
        capacity_bytes=capacity_bytes,
        estimated_peak_bytes=estimated_peak_bytes,
        gpu_util_percent=weighted("gpu/util_percent"),
        process_cpu_percent=weighted("host/process_cpu_percent"),
        device=str(device),
        device_kind=device.type,
        device_name=spec.display_name or spec.name if spec is not None else None,
        precision=precision,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        tensor_cores=tensor_cores,
        bf16_supported=bool(spec and spec.bf16),
        tf32_supported=bool(spec and "tf32" in spec.peak_tflops),
        loader_info=loader_info,
        available_cores=available_cores(),
        cpu_count=os.cpu_count(),
        world_size=world_size,
        stall_threshold=stall_threshold,
        profile=profile,
        notes=notes,
        oom=oom,
        memory_growth=memory_growth,
        alloc_retries=int(max(retries)) if retries else None,
        reserved_bytes=int(top["memory/reserved_bytes"]) if top is not None else None,
        reserved_gap_bytes=None if math.isnan(gap) else int(gap),
        expandable_segments=expandable_segments,
    )


# one rank's own figures over the run (the start-up step left out when there are others), gathered
# from every rank at close: the straggler rule's input, and the node's phases
RANK_ROW_KEYS = ("steps", "wall_s", "data_wait_s", "phase_steps", *(f"phase/{p}" for p in PHASES))


def rank_row(
    steps: int, wall_s: float, data_wait_s: float, phase_totals: Mapping[str, float], phase_steps: int
) -> list[float]:
    """This rank's row of :data:`RANK_ROW_KEYS` (phase totals in seconds over ``phase_steps`` steps)."""
    phases = [float(phase_totals.get(p, 0.0)) for p in PHASES]
    return [float(steps), float(wall_s), float(data_wait_s), float(phase_steps), *phases]


def rank_figures(rows: Sequence[Sequence[float]]) -> tuple[dict[str, Any], ...]:
    """Every rank's figures from the gathered rows (rank order): steps, its own mean step time and data
    wait, and its phases (mean seconds per step, adding up to its step; ``None`` when it timed none).

    Example:
        >>> row = rank_row(10, 0.5, 0.1, {"data_wait": 0.1, "forward": 0.2}, 10)
        >>> r = rank_figures([row])[0]
        >>> r["rank"], r["step_time_s"], round(r["phases"]["other"], 3)
        (0, 0.05, 0.02)
    """
    out = []
    for rank, row in enumerate(rows):
        values = dict(zip(RANK_ROW_KEYS, row))
        steps = int(values["steps"])
        step_s = values["wall_s"] / steps if steps else None
        phase_steps = int(values["phase_steps"])
        totals = {p: values[f"phase/{p}"] for p in PHASES}
        phases = phase_means(totals, phase_steps, step_s) if phase_steps else None
        out.append({
            "rank": rank,
            "steps": steps,
            "step_time_s": step_s,
            "data_wait_s": values["data_wait_s"] / steps if steps else None,
            "phases": phases,
        })  # fmt: skip
    return tuple(out)


def node_phases(ranks: Sequence[Mapping[str, Any]], step_time_s: float | None) -> dict[str, float] | None:
    """The job's phases: each the mean over the ranks that timed phases, ``other`` the remainder of
    ``step_time_s``; ``None`` when no rank timed phases."""
    timed = [r["phases"] for r in ranks if r.get("phases")]
    if not timed:
        return None
    totals = {p: sum(float(t.get(p, 0.0)) for t in timed) for p in PHASES if p != "other"}
    return phase_means(totals, len(timed), step_time_s)
