"""The pre-flight memory picture, drawn on a background thread from the run's start (issue #40).

Drawing it takes a fraction of a second, most of it importing matplotlib the first time (0.5–1 s on a
loaded CPU): at close that was half of closing a small run. The estimate it draws is known when the
monitor starts, so :class:`PictureJob` draws it then, on a daemon thread, while the first step trains
(the start-up step, left out of the run's figures: no measured step shares the interpreter with the
drawing); the monitor waits for the rest at that step's end (:meth:`PictureJob.wait`, with a deadline,
as at close when no step ran) and takes the image at close. A drawing still running
at the deadline writes ``memory.png`` itself when it finishes (:meth:`PictureJob.write_when_done`), and
the report says so.

Example:
    >>> job = PictureJob(lambda: "image")
    >>> job.wait(5.0), job.image
    (True, 'image')
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["PictureJob", "PICTURE_DEADLINE_S"]

# how long close waits for a drawing still under way (a cold matplotlib import on a loaded machine takes
# a few seconds at worst); past it the drawing writes memory.png itself when it finishes
PICTURE_DEADLINE_S = 10.0


class PictureJob:
    """``draw()`` on a daemon thread, started at once.

    Attributes:
        key: what the picture was drawn from (the caller compares it at close: redraw if it changed).
        image: ``draw()``'s result once done (``None`` before, or after an error).
        error: the exception ``draw()`` raised, if any.
        cpu_s / wall_s: the drawing thread's CPU time and the drawing's wall time, once done.
    """

    def __init__(self, draw: Callable[[], Any], key: Any = None) -> None:
        self.key = key
        self.image: Any = None
        self.error: BaseException | None = None
        self.cpu_s = self.wall_s = 0.0
        self._draw = draw
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._late_path: Path | None = None
        self._thread = threading.Thread(target=self._run, name="resource_guard-memory-picture", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _run(self) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            self.image = self._draw()
        except Exception as exc:  # reported by the monitor at close (one warning), never raised here
            self.error = exc
        finally:
            self.cpu_s, self.wall_s = time.thread_time() - cpu, time.perf_counter() - wall
            with self._lock:
                self._done.set()
                late = self._late_path
        if late is not None and self.image is not None:
            self._write(late)

    def _write(self, path: Path) -> None:
        from resource_guard.report.tensorboard import png_bytes

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(png_bytes(self.image))
        except Exception as exc:  # nobody is left to tell: kept for a caller that asks
            self.error = exc

    def result(self) -> Any:
        """The image (``None`` before it is done); raises the drawing's error, if it failed."""
        if self.error is not None:
            raise self.error
        return self.image

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the drawing; whether it is done."""
        return self._done.wait(max(0.0, timeout_s))

    def write_when_done(self, path: Path) -> bool:
        """Have the drawing write ``path`` (a PNG) itself when it finishes; ``False`` if it has already
        finished (the caller has the image and writes it)."""
        with self._lock:
            if self._done.is_set():
                return False
            self._late_path = path
            return True
