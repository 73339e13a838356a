"""Run-time monitoring: :class:`RunMonitor`, the one object both front doors (``guard`` and the
Lightning callback) drive with ``start`` / ``batch_ready`` / ``step_end`` / ``close``.

It combines the background :class:`~resource_guard.observe.sampler.Sampler` (host and NVML gauges), the
per-step :class:`~resource_guard.observe.throughput.StepTimer` (data wait vs compute, throughput, MFU), the
allocated memory at some step ends (:class:`~resource_guard.observe.growth.MemoryWatch`, for the
``memory-growth`` finding), a bounded :class:`~resource_guard.observe.profiling.StepProfiler` window and
TensorBoard output (:mod:`resource_guard.report.tensorboard`); at ``close`` it builds the
:class:`~resource_guard.Report`.

Contract: nothing raised inside monitoring reaches the training loop. Each failing part (NVML, psutil,
the writer, the profiler) gives one ``ResourceGuardWarning`` and is switched off; only ``start()``
raises, for a log dir that cannot be written. The first interval is the first step alone (start-up:
data-loader workers, lazy inits); the run-level figures leave it out. Under ``torch.distributed``
every rank aggregates each interval (one collective per log boundary; every rank must reach the same
step counts): gauges and times are the mean over ranks (``*_max`` tags add the slowest rank), peak
memory the maximum, throughput the job's total; rank zero alone writes. At close one more gather brings
every rank's own step time and phases to every rank: the report's phases are the node's (the mean
rank's) and the ``straggler`` finding names a rank the others wait for. A monitor given no rank
(``guard``) takes its rank and world size from the initialised process group at ``start``. The
end-of-run summary goes to the ``resource_guard`` logger at INFO when that logger is enabled for INFO,
else to stderr (``summary=False`` silences it).

The interval arithmetic is in :mod:`resource_guard.observe.stats`; what is recorded at each log
boundary and written at close, in :mod:`resource_guard.observe.outputs`.

Example:
    >>> import torch
    >>> mon = RunMonitor(None, interval_s=0.05, profile=False, summary=False)
    >>> mon.start()
    >>> for _ in range(3):
    ...     mon.batch_ready(torch.zeros(8, 4)); mon.step_end()
    >>> mon.close().stats.steps
    3
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from resource_guard.errors import ConfigurationError, warn_at_user
from resource_guard.observe.dynamo import compile_counters
from resource_guard.observe.growth import MemoryWatch, batch_signature, cpu_allocated_bytes
from resource_guard.observe.oom import OomEvent, is_oom, memory_history
from resource_guard.observe.outputs import MonitorOutputs, console_summary
from resource_guard.observe.phases import PhaseClock
from resource_guard.observe.picture import PICTURE_DEADLINE_S
from resource_guard.observe.profiling import ProfileWindow, StepProfiler
from resource_guard.observe.sampler import Sampler, reset_peak_rss
from resource_guard.observe.stats import METRIC_KEYS
from resource_guard.observe.threads import local_processes, thread_demand
from resource_guard.observe.throughput import StepTimer, batch_counts, count_flops
from resource_guard.report.findings import Report, analyze, available_cores
from resource_guard.report.tensorboard import TBLog
from resource_guard.step.training import iter_tensors

if TYPE_CHECKING:  # estimate (and its tracer) is not imported at run time
    from resource_guard.devices import DeviceSpec
    from resource_guard.estimate import MemoryEstimate
    from resource_guard.estimate.allocation.allocator import DeviceFit

__all__ = [
    "LOG_EVERY_STEP_UNTIL",
    "LOG_INTERVAL_S",
    "METRIC_KEYS",
    "ProfileWindow",
    "RunMonitor",
    "count_flops",
]

_clock = time.perf_counter
# the time-bounded log cadence (``RunMonitor(log_every_n_steps=None)``, the default): every step for the
# first 20 steps (a short run's curves have a point per step; one boundary costs ~0.3 ms), then about
# one boundary every 2 s; at most 1000 steps apart (a loop whose steps speed up still logs)
LOG_EVERY_STEP_UNTIL = 20
LOG_INTERVAL_S = 2.0
LOG_MAX_STEPS = 1000


class RunMonitor(MonitorOutputs):
    """Monitors a training run and reports where the time went.

    Args:
        log_dir: directory for TensorBoard events, ``report.md``/``report.json``, the memory PNG and the
            profiler trace (rank zero); ``None`` writes no files (unless ``writer`` has a ``log_dir``).
        device: the training device. ``cuda`` enables NVML sampling, CUDA events and allocator peaks.
        interval_s: seconds between background samples.
        log_every_n_steps: steps per logged interval (a log boundary after step 1 and every n-th step);
            ``None`` (the default): time-bounded, every step for the first
            :data:`LOG_EVERY_STEP_UNTIL` steps (a short run is logged step by step), then one boundary
            about every ``log_interval_s`` seconds (see :meth:`_schedule_log`).
        log_interval_s: with ``log_every_n_steps=None``, the seconds between two log boundaries after
            the first steps (:data:`LOG_INTERVAL_S` by default).
        profile: a :class:`ProfileWindow`, ``True`` for the default window, ``False`` for none.
        estimate: the pre-flight :class:`~resource_guard.MemoryEstimate` (drift, memory PNG).
        capacity_bytes: device capacity the measured peak is held against; default from
            ``device_spec``, CUDA or the host RAM.
        planned_capacity_bytes: the capacity the plan fitted the step into (a ``memory_limit``, or the
            device's), drawn as the memory picture's capacity line; default ``planned_fit``'s, else
            ``capacity_bytes``'s.
        planned_fit: the plan's :class:`~resource_guard.estimate.allocation.allocator.DeviceFit`
            (``Plan.fit``): its capacity, usable line (``usable_bytes``), predicted peak
            (``device_total_bytes``) and estimated allocated peak are what the report
            (``report.json``'s ``capacity_bytes``, ``usable_bytes``, ``predicted_peak_bytes``,
            ``estimated_peak_bytes``), the memory picture and the CUDA memory scalars show, the same
            figures as the plan's text and ``guard.json``.
        device_spec: catalog facts (peak TFLOP/s for MFU, bf16/TF32/tensor cores for the rules).
        writer: an existing ``SummaryWriter`` (never closed here); ``None`` creates one in ``log_dir``.
        rank / world_size: this process's rank; only rank zero writes.
        stall_threshold: data-wait share from which an interval (and the run) counts as input-bound.
        loader_info: ``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``.
        flops_per_step: FLOPs of one step (see :func:`count_flops`) for MFU.
        precision: the Lightning precision name the run trains in.
        summary: print the one-line summary at the end (rank zero).
        memory_history: on a CUDA run, record the allocator's history and dump it into
            ``memory_snapshot.pickle`` when the run ends with an OOM (see :mod:`resource_guard.observe.oom`).
        phase_timing: keep a :class:`~resource_guard.observe.phases.PhaseClock` (:attr:`phases`) that the
            front door switches at its boundaries; the report then splits the step by phase
            (:attr:`RunStats.phases`) and takes the data wait from the loader's own ``__next__``. Off, the
            data wait is the time between a ``step_end`` and the next ``batch_ready``.

    ``shape_stats``: set by a front door to a callable returning its shape guard's counts (shapes
    seen, splits, stops); read once, at close, into :attr:`RunStats.shapes`. ``optimizers``: set by a
    front door to its optimizers, described at close into :attr:`RunStats.optimizers`.
    """

    shape_stats: Any = None
    optimizers: Any = ()

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None,
        *,
        device: torch.device | str = "cpu",
        interval_s: float = 1.0,
        log_every_n_steps: int | None = None,
        log_interval_s: float = LOG_INTERVAL_S,
        profile: ProfileWindow | bool = True,
        estimate: MemoryEstimate | None = None,
        capacity_bytes: int | None = None,
        planned_capacity_bytes: int | None = None,
        planned_fit: DeviceFit | None = None,
        device_spec: DeviceSpec | None = None,
        writer: Any | None = None,
        rank: int = 0,
        world_size: int = 1,
        stall_threshold: float = 0.05,
        loader_info: Mapping[str, Any] | None = None,
        flops_per_step: float | None = None,
        precision: str | None = None,
        summary: bool = True,
        memory_history: bool = False,
        phase_timing: bool = False,
    ) -> None:
        def bad(name: str, value: Any, allowed: str) -> ConfigurationError:
            return ConfigurationError(f"`RunMonitor({name}={value!r})` must be {allowed}")

        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise bad("device", device, "a torch device such as 'cpu' or 'cuda:0'") from exc
        if not (isinstance(interval_s, (int, float)) and 0 < interval_s < math.inf):
            raise bad("interval_s", interval_s, "a number of seconds > 0")
        if log_every_n_steps is not None and (
            not isinstance(log_every_n_steps, int)
            or isinstance(log_every_n_steps, bool)
            or log_every_n_steps < 1
        ):
            raise bad("log_every_n_steps", log_every_n_steps, "an int >= 1, or None (time-bounded)")
        if not (
            isinstance(log_interval_s, (int, float))
            and not isinstance(log_interval_s, bool)
            and 0 < log_interval_s < math.inf
        ):
            raise bad("log_interval_s", log_interval_s, "a number of seconds > 0")
        if profile is True:
            profile = ProfileWindow()
        if not (profile is False or profile is None or isinstance(profile, ProfileWindow)):
            raise bad("profile", profile, "a ProfileWindow, True or False")
        if not (isinstance(stall_threshold, (int, float)) and 0 < stall_threshold < 1):
            raise bad("stall_threshold", stall_threshold, "in (0, 1)")
        if not (
            isinstance(world_size, int)
            and world_size >= 1
            and isinstance(rank, int)
            and 0 <= rank < world_size
        ):
            raise bad("rank", rank, f"an int in [0, world_size={world_size!r})")
        capacities = {"capacity_bytes": capacity_bytes, "planned_capacity_bytes": planned_capacity_bytes}
        for name, value in capacities.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise bad(name, value, "a positive int or None")
        if planned_fit is not None and not all(
            isinstance(getattr(planned_fit, k, None), int)
            for k in ("capacity_bytes", "usable_bytes", "device_total_bytes", "allocated_peak_bytes")
        ):
            raise bad("planned_fit", planned_fit, "the plan's DeviceFit (Plan.fit) or None")
        if flops_per_step is not None and not (
            isinstance(flops_per_step, (int, float)) and flops_per_step > 0
        ):
            raise bad("flops_per_step", flops_per_step, "a number > 0 or None")
        if not isinstance(memory_history, bool):
            raise bad("memory_history", memory_history, "True or False")
        if precision is not None:
            from resource_guard.step.precision import parse_precision

            precision = parse_precision(precision).name
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.interval_s = float(interval_s)
        self.log_every_n_steps = log_every_n_steps
        self.log_interval_s = float(log_interval_s)
        self._next_log = 1  # the step of the next log boundary (time-bounded cadence)
        self.profile_window: ProfileWindow | None = profile or None
        self.estimate, self.capacity_bytes, self.device_spec = estimate, capacity_bytes, device_spec
        self.planned_capacity_bytes = planned_capacity_bytes
        self.planned_fit = planned_fit
        self.rank, self.world_size, self.stall_threshold = rank, world_size, float(stall_threshold)
        self.loader_info = dict(loader_info or {})
        self.flops_per_step, self.precision, self.summary = flops_per_step, precision, summary
        self.memory_history = memory_history
        self.phase_timing = bool(phase_timing)
        self.phases: PhaseClock | None = None  # the front door switches it (phase_timing=True), from start
        self._phase_sums: dict[str, float] = {}
        self._phase_steps = 0
        self.total_steps: int | None = None  # set by the front door when known: ETA and cost of the rest
        self._remaining: dict[str, Any] | None = None
        self.report: Report | None = None
        self._history = False
        self._oom: OomEvent | None = None
        self._writer_arg = writer
        self._tb: TBLog | None = None
        self._sampler: Sampler | None = None
        self._profiler: StepProfiler | None = None
        self._timer: StepTimer | None = None
        self._cuda = False
        self._events: list[tuple[Any, Any]] = []
        self._open_event: Any = None
        self._rss_reset = False
        self._memory: MemoryWatch | None = None
        self._counts: dict[Any, tuple[int, int]] = {}  # (samples, tokens) by batch signature
        self._signature: Any = None
        self._nested: Any = None  # a batch without a flat signature, until its step ends
        self._step = 0
        self._traced: tuple[Any, Any] | None = None  # the figures held before a step the profiler traces
        self._intervals: list[tuple[float, ...]] = []
        self._started = self._closed = self._broken = False
        self._notes: list[str] = []
        self._own_s = 0.0  # the monitor's own work inside the loop (log boundaries, memory reads, profiler)
        self._profiler_s = 0.0  # of which the profiler's steps (starting, stopping the window)
        self._picture_wait_s = 0.0  # of which the wait for the memory picture before the window
        self.close_s: float | None = None  # how long close() took, once closed

    # -- life cycle ------------------------------------------------------------------------------
    @property
    def _files_dir(self) -> Path | None:
        if self.log_dir is not None:
            return self.log_dir
        found = getattr(self._writer_arg, "log_dir", None)
        return None if found is None else Path(found)

    def start(self) -> None:
        """Check the log dir (raises ``ConfigurationError``), then start sampling and timing. Idempotent."""
        if self._started or self._closed:
            return
        if self.world_size == 1 and _distributed():  # a door that did not say (guard): the process group's
            import torch.distributed as dist

            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.rank == 0 and self.log_dir is not None:
            try:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=self.log_dir):
                    pass
            except OSError as exc:
                raise ConfigurationError(
                    f"`RunMonitor(log_dir={str(self.log_dir)!r})` is not a writable directory: {exc}. "
                    "Pass a directory you can write to, or log_dir=None to write no files."
                ) from exc
        self._started = True
        self._cuda = self.device.type == "cuda"
        self._guard("CUDA timing", self._setup_cuda)
        if self.memory_history and self._cuda:
            self._history = bool(self._guard("memory history", memory_history, "start"))
        if self.device_spec is None and self._cuda:
            self._guard("device detection", self._detect_device)
        if self.rank == 0 and (self.log_dir is not None or self._writer_arg is not None):
            self._tb = TBLog(self._writer_arg, self.log_dir)
            self._guard("TensorBoard", self._tb.layout, cuda=self._cuda, off="_tb")
        gpus: tuple[int, ...] = ()
        if self.device.type == "cuda":  # every visible GPU; under DDP each rank samples its own
            own = self.device.index or 0
            gpus = (own,) if self.world_size > 1 else tuple(range(max(own + 1, _visible_gpu_count())))
        # without GPUs to read, no thread: host gauges are read at log boundaries (see Sampler)
        self._sampler = Sampler(self.interval_s, gpus, threaded=bool(gpus))
        self._guard("sampler", self._sampler.start, off="_sampler")
        if self.profile_window is not None:
            trace_dir = self._files_dir / "profiler" if self.rank == 0 and self._files_dir else None
            self._profiler = StepProfiler(
                self.profile_window, trace_dir, device_type=self.device.type, trace_name=f"rank{self.rank}"
            )
            self._guard("profiler", self._profiler.start, off="_profiler")
        profiler = self._profiler
        if self.rank == 0 and not (profiler is not None and profiler.traces_next_step):
            # drawn while the first step trains, waited for at its end (see step_end)
            self._guard("memory picture", self._picture, begin=True)
        self._rss_reset = not self._cuda and reset_peak_rss()
        self._guard("memory growth", self._watch_memory)
        self._guard("thread and compile figures", self._read_settings)
        now = _clock()
        if self.phase_timing:
            self.phases = PhaseClock(now, _clock)
        self._timer = StepTimer(now)

    def set_loader_info(self, info: Mapping[str, Any]) -> None:
        """The loader's settings, once the door reaches the loader (``g.iterate(loader)``, after
        ``start``): the report's loader advice and the threads' demand (its workers) use them."""
        if not info:
            return
        self.loader_info.update(info)
        if self._timer is not None:  # started: the demand was read with no workers
            workers = self.loader_info.get("num_workers")
            self._guard("thread and compile figures", self._thread_demand, workers)

    def _thread_demand(self, workers: Any) -> None:
        self._threads = thread_demand(
            intra_op=torch.get_num_threads(),
            processes=local_processes(self.world_size),
            workers=workers if isinstance(workers, int) else 0,
            cores=available_cores(),
        )

    def _read_settings(self) -> None:
        """Threads against cores, and dynamo's counters (the difference is taken at close)."""
        self._thread_demand(self.loader_info.get("num_workers"))
        self._compile_start = compile_counters()

    def _watch_memory(self) -> None:
        """Allocated memory at step ends, for the ``memory-growth`` finding (:mod:`.growth`)."""
        if self._cuda:
            device = self.device
            self._memory = MemoryWatch(lambda: torch.cuda.memory_allocated(device), "cuda_allocated")
        else:
            source = cpu_allocated_bytes()[1]
            self._memory = MemoryWatch(lambda: cpu_allocated_bytes()[0], source)

    def _setup_cuda(self) -> None:
        if self._cuda and not torch.cuda.is_available():
            self._cuda = False
            raise RuntimeError(f"device {self.device} was given but CUDA is not available")
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _detect_device(self) -> None:
        from resource_guard.devices import detect_local_devices

        index = self.device.index or 0
        self.device_spec = next(
            (d for d in detect_local_devices() if d.index == index and d.kind == "cuda"), None
        )

    def batch_ready(self, batch: Any) -> None:
        """A batch arrived: the data wait ends and compute begins. Infers samples and tokens.

        The hot path: a time stamp and the batch's signature (its tensors' shapes and dtypes), by which
        the samples and tokens of a shape seen before are looked up rather than counted again.
        """
        timer = self._timer
        if timer is None or self._broken:
            return
        now = _clock()
        try:
            signature = batch_signature(batch)
            counts = self._counts.get(signature) if signature is not None else None
            if counts is None:
                counts = batch_counts(batch)
                if signature is not None and len(self._counts) < 4096:
                    self._counts[signature] = counts
                else:
                    self._nested = batch
            timer.batch_ready(now, *counts)
            self._signature = signature
            if self._cuda and self._open_event is None:
                self._open_event = torch.cuda.Event(enable_timing=True)
                self._open_event.record()
        except Exception as exc:
            self._break(exc)

    def step_end(self) -> None:
        """One (micro) step finished: advances the profiler; logs at interval boundaries."""
        timer = self._timer
        if timer is None or self._broken:
            return
        try:
            now = _clock()
            timer.step_end(now)
            phases = self.phases
            if phases is not None:
                phases.charge(now)
            self._step += 1
            traced, self._traced = self._traced, None
            if traced is not None:  # the profiler traced this step: its time stays out of the means
                self._drop_traced(traced, now, step=True)
            own_work = False  # the monitor's own time since ``now``: left out of the step's phases
            memory = self._memory
            # not while the profiler records: its event buffers grow host memory step by step
            if memory is not None and self._step >= memory.next_step and not self._profiling():
                self._guard("memory growth", self._sample_memory, memory, off="_memory")
                own_work = True
            self._nested = None
            if self._open_event is not None:
                if traced is None:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self._events.append((self._open_event, end))
                self._open_event = None
            if self._step == 1 and self._picture_job is not None and not self._picture_job.done:
                # the memory picture is drawn while the start-up step runs (left out of the run's
                # figures); the rest is waited for here, before the step-1 boundary (a collective under
                # DDP), so no measured step, nor the profiler's window, shares the interpreter with it
                begun = _clock()
                self._picture_job.wait(PICTURE_DEADLINE_S)
                self._picture_wait_s += _clock() - begun
                own_work = True
            if self._profiling():  # a few steps of the run: the window's own cost is timed apart
                begun = _clock()
                self._guard("profiler", self._profiler.step, off="_profiler")  # type: ignore[union-attr]
                self._profiler_s += _clock() - begun
                own_work = True
            if self._log_due():
                # the interval ends with the step, before the monitor's own work above: that work is
                # then out of both clocks alike (skipped below), not of the step time alone
                self._log_interval(now)
                if self._sampler is not None:
                    self._warn_sampler()
                own_work = True
            if own_work:  # on most steps nothing: no second clock read
                later = _clock()
                self._own_s += later - now  # the monitor's cost, stated in the report
                now = later
                timer.resume(now)  # profiling and logging are the monitor's time, not a data wait
                if phases is not None:
                    phases.skip(now)
            # a traced step is left out of the means once the run measured one besides the start-up
            # step and this one (a window at the run's first steps keeps them, having nothing else)
            measured = self._step - self._traced_steps
            if measured > 2 and self._profiling() and self._profiler.traces_next_step:  # type: ignore[union-attr]
                self._traced = (timer.hold(), None if phases is None else phases.hold())
        except Exception as exc:
            self._break(exc)

    def _log_due(self) -> bool:
        """Whether the step just ended closes a logged interval."""
        every = self.log_every_n_steps
        if every is not None:
            return self._step == 1 or self._step % every == 0
        return self._step >= self._next_log

    def _schedule_log(self, step_s: float | None) -> None:
        """After a log boundary (time-bounded cadence): the next one is the next step while the run is
        in its first :data:`LOG_EVERY_STEP_UNTIL` steps, then ``log_interval_s`` seconds of steps
        ahead at ``step_s``, the job's mean step time of the interval just logged. Under
        ``torch.distributed`` that figure is the same on every rank (the row is aggregated), so every
        rank reaches the same boundaries (each is a collective) without exchanging a clock."""
        if self.log_every_n_steps is not None:
            return
        steps = 1
        if self._step >= LOG_EVERY_STEP_UNTIL and step_s is not None and math.isfinite(step_s) and step_s > 0:
            steps = max(1, min(LOG_MAX_STEPS, int(self.log_interval_s / step_s)))
        self._next_log = self._step + steps

    def _drop_traced(self, held: tuple[Any, Any], now: float, *, step: bool) -> None:
        """Leave the time since ``held`` (a step the profiler traced) out of the step time and phases:
        recording shapes and stacks slows every op, most in op-heavy steps, so a traced step would
        inflate the mean and the phases the ops run in (a for-loop optimizer's 360 small ops)."""
        assert self._timer is not None  # internal invariant: held only after start()
        self._traced_s += self._timer.drop_since(held[0], now)
        if held[1] is not None and self.phases is not None:
            self.phases.drop_since(held[1], now)
        self._traced_steps += step

    def note(self, text: str) -> None:
        """Add a line to the report's notes (e.g. the evaluation step's pre-flight)."""
        self._notes.append(str(text))

    def _profiling(self) -> bool:
        profiler = self._profiler
        return profiler is not None and profiler.running

    def _sample_memory(self, memory: MemoryWatch) -> None:
        signature = self._signature
        if signature is None and self._nested is not None:  # nested batch: its shapes, at this step only
            signature = tuple(tuple(t.shape) for t in iter_tensors(self._nested))
        memory.sample(self._step, signature)

    @property
    def steps(self) -> int:
        """Steps (``step_end`` calls) recorded so far."""
        return self._step

    def close(self, exc: BaseException | None = None) -> Report | None:
        """Stop everything, write the report (rank zero) and return it. Idempotent; never raises."""
        if self._closed:
            return self.report
        self._closed = True
        begun = _clock()
        self._close_parts = {}
        if self._profiler is not None:
            self._guard("profiler", self._profiler.stop, off="_profiler")
        if self._sampler is not None:
            self._sampler.stop()
        if exc is not None:
            self._notes.append(f"the run ended with {type(exc).__name__}: {exc}")
        if is_oom(exc) and self._started:
            assert exc is not None  # for mypy: is_oom(None) is False
            self._oom = self._guard("OOM record", self._record_oom, exc)
        if self._history:
            self._history = False
            self._guard("memory history", memory_history, "stop")
        if self._traced is not None and self._timer is not None:  # ended inside a traced step
            self._guard("step timing", self._drop_traced, self._traced, _clock(), step=False)
            self._traced = None
        if self._traced_steps:
            self._notes.append(
                f"{self._traced_steps} step(s) that the profiler traced are left out of the step time and "
                "phases (recording slows every op); the op breakdown comes from them"
            )
        collective = exc is None or not _distributed()
        if self._timer is not None and not self._broken and self._timer.steps:
            self._guard("interval logging", lambda: self._log_interval(_clock(), collective=collective))
        if self._timer is not None and not self._broken and collective:
            with self._close_part("rank gather"):
                self._guard("rank figures", self._gather_ranks)
        if self._sampler is not None:
            self._warn_sampler()
        if not self._started:
            return None
        summary = None
        if self._profiler is not None:
            with self._close_part("profile summary"):
                summary = self._guard("profiler", self._profiler.summarize, off="_profiler")
        picture = None
        if self.rank == 0:
            with self._close_part("memory picture"):
                picture = self._picture()
            if self._picture_wait_s >= 0.01:
                self._notes.append(
                    f"the memory picture, drawn on a thread during the first step, held the loop "
                    f"{self._picture_wait_s * 1e3:.0f} ms at its end (included in the monitoring cost)"
                )
        stats = self._guard("report", self._run_stats, summary)
        if stats is not None:  # the close's own time so far, shown in the report
            parts = {k: round(v, 3) for k, v in self._close_parts.items() if v >= 0.01}
            stats = dataclasses.replace(stats, close_s=round(_clock() - begun, 3), close_parts=parts)
        self.report = None if stats is None else self._guard("report", analyze, stats)
        if self.rank == 0 and self.report is not None:
            self._write_outputs(self.report, picture)
            if self.summary:
                console_summary(self.report)
        if self._tb is not None:
            self._guard("TensorBoard", self._tb.close, off="_tb")
        self.close_s = _clock() - begun
        return self.report

    # -- degrading -------------------------------------------------------------------------------
    def _guard(self, part: str, fn: Any, *args: Any, off: str | None = None, **kwargs: Any) -> Any:
        """``fn(*args)``; on any exception one warning, and the attribute ``off`` set to None."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if off is not None:
                obj = getattr(self, off, None)
                setattr(self, off, None)
                release = getattr(obj, "close", None) or getattr(obj, "stop", None)
                if release is not None:  # a part switched off still lets go of its thread and files
                    with contextlib.suppress(Exception):  # already reporting the first error
                        release()
            _warn(f"{part} disabled: {type(exc).__name__}: {exc}")
            return None

    def _break(self, exc: BaseException) -> None:
        self._broken = True
        self.phases = None
        if self._profiler is not None:
            self._guard("profiler", self._profiler.stop, off="_profiler")
        _warn(f"monitoring stopped for the rest of the run: {type(exc).__name__}: {exc}")

    def _warn_sampler(self) -> None:
        assert self._sampler is not None  # internal invariant
        for message in self._sampler.pop_messages():
            _warn(message)


def _warn(message: str) -> None:
    warn_at_user(f"resource_guard monitoring: {message}")


def _distributed() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _visible_gpu_count() -> int:
    try:
        return int(torch.cuda.device_count())
    except Exception:
        return 0
