"""What a :class:`~resource_guard.RunMonitor` records and writes: at each log boundary the
interval row (kept for the run stats, logged to TensorBoard); when the run ends the OOM record
(``oom.json``, the memory snapshot), the report files (``report.md``, ``report.json``, ``memory.png``)
with their TensorBoard copies, and the console summary.

:class:`MonitorOutputs` is the monitor's base class: its methods degrade through the monitor's ``_guard``
(one warning, the failing part switched off), like the monitor's own methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

from resource_guard.observe.oom import SNAPSHOT_FILE, OomEvent, memory_history, write_oom
from resource_guard.observe.optimizer_facts import describe_optimizer, foreach_probe
from resource_guard.observe.phases import PhaseClock, phase_means
from resource_guard.observe.picture import PICTURE_DEADLINE_S, PictureJob
from resource_guard.observe.sampler import peak_rss_bytes, reset_peak_rss
from resource_guard.observe.stats import (
    METRIC_KEYS,
    interval_row,
    job_row,
    node_phases,
    rank_figures,
    rank_row,
    run_stats,
    tensorboard_scalars,
)
from resource_guard.observe.throughput import aggregate_rows, gather_rows, peak_flops_per_s
from resource_guard.planning.projection_result import remaining_markdown, remaining_run
from resource_guard.report.breakdown import phase_line
from resource_guard.report.findings import Report, RunStats
from resource_guard.report.scalar_tags import phase_values
from resource_guard.report.tensorboard import memory_picture, png_bytes

if TYPE_CHECKING:
    from resource_guard.devices import DeviceSpec
    from resource_guard.estimate import MemoryEstimate
    from resource_guard.observe.growth import MemoryWatch
    from resource_guard.observe.profiling import ProfileSummary
    from resource_guard.observe.sampler import Sampler
    from resource_guard.observe.threads import ThreadDemand
    from resource_guard.observe.throughput import StepTimer
    from resource_guard.report.tensorboard import TBLog

__all__ = ["MonitorOutputs", "console_summary", "expandable_segments"]

_log = logging.getLogger("resource_guard")


class MonitorOutputs:
    """The recording and writing half of :class:`~resource_guard.RunMonitor` (its base).

    The state below is owned and set by the monitor; the methods degrade through its ``_guard``.
    """

    device: torch.device
    estimate: MemoryEstimate | None
    device_spec: DeviceSpec | None
    stall_threshold: float
    world_size: int
    rank: int
    flops_per_step: float | None
    total_steps: int | None
    _remaining: dict[str, Any] | None
    _timer: StepTimer | None
    _sampler: Sampler | None
    _events: list[tuple[Any, Any]]
    _tb: TBLog | None
    _cuda: bool
    _rss_reset: bool
    _step: int
    _intervals: list[tuple[float, ...]]
    phases: PhaseClock | None
    _phase_sums: dict[str, float]
    _phase_steps: int
    _phase_first: tuple[dict[str, float], int] | None = None
    _phases_seen: Collection[str] = frozenset()  # the phases non-zero so far in the run (scalars)
    planned_fit: Any = None  # the plan's DeviceFit: its capacity, usable line and predicted peak
    _traced_steps: int = 0  # steps the profiler traced, left out of the intervals
    _traced_s: float = 0.0
    optimizers: Any = ()  # set by a front door: its optimizers, described at close (optimizer-step)
    plan_rows: Any = ()  # set by a front door: its plan's table, quoted by the advice (plan_advice.py)
    _history: bool
    _guard: Callable[..., Any]
    _comparable_estimate: int | None = None  # cached by _estimated_peak_bytes
    _memory: MemoryWatch | None
    _oom: OomEvent | None
    _notes: list[str]
    shape_stats: Any
    capacity_bytes: int | None
    planned_capacity_bytes: int | None
    precision: str | None
    loader_info: dict[str, Any]
    _threads: ThreadDemand | None = None  # read at start
    _hwm_read_at: float = -math.inf  # when VmHWM was last read (time.monotonic)
    _closed: bool
    interval_s: float
    _compile_start: Any = None  # dynamo's counters at start
    _close_parts: dict[str, float]  # seconds by part of close() (the report shows the slower ones)
    _probed: bool = False  # an end-of-run probe ran: at most one per run
    _picture_job: PictureJob | None = None  # the memory picture, drawn on a thread from start
    # this rank's own (steps, wall s, data wait s): the start-up interval, and the intervals after it
    _own_first: tuple[int, float, float] | None = None
    _own_body: tuple[int, float, float] = (0, 0.0, 0.0)
    _ranks: tuple[dict[str, Any], ...] = ()  # every rank's figures, gathered at close under DDP
    _own_s: float = 0.0  # the monitor's own work inside the loop (set by the monitor)
    _profiler_s: float = 0.0  # of which the profiler's steps

    @property
    def _files_dir(self) -> Path | None:  # the monitor's: where report and OOM files go
        raise NotImplementedError

    @contextlib.contextmanager
    def _close_part(self, name: str) -> Iterator[None]:
        """Time a part of ``close()`` into ``_close_parts[name]``."""
        begun = time.perf_counter()
        try:
            yield
        finally:
            parts = self.__dict__.setdefault("_close_parts", {})
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - begun

    def _log_interval(self, now: float, collective: bool = True) -> None:
        """At a log boundary: this interval's row, aggregated over ranks (a collective unless
        ``collective=False``), kept for the run stats and logged to TensorBoard."""
        assert self._timer is not None  # internal invariant: only called after start()
        iv = self._timer.take(now)
        phase_totals = self.phases.take(now) if self.phases is not None else None
        if iv.steps == 0:
            return
        phase_row = self._add_phases(phase_totals, iv.steps)
        if phase_totals is not None:  # the data wait is the loader's own __next__, not the gap
            wait = min(phase_totals["data_wait"], iv.wall_s)
            iv = dataclasses.replace(iv, data_wait_s=wait, compute_s=iv.wall_s - wait)
        if not self._intervals:  # this rank's own figures, for the gather at close (_gather_ranks)
            self._own_first = (iv.steps, iv.wall_s, iv.data_wait_s)
        else:
            steps, wall, waited = self._own_body
            self._own_body = (steps + iv.steps, wall + iv.wall_s, waited + iv.data_wait_s)
        gauges = {}
        if self._sampler is not None:
            self._sampler.maybe_sample(force=self._closed)  # without a thread: read here, on this thread
            gauges = self._sampler.drain()
        device_compute_s = None
        if self._events:
            self._events[-1][1].synchronize()  # the only device sync: at a log boundary
            device_ms = sum(start.elapsed_time(end) for start, end in self._events)
            device_compute_s = device_ms / 1e3 / len(self._events)
            self._events.clear()
        peak = self._guard("memory peak", self._peak_memory, gauges)
        memory = self._guard("allocator figures", self._allocator_figures) if self._cuda else {}
        if self._memory is not None and self._memory.samples:
            memory["memory/allocated_bytes"] = self._memory.samples[-1][2]  # the last step-end reading
        row = interval_row(
            iv,
            gauges,
            stall_threshold=self.stall_threshold,
            device_compute_s=device_compute_s,
            peak_bytes=peak,
            estimated_peak_bytes=self._estimated_peak_bytes() if self._cuda else None,
            gpu_index=self.device.index or 0,
            memory=memory,
        )
        values = list(row.values())
        means, maxes = aggregate_rows(values, self._collective_device()) if collective else (values, values)
        agg = job_row(
            row,
            means,
            maxes,
            world_size=self.world_size,
            flops_per_step=self.flops_per_step,
            peak_flops_per_s=self._peak_flops(),
        )
        self._intervals.append(tuple(agg[k] for k in METRIC_KEYS))
        self._schedule_log(agg.get("time/step_s"))  # the same on every rank: the row is aggregated
        self._guard("projection", self._project_remaining, agg.get("time/step_s"))
        if self._tb is None:
            return
        out = tensorboard_scalars(
            agg,
            maxes,
            gauges,
            world_size=self.world_size,
            cuda=self._cuda,
            phases_timed=phase_totals is not None,
            plan=self._plan_memory(),
        )
        if phase_row:  # each phase's share of this rank's step, once it was non-zero in the run
            phase_tags, self._phases_seen = phase_values(phase_row, iv.wall_s / iv.steps, self._phases_seen)
            out.update(phase_tags)
        self._guard("TensorBoard", lambda: self._tb.scalars(self._step, out), off="_tb")  # type: ignore[union-attr]

    def _add_phases(self, totals: Mapping[str, float] | None, steps: int) -> dict[str, float]:
        """Keep this interval's phase totals for the run (the first interval, the start-up step, only
        until a later one exists); this rank's phases in seconds per step, by name."""
        if totals is None:
            return {}
        if not self._intervals:  # the start-up step: used only when no later interval comes
            self._phase_first = (dict(totals), steps)
        else:
            for key, value in totals.items():
                self._phase_sums[key] = self._phase_sums.get(key, 0.0) + value
            self._phase_steps += steps
        return {key: value / steps for key, value in totals.items()}

    def _schedule_log(self, step_s: float | None) -> None:
        """The monitor's cadence (:meth:`RunMonitor._schedule_log`): after each logged interval."""

    def _gather_ranks(self) -> None:
        """Under ``torch.distributed``, at close: every rank's own step time, data wait and phases reach
        every rank (one gather), for the ``straggler`` finding and the node's phases in the report."""
        import torch.distributed as dist

        if self.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        steps, wall, waited = self._own_body if self._own_body[0] else self._own_first or (0, 0.0, 0.0)
        totals, phase_steps = (
            (self._phase_sums, self._phase_steps) if self._phase_steps else self._phase_first or ({}, 0)
        )
        row = rank_row(steps, wall, waited, totals, phase_steps)
        self._ranks = rank_figures(gather_rows(row, self._collective_device()))

    def _collective_device(self) -> torch.device | None:
        import torch.distributed as dist

        if self._cuda and dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return self.device
        return None

    def _peak_flops(self) -> float | None:
        spec = self.device_spec
        if spec is None:
            return None
        return peak_flops_per_s(spec.peak_tflops, self.precision, torch.get_float32_matmul_precision())

    # -- the end of the run ----------------------------------------------------------------------
    def _run_stats(self, profile: ProfileSummary | None) -> RunStats:
        stats = run_stats(
            self._intervals,
            device=self.device,
            cuda=self._cuda,
            device_spec=self.device_spec,
            flops_per_step=self.flops_per_step,
            peak_flops_per_s=self._peak_flops(),
            capacity_bytes=self._planned_capacity(),
            estimated_peak_bytes=self._estimated_peak_bytes(),
            precision=self.precision,
            loader_info=self.loader_info,
            world_size=self.world_size,
            stall_threshold=self.stall_threshold,
            profile=profile,
            notes=tuple(self._notes),
            oom=None if self._oom is None else self._oom.to_dict(),
            memory_growth=self._memory_growth(),
            expandable_segments=expandable_segments() if self._cuda else None,
        )
        plan = self._plan_memory() or {}
        stats = dataclasses.replace(
            stats,
            usable_bytes=plan.get("usable_bytes"),
            predicted_peak_bytes=plan.get("predicted_peak_bytes"),
            ram_bytes=None if self._cuda else self._capacity(),  # the RSS peak's yardstick
        )
        if self._traced_steps:  # the run's steps and duration include the traced ones
            duration = None if stats.duration_s is None else stats.duration_s + self._traced_s
            stats = dataclasses.replace(stats, steps=stats.steps + self._traced_steps, duration_s=duration)
        stats = self._with_phases(stats)
        if self.plan_rows:  # the plan's table, for advice that quotes the configuration it recommends
            stats = dataclasses.replace(stats, plan_rows=tuple(self.plan_rows))
        if self.optimizers:  # the front door's optimizers: which step implementation runs
            facts = self._guard("optimizer facts", self._optimizer_facts, stats)
            stats = dataclasses.replace(stats, optimizers=facts or ())
        cost = self._guard("monitoring cost", self._cost_note, stats)
        if cost:
            self._notes.append(cost)
        threads = self._guard("thread figures", self._thread_figures, stats.profile)
        compiled = self._guard("compile figures", self._compile_figures)
        stats = dataclasses.replace(stats, threads=threads, compile=compiled, notes=tuple(self._notes))
        if self.shape_stats is None:  # the front doors' shape guard, when on
            return stats
        return dataclasses.replace(stats, shapes=self._guard("shape stats", self.shape_stats))

    def _cost_note(self, stats: RunStats) -> str | None:
        """What watching cost this run, as the monitor measured it: its own work inside the loop (log
        boundaries, memory reads, the profiler's steps), the profiler window's traced steps beyond an
        untraced step (paid once), and the sampler's readings."""
        loop_s, step_s = stats.duration_s, stats.step_time_s
        if not loop_s or loop_s <= 0:
            return None
        own_s = self._own_s
        window_s = 0.0
        if self._traced_steps and step_s:
            window_s = max(0.0, self._traced_s - self._traced_steps * step_s)
        sampler = self._sampler
        window = self._profiler_s
        picture = getattr(self, "_picture_wait_s", 0.0)  # the first step's wait for the memory picture
        parts = [f"log boundaries and memory reads {(own_s - window - picture) * 1e3:.1f} ms"]
        if picture:
            parts.append(f"the wait for the memory picture at the end of step 1 {picture * 1e3:.1f} ms")
        if window or window_s:
            parts.append(
                f"the profiler window (once per run): starting and stopping it {window * 1e3:.1f} ms, its "
                f"{self._traced_steps} traced step(s) +{window_s * 1e3:.1f} ms over untraced steps"
            )
        if sampler is not None and sampler.threaded:
            parts.append(f"the sampler thread's readings {sampler.busy_s * 1e3:.1f} ms (on its own thread)")
        elif sampler is not None:
            parts.append(f"host readings at log boundaries {sampler.busy_s * 1e3:.1f} ms (included)")
        total = own_s + window_s
        return (
            f"monitoring cost, measured in this run: {total * 1e3:.1f} ms in the loop, "
            f"{total / loop_s:.2%} of its {loop_s:.2f} s: " + "; ".join(parts) + ". The per-step calls "
            "(a few us) are not timed, and set-up and close are outside the loop"
        )

    def _optimizer_facts(self, stats: RunStats) -> tuple[dict[str, Any], ...]:
        """Each optimizer's step implementation; for a for-loop over many tensors in a run whose
        optimizer phase is worth a finding, what the for-each path would take instead (measured now,
        a fraction of a second)."""
        from resource_guard.report.phase_rules import FOR_LOOP_MIN_TENSORS, OPTIMIZER_STEP_SHARE

        phase, step = (stats.phases or {}).get("optimizer", 0.0), stats.step_time_s
        worth = step is not None and step > 0 and phase / step >= OPTIMIZER_STEP_SHARE
        out = []
        for optimizer in self.optimizers:
            facts = describe_optimizer(optimizer)
            if worth and not self._probed and facts["for_loop"] and facts["tensors"] >= FOR_LOOP_MIN_TENSORS:
                self._probed = True  # at most one end-of-run probe, bounded by the measured step
                per_step = phase / max(1, len(self.optimizers))
                with self._close_part("optimizer probe"):
                    facts.update(foreach_probe(optimizer, per_step) or {})
            out.append(facts)
        return tuple(out)

    def _with_phases(self, stats: RunStats) -> RunStats:
        """``stats`` with the step split by phase; the data wait is then the loader's own ``__next__``.
        Under DDP (ranks gathered at close) the phases are the node's: each the mean over the ranks."""
        if self._ranks:
            stats = dataclasses.replace(stats, ranks=self._ranks)
            means = node_phases(self._ranks, stats.step_time_s)
            if means is not None:
                step = stats.step_time_s
                share = means["data_wait"] / step if step else None
                return dataclasses.replace(
                    stats, phases=means, data_wait_s=means["data_wait"], data_wait_share=share
                )
        if self.phases is None and not self._phase_steps and self._phase_first is None:
            return stats
        totals, steps = (
            (self._phase_sums, self._phase_steps) if self._phase_steps else self._phase_first or ({}, 0)
        )
        means = phase_means(totals, steps, stats.step_time_s)
        if means is None:
            return stats
        step = stats.step_time_s
        share = means["data_wait"] / step if step else None
        return dataclasses.replace(stats, phases=means, data_wait_s=means["data_wait"], data_wait_share=share)

    def _thread_figures(self, profile: ProfileSummary | None = None) -> dict[str, Any] | None:
        """The thread demand read at start, with the intra-op count read again now (a loop may set it
        after the monitor started: the larger of the two is what the loop ran at); when it exceeds the
        cores, the slowdown it costs, measured now on ops sized like the run's, with Python between
        them in the step's proportion (``ops_share``: the profiled step's op time over its wall time)
        (a fraction of a second, only then)."""
        from resource_guard.observe.threads import oversubscription_slowdown, typical_op_us

        demand = self._threads
        if demand is None:
            return None
        now = torch.get_num_threads()
        if now > demand.intra_op:
            demand = dataclasses.replace(demand, intra_op=now)
        out: dict[str, Any] = demand.to_dict()
        top_ops = profile.top_ops if profile is not None else ()
        ops_share = out["ops_share"] = profile.ops_share() if profile is not None else None
        out["slowdown"] = None
        if demand.oversubscribed and not self._probed:  # at most one end-of-run probe per run
            self._probed = True
            with self._close_part("threads probe"):
                out["slowdown"] = oversubscription_slowdown(demand, typical_op_us(top_ops), ops_share)
        elif demand.oversubscribed:
            self._notes.append(
                "threads: the slowdown of the oversubscribed threads was not measured (one end-of-run probe "
                "per run, and the optimizer's ran)"
            )
        return out

    def _compile_figures(self) -> dict[str, Any] | None:
        """torch.compile's recompilations, graph breaks and compile time since start (``None``: none)."""
        from resource_guard.observe.dynamo import compile_counters

        start = self._compile_start
        if start is None:
            return None
        delta = compile_counters().since(start)
        return delta.to_dict() if delta.frames or delta.graph_breaks or delta.recompiles else None

    def _memory_growth(self) -> dict[str, Any] | None:
        trend = self._guard("memory growth", self._memory.trend) if self._memory is not None else None
        return None if trend is None else trend.to_dict()

    def _planned_capacity(self) -> int | None:
        """The capacity every output shows (the memory picture's line, the report's ``capacity_bytes``):
        what the plan fitted the step into; without a plan, the monitor's (:meth:`_capacity`)."""
        if self.planned_capacity_bytes is not None:
            return self.planned_capacity_bytes
        if self.planned_fit is not None:
            return int(self.planned_fit.capacity_bytes)
        return self._capacity()

    def _plan_memory(self) -> dict[str, int | None] | None:
        """The plan's memory figures, the ones the plan's text and ``guard.json`` show: the capacity it
        fitted the step into, the usable part, the predicted peak as the device counts it and the
        estimated allocated peak (``None`` without a plan; only the capacity when the door gave only
        ``planned_capacity_bytes``)."""
        fit = self.planned_fit
        if fit is not None:
            return {
                "capacity_bytes": self._planned_capacity(),
                "usable_bytes": int(fit.usable_bytes),
                "predicted_peak_bytes": int(fit.device_total_bytes),
                "estimated_peak_bytes": int(fit.allocated_peak_bytes),
            }
        if self.planned_capacity_bytes is not None:
            return {"capacity_bytes": self.planned_capacity_bytes}
        return None

    def _draw_picture(self, timeline: Any, title: str) -> Any:
        """The memory picture with the plan's lines: the capacity it used, its usable line, its
        predicted peak (:meth:`_plan_memory`)."""
        plan = self._plan_memory() or {}
        return memory_picture(
            timeline,
            self._planned_capacity(),
            usable_bytes=plan.get("usable_bytes"),
            predicted_peak_bytes=plan.get("predicted_peak_bytes"),
            title=title,
        )

    def _capacity(self) -> int | None:
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        if self.device_spec is not None:
            return self.device_spec.memory_bytes
        if self._cuda:
            return int(torch.cuda.get_device_properties(self.device).total_memory)
        return int(psutil.virtual_memory().total)

    def _estimated_peak_bytes(self) -> int | None:
        """The estimate of what this run measures: on CUDA the allocator model's
        ``max_memory_allocated`` (tensor bytes rounded to the allocator's blocks) for the device, else
        the live tensor bytes at the step's peak (reported, never compared with the CPU's RSS)."""
        estimate = self.estimate
        if estimate is None:
            return None
        if self._comparable_estimate is not None:
            return self._comparable_estimate
        if self.planned_fit is not None:  # the plan's (guard.json's estimated_peak_bytes): one figure
            self._comparable_estimate = int(self.planned_fit.allocated_peak_bytes)
            return self._comparable_estimate
        value = estimate.peak_bytes
        if self._cuda and self.device_spec is not None:
            try:
                value = estimate.for_device(self.device_spec).allocated_peak_bytes
            except Exception:  # the allocator model is a refinement: fall back to the tensor peak
                value = estimate.peak_bytes
        self._comparable_estimate = value
        return value

    def _allocator_figures(self) -> dict[str, float]:
        """The CUDA caching allocator's reserved bytes, reserved minus allocated, and its running count
        of ``cudaMalloc`` retries (one ``memory_stats`` call, at a log boundary only)."""
        stats = torch.cuda.memory_stats(self.device)
        reserved = float(stats.get("reserved_bytes.all.current", 0))
        allocated = float(stats.get("allocated_bytes.all.current", 0))
        return {
            "memory/reserved_bytes": reserved,
            "memory/reserved_gap_bytes": max(0.0, reserved - allocated),
            "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
        }

    def _peak_memory(self, gauges: Mapping[str, tuple[float, float]]) -> float | None:
        """The interval's peak: the CUDA allocator's (then reset), else the process's RSS high-water mark
        (then reset), else the highest sampled RSS."""
        if self._cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return float(peak)
        if self._rss_reset:
            # reading and resetting VmHWM costs a few hundred us (the kernel walks the page tables):
            # at most once per sampling interval, and always at close; a high-water mark read later
            # still holds this interval's peak, so the run's peak is exact
            now = time.monotonic()
            if now - self._hwm_read_at < self.interval_s and not self._closed:
                sampled = gauges.get("host/process_rss_bytes")
                return None if sampled is None else sampled[1]
            hwm = peak_rss_bytes()
            if hwm is not None:
                self._hwm_read_at = now
                self._rss_reset = reset_peak_rss()
                return float(hwm)
        sampled = gauges.get("host/process_rss_bytes")
        return None if sampled is None else sampled[1]

    def _record_oom(self, exc: BaseException) -> OomEvent:
        """The last memory figures (read before the final interval resets the peak), snapshot, oom.json."""
        peak: float | None
        if self._cuda:
            peak = float(torch.cuda.max_memory_allocated(self.device))
        else:
            peak = peak_rss_bytes() if self._rss_reset else None
        logged = [r[METRIC_KEYS.index("memory/peak_bytes")] for r in self._intervals]
        logged = [v for v in logged if not math.isnan(v)]
        directory = self._files_dir if self.rank == 0 else None
        snapshot = None
        if self._history and directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            if self._guard("memory snapshot", memory_history, "dump", directory / SNAPSHOT_FILE):
                snapshot = str(directory / SNAPSHOT_FILE)
        event = OomEvent(
            error=OomEvent.describe(exc),
            step=self._step + 1,
            device=str(self.device),
            peak_at_oom_bytes=None if peak is None else int(peak),
            last_logged_peak_bytes=int(logged[-1]) if logged else None,
            peak_memory_source="cuda_allocated" if self._cuda else "rss",
            estimated_peak_bytes=self._estimated_peak_bytes(),
            capacity_bytes=self._planned_capacity(),
            snapshot_path=snapshot,
        )
        if directory is not None:
            self._guard("OOM record", write_oom, directory, event)
        return event

    def _project_remaining(self, step_s: float | None) -> None:
        """ETA and cost of the remaining steps at the measured step time and the device's catalog
        price (issue #13), kept for the report and logged to TensorBoard as text."""
        total = self.total_steps
        if not total or not step_s or not math.isfinite(step_s):
            return
        spec = self.device_spec
        left = remaining_run(
            spec, step_s=step_s, steps_done=self._step, total_steps=total, gpus=self.world_size
        )
        self._remaining = left
        if self._tb is not None:
            tb = self._tb
            self._guard(
                "TensorBoard",
                lambda: tb.text("projection", remaining_markdown(left), self._step, flush=False),
                off="_tb",
            )  # flushed with the interval's scalars, which follow

    def _picture(self, *, begin: bool = False) -> Any:
        """The memory picture of the pre-flight estimate (``None`` without one, or with nothing to write
        it to). ``begin=True`` (at start) starts drawing it on a background thread
        (:class:`~resource_guard.observe.picture.PictureJob`) and returns ``None``; the call at close
        then takes that drawing, waiting for it up to ``PICTURE_DEADLINE_S`` (past it the drawing writes
        ``memory.png`` itself when done, and the report's notes say so), or draws it now if nothing was
        started or the estimate changed since."""
        estimate = self.estimate
        if estimate is None or not estimate.timeline:
            return None
        if self._tb is None and self._files_dir is None:  # nowhere to put it: not drawn
            return None
        title = f"pre-flight memory of one step ({estimate.precision}) vs {self.device}"
        # the lines are the plan's: the capacity it fitted the step into (a memory_limit, not the host's
        # RAM), its usable part and its predicted peak
        key = (id(estimate), tuple((self._plan_memory() or {}).values()), self._planned_capacity(), title)
        if begin:
            timeline = estimate.timeline
            self._picture_job = PictureJob(lambda: self._draw_picture(timeline, title), key)
            return None
        job, self._picture_job = self._picture_job, None
        if job is None or job.key != key:
            return self._guard("memory picture", self._draw_picture, estimate.timeline, title)
        if not job.wait(PICTURE_DEADLINE_S):
            directory = self._files_dir
            late = directory is not None and job.write_when_done(directory / "memory.png")
            self._notes.append(
                f"the memory picture was still drawing {PICTURE_DEADLINE_S:.0f} s into the close: "
                + ("memory.png is written when it is done; " if late else "")
                + "not in TensorBoard"
            )
            return None
        return self._guard("memory picture", job.result)  # its error, if any: one warning

    def _write_outputs(self, report: Report, picture: Any = None) -> None:
        """Rank zero, at close: the report and the memory picture to TensorBoard and to ``report.md``,
        ``report.json`` and ``memory.png`` in the monitor's files directory."""
        markdown = report.to_markdown()
        remaining = self._remaining
        if remaining is not None:
            markdown += "\n\n" + remaining_markdown(remaining)
        if self._tb is not None:
            tb = self._tb
            self._guard("TensorBoard", lambda: tb.text("report", markdown, self._step), off="_tb")
            if picture is not None and self._tb is not None:
                self._guard("TensorBoard", lambda: tb.image("memory", picture, self._step), off="_tb")
        directory = self._files_dir
        if directory is None:
            return

        def write_files() -> None:
            import json

            directory.mkdir(parents=True, exist_ok=True)
            (directory / "report.md").write_text(markdown, encoding="utf-8")
            extra = {"projection": remaining} if remaining is not None else {}
            data = json.dumps({**report.to_dict(), **extra}, indent=2, default=str)
            (directory / "report.json").write_text(data, encoding="utf-8")
            if picture is not None:
                (directory / "memory.png").write_bytes(png_bytes(picture))

        self._guard("report files", write_files)


def expandable_segments() -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` (or its newer name ``PYTORCH_ALLOC_CONF``) turns on
    ``expandable_segments``."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    options = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    return options.get("expandable_segments", "").lower() == "true"


def console_summary(report: Report) -> None:
    """The one-line summary and the findings: to the ``resource_guard`` logger at INFO when it is enabled
    for INFO (plain text), else to stderr, rendered for the terminal (colour only on a TTY)."""
    if _log.isEnabledFor(logging.INFO):
        line = report.summary_line()
        extra = [f"  {f.severity} {f.id}: {f.title}" for f in report.findings if f.id != "healthy"]
        phases = phase_line(report.stats)
        _log.info("\n".join([line, *([f"  {phases}"] if phases else []), *extra]))
    else:
        from resource_guard.report.terminal import render_summary

        render_summary(report)
