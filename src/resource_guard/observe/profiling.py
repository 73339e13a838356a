"""A bounded torch.profiler window over a few training steps, and what the report needs from it.

:class:`ProfileWindow` is the setting (how many steps to skip, wait, warm up and record);
:class:`StepProfiler` runs ``torch.profiler`` over exactly that window (CPU, plus CUDA where
available), stops it as soon as the window is recorded (no profiler is left running, also after an
exception: :meth:`StepProfiler.stop`), writes the Chrome trace gzipped into the log dir (deleted again
if larger than ``max_trace_bytes``) and condenses the events into a :class:`ProfileSummary`: step wall
time, kernel count and sizes, host-to-device copy time, matmul shapes and dtypes. The heavy part
(trace export, key averages) happens in :meth:`StepProfiler.summarize`, called once at the end of
the run, not inside the training loop.

Example:
    >>> ProfileWindow(active=2).steps_needed
    9
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import gzip
import shutil
import statistics
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.host.quiet import native_stderr_silenced
from resource_guard.observe.opclasses import EventRecord, op_breakdown
from resource_guard.observe.profile_events import MATMUL_OPS as _MATMUL_OPS
from resource_guard.observe.profile_events import op_sites
from resource_guard.observe.profile_events import records as _records
from resource_guard.report.types import ProfileSummary

__all__ = ["ProfileWindow", "ProfileSummary", "EventRecord", "StepProfiler", "summarize_events", "op_sites"]

_TOP_OPS = 10
_MAX_SHAPES = 20


@dataclass(frozen=True)
class ProfileWindow:
    """Which steps torch.profiler records (``torch.profiler.schedule`` with ``repeat=1``).

    Attributes:
        wait: steps idle after ``skip_first`` before warming up.
        warmup: steps traced but discarded (the profiler's own start-up cost lands here).
        active: steps recorded (at most 20: the window is meant to be small).
        skip_first: steps left alone at the start of the run (data-loader start, lazy inits).
        max_trace_bytes: a gzipped trace above this size is deleted (the summary is kept).
        record_shapes: record input shapes and dtypes (needed by the alignment and precision rules).
        with_stack: record the Python stack of each op (the user's lines behind syncs and casts);
            like everything else here it costs only inside the warm-up and active steps.
    """

    wait: int = 1
    warmup: int = 1
    active: int = 3
    skip_first: int = 5
    max_trace_bytes: int = 50 * 2**20
    record_shapes: bool = True
    with_stack: bool = True

    def __post_init__(self) -> None:
        for name, low in (
            ("wait", 0),
            ("warmup", 0),
            ("active", 1),
            ("skip_first", 0),
            ("max_trace_bytes", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigurationError(f"`ProfileWindow({name}={value!r})` must be an int >= {low}")
        if self.active > 20:
            raise ConfigurationError(
                f"`ProfileWindow(active={self.active!r})` must be <= 20 (a bounded window)"
            )

    @property
    def steps_needed(self) -> int:
        """Steps the run must have for the window to complete."""
        return self.skip_first + self.wait + self.warmup + self.active


def _misaligned(shapes: tuple[tuple[int, ...], ...]) -> bool:
    """A matrix dimension (last two of each 2-D+ input) that is not a multiple of 8."""
    return any(d % 8 for s in shapes if len(s) >= 2 for d in s[-2:])


def summarize_events(events: Iterable[EventRecord], steps: int) -> ProfileSummary:
    """Condense a window's events into a :class:`ProfileSummary` (a pure function).

    ``ProfilerStep#`` events give the step wall time; device events the kernels and copies;
    matmul ops (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``) their shapes and dtypes; all of them
    the time by op class, call sites and exposed communication
    (:func:`resource_guard.observe.opclasses.op_breakdown`). Python frames (``with_stack``) are not ops.
    """
    events = list(events)
    classes = op_breakdown(events, steps)
    per = max(steps, 1)
    step_walls, kernels, device_us, h2d, h2d_pageable = [], [], 0.0, 0.0, 0.0
    matmul_us = fp32_us = misaligned_us = 0.0
    misaligned: dict[tuple[str, tuple[tuple[int, ...], ...]], None] = {}
    ops: dict[str, list[float]] = {}
    for ev in events:
        if ev.name.startswith("ProfilerStep"):
            step_walls.append(ev.duration_us)
            continue
        if ev.python:
            continue
        if ev.on_device:
            device_us += ev.duration_us
            if "Memcpy HtoD" in ev.name:
                h2d += ev.duration_us
                if "Pageable" in ev.name:
                    h2d_pageable += ev.duration_us
            elif not ev.name.startswith(("Memcpy", "Memset")):
                kernels.append(ev.duration_us)
            continue
        row = ops.setdefault(ev.name, [0, 0.0])
        row[0] += 1
        row[1] += ev.duration_us
        if ev.name in _MATMUL_OPS:
            matmul_us += ev.duration_us
            if ev.input_dtypes and all(d in ("float", "") for d in ev.input_dtypes[-2:]):
                fp32_us += ev.duration_us
            if _misaligned(ev.input_shapes):
                misaligned_us += ev.duration_us
                if len(misaligned) < _MAX_SHAPES:
                    misaligned[(ev.name, ev.input_shapes)] = None
    top = sorted(ops.items(), key=lambda kv: -kv[1][1])[:_TOP_OPS]
    return ProfileSummary(
        steps=steps,
        step_wall_us=statistics.median(step_walls) if step_walls else None,
        device_busy_us=device_us / per,
        kernel_count=len(kernels) / per,
        median_kernel_us=statistics.median(kernels) if kernels else None,
        h2d_us=h2d / per,
        h2d_pageable_us=h2d_pageable / per,
        matmul_us=matmul_us / per,
        fp32_matmul_us=fp32_us / per,
        misaligned_matmuls=tuple(misaligned),
        misaligned_matmul_us=misaligned_us / per,
        top_ops=tuple((name, round(n / per), round(us / per, 1)) for name, (n, us) in top),
        op_timeline=classes.timeline,
        op_class_us=tuple((c, round(us, 1)) for c, us in classes.class_us),
        syncs_per_step=classes.syncs,
        sync_idle_us=classes.sync_idle_us,
        sync_sites=classes.sync_sites,
        cast_sites=classes.cast_sites,
        comm_us=classes.comm_us,
        exposed_comm_us=classes.exposed_comm_us,
        op_class_spread_us=tuple((c, round(us, 1)) for c, us in classes.class_spread_us),
        stalls=classes.stalls,
    )


class StepProfiler:
    """torch.profiler over one :class:`ProfileWindow`. Call :meth:`step` after every training step.

    Args:
        window: which steps to record.
        trace_dir: where the gzipped trace goes (``None``: no trace file).
        device_type: ``"cuda"`` adds CUDA activity when CUDA is available.
        trace_name: file name stem of the trace (e.g. ``"rank0"``).

    Errors from torch.profiler propagate to the caller (the monitor turns them into one warning).
    """

    def __init__(
        self,
        window: ProfileWindow,
        trace_dir: Path | None,
        *,
        device_type: str = "cpu",
        trace_name: str = "rank0",
    ) -> None:
        self.window = window
        self._trace_dir = trace_dir
        self._device_type = device_type
        self._trace_name = trace_name
        self._prof: Any = None
        self._captured: Any = None
        self._steps_seen = 0
        self._finished = False
        self._cut_short = False

    @property
    def running(self) -> bool:
        return self._prof is not None

    @property
    def traces_next_step(self) -> bool:
        """Whether the step after the last :meth:`step` runs traced (the schedule's warm-up or active
        steps): slowed by the profiler's own work (``record_shapes``, ``with_stack``)."""
        w = self.window
        return self._prof is not None and w.skip_first + w.wait <= self._steps_seen < w.steps_needed

    def start(self) -> None:
        """Start the profiler (idempotent). Nothing is recorded before ``skip_first + wait`` steps."""
        if self._prof is not None or self._finished:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device_type == "cuda" and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        w = self.window
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=w.wait, warmup=w.warmup, active=w.active, repeat=1, skip_first=w.skip_first
            ),
            on_trace_ready=self._on_trace_ready,
            record_shapes=w.record_shapes,
            with_stack=w.with_stack,
        )
        with native_stderr_silenced():  # Kineto's native `profiler_start` line is not the user's
            prof.start()
        self._prof = prof

    def _on_trace_ready(self, prof: Any) -> None:
        self._captured = prof

    def step(self) -> None:
        """Advance the schedule; stops the profiler as soon as the window has been recorded."""
        prof = self._prof
        if prof is None:
            return
        self._steps_seen += 1
        with native_stderr_silenced():  # the schedule starts/stops Kineto inside step()
            prof.step()
        if self._captured is not None or self._steps_seen >= self.window.steps_needed:
            self.stop()

    def stop(self) -> None:
        """Stop the profiler now (idempotent); a window cut short keeps what it recorded."""
        prof, self._prof = self._prof, None
        if prof is not None:
            self._finished = True
            recorded = self._captured is not None
            with native_stderr_silenced():
                prof.stop()
            self._cut_short = not recorded and self._captured is not None

    def summarize(self) -> ProfileSummary | None:
        """Summary of the recorded window and the trace file; ``None`` if nothing was recorded."""
        self.stop()
        prof, self._captured = self._captured, None
        if prof is None:
            return None
        notes: list[str] = []
        # the trace is written first (torch holds the interpreter lock for it); its compression runs on a
        # thread while the events are read (zlib lets go of the lock)
        trace = self._export(prof)
        try:
            with _gc_paused():  # tens of thousands of short-lived tuples: no full collection in between
                records = _records(prof)
                if self._cut_short:  # the last ProfilerStep span runs from the last step() to stop()
                    last = max(
                        (i for i, r in enumerate(records) if r.name.startswith("ProfilerStep")), default=None
                    )
                    records = [r for i, r in enumerate(records) if i != last]
                steps = sum(1 for r in records if r.name.startswith("ProfilerStep"))
                if steps < self.window.active:
                    notes.append(
                        f"the run ended inside the profiler window: {steps} of {self.window.active} steps"
                    )
                summary = summarize_events(records, steps)
        finally:
            path = None if trace is None else trace.finish(notes)
        return dataclasses.replace(summary, trace_path=path, notes=tuple(notes))

    def _export(self, prof: Any) -> _TraceFile | None:
        """Write the window's Chrome trace as JSON and start compressing it (see :class:`_TraceFile`)."""
        if self._trace_dir is None:
            return None
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        path = self._trace_dir / f"{self._trace_name}.pt.trace.json.gz"
        return _TraceFile(prof, path, self.window.max_trace_bytes)


class _TraceFile:
    """The window's gzipped Chrome trace at ``path``: torch writes the JSON (a ".gz" path it would gzip
    line by line at level 9: 0.6 s for a 15,000-event window); it is compressed here at level 1 in 1 MiB
    blocks (a few times faster), on a thread of its own, while the caller goes on; :meth:`finish` waits
    for it and deletes a file larger than ``max_bytes``."""

    def __init__(self, prof: Any, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        self._scratch = tempfile.TemporaryDirectory(dir=path.parent)
        self._error: BaseException | None = None
        try:
            plain = Path(self._scratch.name) / "trace.json"
            prof.export_chrome_trace(str(plain))
        except BaseException:
            self._scratch.cleanup()
            raise
        self._thread = threading.Thread(target=self._compress, args=(plain,), daemon=True)
        self._thread.start()

    def _compress(self, plain: Path) -> None:
        try:
            with plain.open("rb") as source, gzip.open(self.path, "wb", compresslevel=1) as target:
                shutil.copyfileobj(source, target, 1 << 20)
        except BaseException as exc:  # raised again by finish(), on the caller's thread
            self._error = exc

    def finish(self, notes: list[str]) -> str | None:
        """The trace's path once written (``None``: deleted for its size, with a note); raises what the
        compression raised."""
        self._thread.join()
        self._scratch.cleanup()
        if self._error is not None:
            raise self._error
        size = self.path.stat().st_size
        if size > self.max_bytes:
            with contextlib.suppress(OSError):
                self.path.unlink()
            notes.append(f"trace of {size} bytes exceeded max_trace_bytes={self.max_bytes}; deleted")
            return None
        return str(self.path)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a block that makes many objects and no cycles: in a process
    holding a framework's objects, a full collection it would trigger costs a tenth of a second."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
