"""TensorBoard output of the monitor: scalars under ``resource_guard/`` (their tags:
:mod:`resource_guard.report.scalar_tags`), a custom-scalars layout, the
report as text and the pre-flight memory picture as an image.

:class:`TBLog` wraps a ``SummaryWriter`` (its own, created in the log dir, or one it is handed, e.g.
Lightning's ``TensorBoardLogger.experiment``, which it never closes). Each of its calls returns once what
it logged is in the events file, so a later fault (the disk filling up, the writer's thread dying, the
process being killed) loses nothing already logged. A writer error switches TensorBoard output off with
one message (the caller warns) and never reaches the training loop.

:func:`memory_figure` draws the estimate's timeline (bytes by category over one step, stacked, phases
along the x axis, bytes in MiB or GiB on the y axis) against the labelled device capacity as a
matplotlib ``Figure`` (what ``SummaryWriter.add_figure`` takes); :func:`memory_picture` renders it to
the HWC image that :meth:`TBLog.image` and ``memory.png`` use. matplotlib is imported only when a
picture is drawn, and only through ``matplotlib.figure.Figure`` and the Agg canvas: no pyplot, no
backend switch, no change to the caller's matplotlib state.

Example:
    >>> layout = custom_scalar_layout()
    >>> sorted(layout)
    ['resource_guard']
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from resource_guard.estimate import CATEGORIES
from resource_guard.report.types import plan_mib

__all__ = [
    "TAG_PREFIX",
    "TBLog",
    "custom_scalar_layout",
    "figure_image",
    "memory_figure",
    "memory_picture",
    "png_bytes",
]

TAG_PREFIX = "resource_guard/"
# custom-scalars charts: title -> (tag regexes below TAG_PREFIX, CUDA only); related curves of one unit
_CHARTS: dict[str, tuple[list[str], bool]] = {
    "step time (ms)": ([r"1_step/time_ms(_slowest_rank)?", r"1_step/device_compute_ms"], False),
    "step by phase (% of the step)": ([r"2_phase_pct/\w+"], False),
    "step by phase (ms per step)": ([r"3_phase_ms/\w+"], False),
    "data wait (% of the step)": ([r"1_step/data_wait_pct(_slowest_rank)?", r"2_phase_pct/data_wait"], False),
    "memory (MiB)": ([r"4_memory/\w+_mib", r"8_host/rss_mib"], False),
    "memory vs estimate (%)": ([r"4_memory/estimate_error_pct"], True),
    "allocator retries": ([r"4_memory/alloc_retries"], True),
    "samples/s": ([r"5_throughput/samples_per_s"], False),
    "tokens/s": ([r"5_throughput/tokens_per_s"], False),
    "MFU (%)": ([r"6_util/mfu_pct"], False),
    "CPU and GPU busy (%)": ([r"6_util/(gpu|process_cpu|system_cpu)_pct", r"7_gpu/\d+/util_pct"], False),
    "GPU power (W)": ([r"7_gpu/(\d+/)?power_w"], True),
    "GPU temperature (C) and SM clock (MHz)": ([r"7_gpu/(\d+/)?(temperature_c|sm_clock_mhz)"], True),
}
_CAPACITY_COLOR = "#dc0000"
_PREDICTED_COLOR = "#6a3d9a"
# tab10 without its red, which is the capacity's: parameters, gradients, optimizer state, activations, …
_CATEGORY_COLORS = ("C0", "C1", "C2", "C4", "C8", "C5", "C7", "C9", "C6", "C3")
_MIN_LABELLED_SPAN = 0.06  # a phase shorter than this share of the step gets its line, not its name
_OFF_SCALE = 4.0  # a capacity more than this many times the peak (a CPU's RAM) is written, not drawn
_POLL_S = 0.05  # how often a training thread waiting for the flusher checks it is still alive
_IDLE_S = 5.0  # the flusher's own wake-up when nothing is handed over (it is woken for each job)
_DRAIN_TIMEOUT_S = 60.0  # a flusher that has not written a log interval's events in this long is stuck


def custom_scalar_layout(*, cuda: bool = True) -> dict[str, dict[str, list[Any]]]:
    """Layout for ``SummaryWriter.add_custom_scalars``: related curves of one unit share a chart (regex
    tags of :mod:`resource_guard.report.scalar_tags`); ``cuda=False`` leaves out the charts of figures
    only a GPU has (they would stay empty)."""
    charts = {}
    for title, (tags, cuda_only) in _CHARTS.items():
        if cuda_only and not cuda:
            continue
        charts[title] = ["Multiline", [f"^{TAG_PREFIX}{tag}$" for tag in tags]]
    return {"resource_guard": charts}


class TBLog:
    """TensorBoard writing for one run. Every method raises on writer errors; callers disable it then.

    ``SummaryWriter`` queues events for a thread that writes them when it next runs (and flushes the
    file every ``flush_secs``, 120 by default): on a busy machine a fault could take logged scalars with
    it, and waiting for that thread at every log boundary costs the training loop a thread hand-off
    (about a millisecond on a loaded 2-core machine). So with ``background=True`` (the default) each
    call only hands its values to a flusher thread of this object, which writes them and flushes the
    events file; the next call first waits until that is done (normally long done), so what was logged
    is on disk by the next log boundary, and :meth:`close` (reached at the end of the run and on a
    crash, through the monitor's ``close``) and the interpreter's exit drain it. A writer error raised
    in the flusher raises in the next call (or :meth:`wait`, or :meth:`close`). ``background=False``
    writes and flushes in the call itself.

    Args:
        writer: an existing ``SummaryWriter`` (not closed here); or ``None`` with ``log_dir``.
        log_dir: where to create a ``SummaryWriter`` when no ``writer`` is given.
        background: write and flush on a flusher thread (see above).
    """

    def __init__(
        self, writer: Any | None = None, log_dir: str | Path | None = None, *, background: bool = True
    ) -> None:
        self._writer = writer
        self._log_dir = log_dir
        self._owned = False
        self._flusher: _Flusher | None = None
        self._background = background

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter``, created on first use."""
        if self._writer is None:
            if self._log_dir is None:
                raise ValueError("TBLog needs a writer or a log_dir")
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self._log_dir))
            self._owned = True
        return self._writer

    def _submit(self, job: Callable[[Any], None], *, flush: bool = True) -> None:
        """Run ``job(writer)`` (and flush when ``flush``): on the flusher thread, or here."""
        writer = self.writer
        if not self._background:
            job(writer)
            if flush:
                self._flush()
            return
        if self._flusher is None:
            self._flusher = _Flusher(writer)
        self._flusher.submit(job, flush=flush)

    def wait(self) -> None:
        """Return once everything handed over so far is written and flushed; raise a writer error."""
        if self._flusher is not None:
            self._flusher.wait()

    def layout(self, *, cuda: bool = True) -> None:
        layout = custom_scalar_layout(cuda=cuda)
        self._submit(lambda w: w.add_custom_scalars(layout))

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Write ``values`` as ``resource_guard/<key>`` at ``step``; ``None`` and NaN are skipped.

        All values go into one event (one queue hand-off to the writer thread instead of one per tag,
        which costs ~10x less); writers without that path get ``add_scalar`` calls.
        """
        kept = {TAG_PREFIX + k: float(v) for k, v in values.items() if v is not None and v == v}
        self._submit(lambda w: _write_scalars(w, step, kept))

    def text(self, tag: str, markdown: str, step: int = 0, *, flush: bool = True) -> None:
        """Write ``markdown`` as ``resource_guard/<tag>``; ``flush=False`` leaves it to the next call's
        flush (one flush per log boundary, not one per call)."""
        self._submit(lambda w: w.add_text(TAG_PREFIX + tag, markdown, step), flush=flush)

    def image(self, tag: str, image_hwc: np.ndarray, step: int = 0) -> None:
        self._submit(lambda w: w.add_image(TAG_PREFIX + tag, image_hwc, step, dataformats="HWC"))

    def _flush(self) -> None:
        """Wait until the writer has written what it was given (writers without ``flush``: nothing)."""
        _flush_writer(self._writer)

    def close(self) -> None:
        """Drain the flusher, flush; close the writer only if this object created it (idempotent).

        A writer of its own is closed even when it is broken (its events file unwritable, its thread
        dead): the error is raised after its thread and file have been let go of.
        """
        flusher, self._flusher = self._flusher, None
        writer, self._writer = self._writer, None
        if writer is None:
            return
        error: BaseException | None = None
        if flusher is not None:
            try:
                flusher.stop()
            except Exception as exc:
                error = exc
        if not self._owned:
            if error is not None:
                raise error
            writer.flush()
            return
        try:
            writer.close()
        except Exception:
            _force_close(writer)
            raise
        if error is not None:
            raise error


def _write_scalars(writer: Any, step: int, kept: Mapping[str, float]) -> None:
    file_writer = _file_writer(writer)
    if file_writer is None:
        for tag, value in kept.items():
            writer.add_scalar(tag, value, step)
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    values_pb = [Summary.Value(tag=tag, simple_value=value) for tag, value in kept.items()]
    file_writer.add_summary(Summary(value=values_pb), step)


def _flush_writer(writer: Any) -> None:
    flush = getattr(writer, "flush", None)
    if callable(flush):
        flush()


class _Flusher:
    """A daemon thread that runs the jobs handed to it (writer calls), then flushes the writer.

    It sleeps until a job is handed over (a log boundary: a deque append and one event set) and
    otherwise wakes only every ``_IDLE_S``: a thread waking 20 times a second (the former poll) competes
    with the compute threads for the cores on a CPU run. :meth:`submit` first makes sure the jobs
    handed over before it are done (normally long done: the flusher had a whole log interval), waiting
    only when they are not, so that they are on disk by the next log boundary, and raises the error of a
    job that failed. The interpreter's exit drains it (``atexit``).
    """

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self._jobs: collections.deque[tuple[Callable[[Any], None], bool]] = collections.deque()
        self._submitted = 0
        self._done = 0
        self._wake = threading.Event()
        self._finished = threading.Condition()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="resource_guard-tensorboard", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    def submit(self, job: Callable[[Any], None], *, flush: bool) -> None:
        self.wait()
        self._submitted += 1
        self._jobs.append((job, flush))
        self._wake.set()

    def wait(self) -> None:
        """Return once every submitted job is done; raise the error of one that failed."""
        if self._done < self._submitted:
            deadline = time.monotonic() + _DRAIN_TIMEOUT_S
            with self._finished:
                while self._done < self._submitted and self._thread.is_alive():
                    self._wake.set()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"TensorBoard's events were not written within {_DRAIN_TIMEOUT_S} s"
                        )
                    self._finished.wait(min(left, _POLL_S))
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(_IDLE_S)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        done, flush = 0, False
        try:
            while self._jobs:
                job, wants_flush = self._jobs.popleft()
                done += 1
                job(self._writer)
                flush = flush or wants_flush
            if flush:
                _flush_writer(self._writer)
        except BaseException as exc:  # handed to the training thread's next call
            done += len(self._jobs)
            self._jobs.clear()
            self._error = exc
        if done:
            with self._finished:
                self._done += done
                self._finished.notify_all()

    def stop(self) -> None:
        """Write what is pending, stop the thread; raise an error the flusher met."""
        atexit.unregister(self._at_exit)
        self._stopping = True
        self._wake.set()
        self._thread.join(_DRAIN_TIMEOUT_S)
        self._drain()  # what the thread left (handed over after its last round)
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()


def _file_writer(writer: Any) -> Any:
    """The ``FileWriter`` behind a torch ``SummaryWriter`` (``_get_file_writer``, not public API), or None.

    The one private hook of this package's TensorBoard output; ``test_tblog`` fails loudly if it moves.
    Anything else (a tensorboardX writer, a test double) falls back to ``add_scalar``.
    """
    from torch.utils.tensorboard import SummaryWriter

    getter = getattr(writer, "_get_file_writer", None) if isinstance(writer, SummaryWriter) else None
    file_writer = getter() if callable(getter) else None
    return file_writer if callable(getattr(file_writer, "add_summary", None)) else None


def _force_close(writer: Any) -> None:
    """Stop the threads and close the files of a ``SummaryWriter`` whose ``close`` failed.

    ``SummaryWriter.close`` flushes each ``FileWriter`` first, and a flush re-raises the error of a dead
    writer thread, so nothing gets closed. ``FileWriter.close`` (public) stops the thread and closes the
    file without that check; the event file's own handle (``event_writer._general_file_writer``, private)
    is the last resort when even that fails. ``test_faults`` fails loudly if these move.
    """
    import contextlib

    for file_writer in list((getattr(writer, "all_writers", None) or {}).values()):
        try:
            file_writer.close()
        except Exception:
            handle: Any = getattr(getattr(file_writer, "event_writer", None), "_general_file_writer", None)
            with contextlib.suppress(Exception):
                handle.close()


def _unit(peak: float) -> tuple[str, float]:
    """The y axis unit for a peak of ``peak`` bytes: GiB from 1 GiB, else MiB (KiB for tiny steps)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if peak >= size:
            return unit, float(size)
    return ("KiB", 1024.0) if peak >= 1024 else ("B", 1.0)


@contextlib.contextmanager
def _quiet_matplotlib() -> Iterator[None]:
    """matplotlib logs a warning the first time it builds its font cache: not for the user's console."""
    logger = logging.getLogger("matplotlib")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def memory_figure(
    timeline: Sequence[tuple[str, Sequence[int]]],
    capacity_bytes: int | None,
    *,
    usable_bytes: int | None = None,
    predicted_peak_bytes: int | None = None,
    title: str = "pre-flight memory over one training step",
    width: int = 960,
    height: int = 480,
    categories: Sequence[str] = CATEGORIES,
) -> Any:
    """The estimate's memory over one step as a matplotlib ``Figure`` of ``width`` × ``height`` pixels.

    Bytes by category stacked over the step's events, the phases (forward, backward, optimizer, …)
    named along the x axis, MiB or GiB on the y axis, the live tensors' peak marked, the capacity as a
    labelled red line — or, when it is more than 4× the peak (a CPU's RAM), written in the legend as
    off scale. The plan's figures, where given, with the names the plan's text uses: the usable line
    (``usable_bytes``: the capacity less the headroom, dashed) and the predicted peak
    (``predicted_peak_bytes``: as the device counts it, allocator rounding and context included).
    At least 400 × 240 pixels. ``SummaryWriter.add_figure(tag, figure)`` takes it as it is.
    """
    with _quiet_matplotlib():
        from matplotlib.figure import Figure

        width, height = max(width, 400), max(height, 240)
        dpi = 100
        fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
        ax = fig.add_subplot()
        values = (
            np.array([list(v) for _, v in timeline], dtype=np.float64).reshape(len(timeline), -1)
            if timeline
            else np.zeros((0, len(categories)))
        )
        totals = values.sum(axis=1) if len(values) else np.zeros(0)
        peak = float(totals.max()) if len(totals) else 0.0
        capacity = float(capacity_bytes or 0)
        show_capacity = 0 < capacity <= _OFF_SCALE * max(peak, 1.0)
        usable = float(usable_bytes or 0) if show_capacity else 0.0
        predicted = float(predicted_peak_bytes or 0)
        top_line = max(peak, predicted, capacity if show_capacity else 0.0)
        unit, size = _unit(top_line)
        x = np.arange(len(values))
        if len(values):
            names = list(categories)[: values.shape[1]]
            names += [f"category {i}" for i in range(len(names), values.shape[1])]
            ax.stackplot(
                x,
                values.T / size,
                labels=names,
                colors=[_CATEGORY_COLORS[i % len(_CATEGORY_COLORS)] for i in range(len(names))],
                lw=0,
            )
            top = int(np.argmax(totals))
            ax.axhline(
                peak / size, color="black", lw=0.8, ls=":", label=f"live tensors' peak {plan_mib(peak)}"
            )
            ax.plot([top], [peak / size], marker="v", color="black", ms=5)
            _phase_axis(ax, [name for name, _ in timeline])
        else:
            ax.set_xticks([])
        if predicted:
            ax.axhline(
                predicted / size,
                color=_PREDICTED_COLOR,
                lw=1.2,
                ls="-.",
                label=f"predicted peak {plan_mib(predicted)}",
            )
        if usable:
            ax.axhline(
                usable / size, color=_CAPACITY_COLOR, lw=1.2, ls="--", label=f"usable {plan_mib(usable)}"
            )
        if show_capacity:
            ax.axhline(capacity / size, color=_CAPACITY_COLOR, lw=2, label=f"capacity {plan_mib(capacity)}")
        elif capacity_bytes:
            ax.plot([], [], " ", label=f"capacity {plan_mib(capacity)} (off scale)")
        ax.set_ylim(0, max(top_line, 1.0) / size * 1.08)
        ax.set_xlim(0, max(len(values) - 1, 1))
        ax.set_ylabel(f"live tensor memory ({unit})")
        ax.set_xlabel("phase of the training step")
        ax.set_title(title, fontsize="medium")
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


def _phase_axis(ax: Any, phases: Sequence[str]) -> None:
    """Phase names centred under their spans, a faint line at each change."""
    spans: list[tuple[str, int, int]] = []
    for i, name in enumerate(phases):
        if spans and spans[-1][0] == name:
            spans[-1] = (name, spans[-1][1], i)
        else:
            spans.append((name, i, i))
    for _, start, _ in spans[1:]:
        ax.axvline(start, color="0.4", lw=0.6)
    shown = [(n, a, b) for n, a, b in spans if (b - a + 1) >= _MIN_LABELLED_SPAN * len(phases)]
    ax.set_xticks([(a + b) / 2 for _, a, b in shown], [name for name, _, _ in shown], fontsize="small")
    ax.tick_params(axis="x", length=0)


def figure_image(figure: Any) -> np.ndarray:
    """Render a matplotlib ``Figure`` on the Agg canvas: an RGB HWC uint8 array (the figure's pixel size)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    with _quiet_matplotlib():
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        rgba = np.asarray(canvas.buffer_rgba())
    return np.ascontiguousarray(rgba[..., :3])


def memory_picture(
    timeline: Sequence[tuple[str, Sequence[int]]],
    capacity_bytes: int | None = None,
    *,
    usable_bytes: int | None = None,
    predicted_peak_bytes: int | None = None,
    title: str = "pre-flight memory over one training step",
    width: int = 960,
    height: int = 480,
    categories: Sequence[str] = CATEGORIES,
) -> np.ndarray:
    """:func:`memory_figure` rendered to an RGB HWC uint8 image (for TensorBoard and ``memory.png``)."""
    figure = memory_figure(
        timeline,
        capacity_bytes,
        usable_bytes=usable_bytes,
        predicted_peak_bytes=predicted_peak_bytes,
        title=title,
        width=width,
        height=height,
        categories=categories,
    )
    return figure_image(figure)


def png_bytes(image_hwc: np.ndarray) -> bytes:
    """Encode an HWC uint8 image as PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image_hwc).save(buffer, format="PNG")
    return buffer.getvalue()
