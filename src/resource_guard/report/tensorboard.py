"""TensorBoard output of the monitor: scalars under ``resource_guard/``, a custom-scalars layout, the
report as text and the pre-flight memory picture as an image.

:class:`TBLog` wraps a ``SummaryWriter`` (its own, created in the log dir, or one it is handed, e.g.
Lightning's ``TensorBoardLogger.experiment``, which it never closes). Each of its calls returns once what
it logged is in the events file, so a later fault (the disk filling up, the writer's thread dying, the
process being killed) loses nothing already logged. A writer error switches TensorBoard output off with
one message (the caller warns) and never reaches the training loop.

:func:`memory_picture` draws the estimate's timeline (bytes by category over one step, stacked) against
the device capacity with Pillow, which TensorBoard itself depends on (no matplotlib needed).

Example:
    >>> layout = custom_scalar_layout()
    >>> sorted(layout)
    ['resource_guard']
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from resource_guard.estimate import CATEGORIES

__all__ = ["TAG_PREFIX", "TBLog", "custom_scalar_layout", "memory_picture", "png_bytes"]

TAG_PREFIX = "resource_guard/"
_CHARTS = {
    "step time split (s)": ["time/step_s", "time/data_wait_s", "time/compute_s", "time/device_compute_s"],
    "data wait share": ["time/data_wait_share", "time/stalled"],
    "throughput": ["throughput/samples_per_s", "throughput/tokens_per_s"],
    "utilization": ["util/mfu", "gpu/util_percent", "host/process_cpu_percent", "host/system_cpu_percent"],
    "memory (bytes)": ["memory/peak_bytes", "gpu/memory_used_bytes", "host/process_rss_bytes"],
    "memory vs estimate": ["memory/estimate_error"],
    "GPU power and clock": ["gpu/power_w", "gpu/temperature_c", "gpu/sm_clock_mhz"],
}
_COLORS = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (127, 127, 127),
    (23, 190, 207),
]


def custom_scalar_layout() -> dict[str, dict[str, list[Any]]]:
    """Layout for ``SummaryWriter.add_custom_scalars``: related curves share a chart (regex tags)."""
    charts = {}
    for title, tags in _CHARTS.items():
        regexes = [f"^{TAG_PREFIX}{tag}(_max)?$" for tag in tags]
        charts[title] = ["Multiline", regexes]
    return {"resource_guard": charts}


class TBLog:
    """TensorBoard writing for one run. Every method raises on writer errors; callers disable it then.

    ``SummaryWriter`` queues events for a thread that writes them when it next runs (and flushes the
    file every ``flush_secs``, 120 by default): on a busy machine a fault could take logged scalars with
    it. So every call here ends with a flush: it returns once the writer thread has written its events
    to the file (handed to the OS, not fsync'd), and a writer thread that died on an I/O error raises in
    the call that hit it. The cost is one wait for the writer thread per call, i.e. per log boundary.

    Args:
        writer: an existing ``SummaryWriter`` (not closed here); or ``None`` with ``log_dir``.
        log_dir: where to create a ``SummaryWriter`` when no ``writer`` is given.
    """

    def __init__(self, writer: Any | None = None, log_dir: str | Path | None = None) -> None:
        self._writer = writer
        self._log_dir = log_dir
        self._owned = False

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

    def layout(self) -> None:
        self.writer.add_custom_scalars(custom_scalar_layout())
        self._flush()

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Write ``values`` as ``resource_guard/<key>`` at ``step``; ``None`` and NaN are skipped.

        All values go into one event (one queue hand-off to the writer thread instead of one per tag,
        which costs the training thread ~10x less); writers without that path get ``add_scalar`` calls.
        """
        writer = self.writer
        kept = {TAG_PREFIX + k: float(v) for k, v in values.items() if v is not None and v == v}
        file_writer = _file_writer(writer)
        if file_writer is None:
            for tag, value in kept.items():
                writer.add_scalar(tag, value, step)
        else:
            from tensorboard.compat.proto.summary_pb2 import Summary

            values_pb = [Summary.Value(tag=tag, simple_value=value) for tag, value in kept.items()]
            file_writer.add_summary(Summary(value=values_pb), step)
        self._flush()

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        self.writer.add_text(TAG_PREFIX + tag, markdown, step)
        self._flush()

    def image(self, tag: str, image_hwc: np.ndarray, step: int = 0) -> None:
        self.writer.add_image(TAG_PREFIX + tag, image_hwc, step, dataformats="HWC")
        self._flush()

    def _flush(self) -> None:
        """Wait until the writer has written what it was given (writers without ``flush``: nothing)."""
        flush = getattr(self._writer, "flush", None)
        if callable(flush):
            flush()

    def close(self) -> None:
        """Flush; close the writer only if this object created it (idempotent).

        A writer of its own is closed even when it is broken (its events file unwritable, its thread
        dead): the error is raised after its thread and file have been let go of.
        """
        writer, self._writer = self._writer, None
        if writer is None:
            return
        if not self._owned:
            writer.flush()
            return
        try:
            writer.close()
        except Exception:
            _force_close(writer)
            raise


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


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size / 4:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def memory_picture(
    timeline: Sequence[tuple[str, Sequence[int]]],
    capacity_bytes: int | None,
    *,
    title: str = "pre-flight memory over one training step",
    width: int = 800,
    height: int = 420,
    categories: Sequence[str] = CATEGORIES,
) -> np.ndarray:
    """Stacked bytes by category over the step, phases marked, capacity as a red line; HWC uint8.

    When the capacity is more than ~4x the peak (a CPU's RAM), the y axis follows the peak and the
    capacity is written in the legend instead of drawn. At least 400 x 160 pixels.
    """
    from PIL import Image, ImageDraw

    width, height = max(width, 400), max(height, 160)  # room for the axis labels and the legend
    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    left, right, top, bottom = 70, width - 190, 30, height - 40
    values = (
        np.array([list(v) for _, v in timeline], dtype=np.float64).reshape(len(timeline), -1)
        if timeline
        else np.zeros((0, len(categories)))
    )
    peak = float(values.sum(axis=1).max()) if len(values) else 0.0
    capacity = float(capacity_bytes or 0)
    show_capacity = 0 < capacity <= 4 * max(peak, 1.0)
    y_max = max(peak, capacity if show_capacity else 0.0, 1.0) * 1.08
    draw.text((left, 8), title, fill=(0, 0, 0))
    draw.rectangle((left, top, right, bottom), outline=(0, 0, 0))

    def y_of(v: float) -> float:
        return bottom - (bottom - top) * v / y_max

    n = len(values)
    if n:
        for x in range(left + 1, right):
            row = values[min(n - 1, int((x - left) / (right - left) * n))]
            base = 0.0
            for c, v in enumerate(row):
                if v > 0:
                    draw.line((x, y_of(base), x, y_of(base + v)), fill=_COLORS[c % len(_COLORS)])
                base += v
        phase, changes = None, 0
        for i, (name, _) in enumerate(timeline):
            if name != phase:
                px = left + (right - left) * i / n
                draw.line((px, top, px, bottom), fill=(90, 90, 90))
                draw.text((px + 2, bottom + 4 + 12 * (changes % 2)), name, fill=(60, 60, 60))
                phase, changes = name, changes + 1
    for frac in (0.0, 0.5, 1.0):
        v = y_max * frac / 1.08
        draw.text((4, y_of(v) - 6), _gib(v), fill=(0, 0, 0))
    if show_capacity and capacity_bytes:
        y = y_of(capacity_bytes)
        draw.line((left, y, right, y), fill=(220, 0, 0), width=2)
        draw.text((left + 4, y - 14), f"capacity {_gib(capacity_bytes)}", fill=(220, 0, 0))
    ly = top
    for c, name in enumerate(categories):
        draw.rectangle((right + 12, ly, right + 24, ly + 10), fill=_COLORS[c % len(_COLORS)])
        draw.text((right + 30, ly - 1), name, fill=(0, 0, 0))
        ly += 16
    draw.text((right + 12, ly + 8), f"peak {_gib(peak)}", fill=(0, 0, 0))
    if capacity_bytes and not show_capacity:
        draw.text((right + 12, ly + 24), f"capacity {_gib(capacity_bytes)}", fill=(220, 0, 0))
        draw.text((right + 12, ly + 38), "(off scale)", fill=(220, 0, 0))
    return np.asarray(img, dtype=np.uint8)


def png_bytes(image_hwc: np.ndarray) -> bytes:
    """Encode an HWC uint8 image as PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image_hwc).save(buffer, format="PNG")
    return buffer.getvalue()
