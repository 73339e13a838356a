"""What a :class:`~resource_guard.monitor.RunMonitor` records and writes: at each log boundary the
interval row (kept for the run stats, logged to TensorBoard); when the run ends the OOM record
(``oom.json``, the memory snapshot), the report files (``report.md``, ``report.json``, ``memory.png``)
with their TensorBoard copies, and the console summary.

These functions act on the monitor they are given and degrade through its ``_guard`` (one warning, the
failing part switched off), like the monitor's own methods.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from ._monitor_stats import METRIC_KEYS, interval_row, job_row, tensorboard_scalars
from .oom import SNAPSHOT_FILE, OomEvent, memory_history, write_oom
from .report import Report
from .sampler import peak_rss_bytes, reset_peak_rss
from .tblog import memory_picture, png_bytes
from .throughput import aggregate_rows

if TYPE_CHECKING:
    from .monitor import RunMonitor

__all__ = ["log_interval", "peak_memory", "record_oom", "write_outputs", "console_summary"]

_log = logging.getLogger("resource_guard")


def log_interval(mon: RunMonitor, now: float, collective: bool = True) -> None:
    """At a log boundary: this interval's row, aggregated over ranks (a collective unless
    ``collective=False``), kept for the run stats and logged to TensorBoard."""
    assert mon._timer is not None  # internal invariant: only called after start()
    iv = mon._timer.take(now)
    if iv.steps == 0:
        return
    gauges = mon._sampler.drain() if mon._sampler is not None else {}
    device_compute_s = None
    if mon._events:
        mon._events[-1][1].synchronize()  # the only device sync: at a log boundary
        device_ms = sum(start.elapsed_time(end) for start, end in mon._events)
        device_compute_s = device_ms / 1e3 / len(mon._events)
        mon._events.clear()
    peak = mon._guard("memory peak", peak_memory, mon, gauges)
    row = interval_row(
        iv,
        gauges,
        stall_threshold=mon.stall_threshold,
        device_compute_s=device_compute_s,
        peak_bytes=peak,
        estimated_peak_bytes=mon.estimate.peak_bytes if mon._cuda and mon.estimate is not None else None,
        gpu_index=mon.device.index or 0,
    )
    values = list(row.values())
    means, maxes = aggregate_rows(values, mon._collective_device()) if collective else (values, values)
    agg = job_row(
        row,
        means,
        maxes,
        world_size=mon.world_size,
        flops_per_step=mon.flops_per_step,
        peak_flops_per_s=mon._peak_flops(),
    )
    mon._intervals.append(tuple(agg[k] for k in METRIC_KEYS))
    if mon._tb is None:
        return
    out = tensorboard_scalars(agg, maxes, gauges, world_size=mon.world_size)
    mon._guard("TensorBoard", lambda: mon._tb.scalars(mon._step, out), off="_tb")  # type: ignore[union-attr]


def peak_memory(mon: RunMonitor, gauges: Mapping[str, tuple[float, float]]) -> float | None:
    """The interval's peak: the CUDA allocator's (then reset), else the process's RSS high-water mark
    (then reset), else the highest sampled RSS."""
    if mon._cuda:
        peak = torch.cuda.max_memory_allocated(mon.device)
        torch.cuda.reset_peak_memory_stats(mon.device)
        return float(peak)
    hwm = peak_rss_bytes() if mon._rss_reset else None
    if hwm is not None:
        mon._rss_reset = reset_peak_rss()
        return float(hwm)
    sampled = gauges.get("host/process_rss_bytes")
    return None if sampled is None else sampled[1]


def record_oom(mon: RunMonitor, exc: BaseException) -> OomEvent:
    """The last memory figures (read before the final interval resets the peak), snapshot, oom.json."""
    peak: float | None
    if mon._cuda:
        peak = float(torch.cuda.max_memory_allocated(mon.device))
    else:
        peak = peak_rss_bytes() if mon._rss_reset else None
    logged = [r[METRIC_KEYS.index("memory/peak_bytes")] for r in mon._intervals]
    logged = [v for v in logged if not math.isnan(v)]
    directory = mon._files_dir if mon.rank == 0 else None
    snapshot = None
    if mon._history and directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        if mon._guard("memory snapshot", memory_history, "dump", directory / SNAPSHOT_FILE):
            snapshot = str(directory / SNAPSHOT_FILE)
    event = OomEvent(
        error=OomEvent.describe(exc),
        step=mon._step + 1,
        device=str(mon.device),
        peak_at_oom_bytes=None if peak is None else int(peak),
        last_logged_peak_bytes=int(logged[-1]) if logged else None,
        peak_memory_source="cuda_allocated" if mon._cuda else "rss",
        estimated_peak_bytes=mon.estimate.peak_bytes if mon.estimate is not None else None,
        capacity_bytes=mon._capacity(),
        snapshot_path=snapshot,
    )
    if directory is not None:
        mon._guard("OOM record", write_oom, directory, event)
    return event


def write_outputs(mon: RunMonitor, report: Report) -> None:
    """Rank zero, at close: the report and the memory picture to TensorBoard and to ``report.md``,
    ``report.json`` and ``memory.png`` in the monitor's files directory."""
    markdown = report.to_markdown()
    picture = None
    if mon.estimate is not None and mon.estimate.timeline:
        title = f"pre-flight memory of one step ({mon.estimate.precision}) vs {mon.device}"
        picture = mon._guard(
            "memory picture", memory_picture, mon.estimate.timeline, mon._capacity(), title=title
        )
    if mon._tb is not None:
        tb = mon._tb
        mon._guard("TensorBoard", lambda: tb.text("report", markdown, mon._step), off="_tb")
        if picture is not None and mon._tb is not None:
            mon._guard("TensorBoard", lambda: tb.image("memory", picture, mon._step), off="_tb")
    directory = mon._files_dir
    if directory is None:
        return

    def write_files() -> None:
        import json

        directory.mkdir(parents=True, exist_ok=True)
        (directory / "report.md").write_text(markdown, encoding="utf-8")
        data = json.dumps(report.to_dict(), indent=2, default=str)
        (directory / "report.json").write_text(data, encoding="utf-8")
        if picture is not None:
            (directory / "memory.png").write_bytes(png_bytes(picture))

    mon._guard("report files", write_files)


def console_summary(report: Report) -> None:
    """The one-line summary and the findings: to the ``resource_guard`` logger at INFO when it is enabled
    for INFO, else to stderr."""
    line = report.summary_line()
    extra = [f"  {f.id} ({f.severity}): {f.title}" for f in report.findings if f.id != "healthy"]
    text = "\n".join([line, *extra])
    if _log.isEnabledFor(logging.INFO):
        _log.info(text)
    else:
        print(text, file=sys.stderr)
