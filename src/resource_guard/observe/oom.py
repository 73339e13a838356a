"""What an out-of-memory error leaves behind: the last memory figures and, on CUDA, a memory snapshot.

When a run ends with an OOM — recognised by type (``torch.OutOfMemoryError``, which
``torch.cuda.OutOfMemoryError`` aliases), never by message — the :class:`~resource_guard.RunMonitor`
records an :class:`OomEvent`: the step that failed, the peak measured since the last log boundary (the
failing step included, up to the failure), the peak of the last logged interval, the pre-flight estimate
and the capacity. It goes into ``oom.json`` and into ``report.json`` (``summary.oom``), where the ``oom``
finding (critical) explains it. On a CUDA run with ``memory_history=True`` the allocator's history is
recorded from the start of monitoring and dumped at the OOM into ``memory_snapshot.pickle``, a file for
the PyTorch memory visualiser (https://pytorch.org/memory_viz). The user's exception is re-raised
unchanged by the front doors; nothing here raises it or replaces it.

Example:
    >>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> is_oom(RuntimeError("CUDA out of memory"))  # by type, not by message
    False
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "HISTORY_MAX_ENTRIES",
    "OOM_FILE",
    "SNAPSHOT_FILE",
    "OomEvent",
    "is_oom",
    "memory_history",
    "write_oom",
]

OOM_FILE = "oom.json"
SNAPSHOT_FILE = "memory_snapshot.pickle"
HISTORY_MAX_ENTRIES = 100_000  # the allocator's ring buffer: each entry is a few KB of host memory


def is_oom(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an allocator's out-of-memory error (``torch.OutOfMemoryError``, CUDA's alias)."""
    return isinstance(exc, torch.OutOfMemoryError)


@dataclass(frozen=True)
class OomEvent:
    """The last memory figures of a run that ran out of memory. Unknown is ``None``.

    Attributes:
        error: ``"<type>: <first line of the message>"``.
        step: the (micro) step that failed, counting from 1.
        device: the training device.
        peak_at_oom_bytes: the peak since the last log boundary, read at the OOM (CUDA:
            ``max_memory_allocated``; CPU: the process's peak RSS).
        last_logged_peak_bytes: the peak of the last interval logged before the OOM.
        peak_memory_source: ``"cuda_allocated"`` or ``"rss"``.
        estimated_peak_bytes: the pre-flight estimate of one step.
        capacity_bytes: the device capacity the run was held against.
        snapshot_path: the CUDA memory snapshot (``memory_history=True``), or ``None``.
    """

    error: str
    step: int
    device: str
    peak_at_oom_bytes: int | None = None
    last_logged_peak_bytes: int | None = None
    peak_memory_source: str | None = None
    estimated_peak_bytes: int | None = None
    capacity_bytes: int | None = None
    snapshot_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def describe(exc: BaseException) -> str:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def memory_history(action: str, path: Path | None = None, max_entries: int = HISTORY_MAX_ENTRIES) -> bool:
    """Start (``"start"``), dump (``"dump"`` to ``path``) or stop (``"stop"``) the CUDA allocator's history.

    The one place that calls ``torch.cuda.memory``'s private memory-history API
    (``_record_memory_history`` and ``_dump_snapshot``: there is no public one; the snapshot format is
    what https://pytorch.org/memory_viz reads). ``tests/test_oom.py`` fails loudly if they move. Errors
    propagate; the monitor turns them into one warning. Returns True.
    """
    memory = torch.cuda.memory
    if action == "start":
        memory._record_memory_history(enabled="all", max_entries=max_entries)
    elif action == "dump":
        if path is None:
            raise ValueError("memory_history('dump') needs a path")
        memory._dump_snapshot(str(path))
    elif action == "stop":
        memory._record_memory_history(enabled=None)
    else:
        raise ValueError(f"memory_history(action={action!r}) must be 'start', 'dump' or 'stop'")
    return True


def write_oom(directory: Path, event: OomEvent) -> Path:
    """Write ``event`` as ``directory/oom.json``; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / OOM_FILE
    path.write_text(json.dumps(event.to_dict(), indent=2), encoding="utf-8")
    return path
