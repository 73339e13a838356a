"""TensorBoard's events-file writes, made as late as a busy machine can make them, and failing on demand.

``SummaryWriter`` writes from its own thread. :func:`install` makes that thread write only while another
thread waits for it (in a flush): the worst case of a loaded machine, where the writer thread gets the
CPU only when the training thread blocks, made deterministic. ``disk.full()`` then makes every later
write fail as a full disk does (the writer thread dies with the error)::

    disk = install(monkeypatch)
    ...                      # what was logged is in the file only if the code under test flushed it
    disk.full()
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["HANG_S", "LaggingDisk", "install"]

HANG_S = 60.0  # a wait that takes this long is a hang, not a slow machine


class LaggingDisk:
    """The patched writer's state: ``waited_for`` is set while a flush waits; ``is_full`` after ``full()``."""

    def __init__(self) -> None:
        self.waited_for = threading.Event()
        self._full = threading.Event()

    def full(self) -> None:
        """Every later write to an events file raises ``OSError(ENOSPC)``."""
        self._full.set()

    @property
    def is_full(self) -> bool:
        return self._full.is_set()


def install(monkeypatch: Any) -> LaggingDisk:
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tensorboard.summary.writer.record_writer import RecordWriter

    disk = LaggingDisk()
    write, flush = RecordWriter.write, EventFileWriter.flush

    def lagging_write(self: Any, data: bytes) -> None:
        if not disk.waited_for.wait(HANG_S):
            raise TimeoutError(f"nobody waited for TensorBoard's writer thread in {HANG_S} s")
        if disk.is_full:
            raise OSError(28, "No space left on device")
        write(self, data)

    def waiting_flush(self: Any) -> None:
        disk.waited_for.set()
        try:
            flush(self)
        finally:
            disk.waited_for.clear()

    monkeypatch.setattr(RecordWriter, "write", lagging_write)
    monkeypatch.setattr(EventFileWriter, "flush", waiting_flush)
    return disk
