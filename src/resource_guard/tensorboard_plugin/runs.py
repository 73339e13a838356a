"""The runs below a TensorBoard log dir and what each one wrote: ``report.json``, ``guard.json``,
``memory.png`` and the ``resource_guard/...`` scalars and text of its event files.

A run is a directory holding ``report.json`` or ``guard.json``. Its events are in the same directory
(``guard``, Lightning without a TensorBoard logger), or, for a report directory named ``resource_guard``,
in the directory above it (Lightning's ``version_N``) or in ``../runs/*`` (the Trainer's run).

Example:
    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> (root / "a").mkdir(); _ = (root / "a" / "report.json").write_text("{}")
    >>> [r.name for r in find_runs(root)]
    ['a']
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["REPORT_DIR_NAME", "RunFiles", "RunEvents", "find_runs", "load_events", "read_json", "run_by_name"]

REPORT_DIR_NAME = "resource_guard"  # the report directory the Lightning and Trainer doors make
_TAG_PREFIX = "resource_guard/"
_EVENTS_GLOB = "events.out.tfevents.*"


@dataclass(frozen=True)
class RunFiles:
    """Where one run's files are.

    Attributes:
        name: the run's path below the log dir (``"."`` for the log dir itself), POSIX separators.
        report_dir: the directory with ``report.json`` / ``guard.json`` / ``memory.png``.
    """

    name: str
    report_dir: Path

    @property
    def report_path(self) -> Path:
        return self.report_dir / "report.json"

    @property
    def guard_path(self) -> Path:
        return self.report_dir / "guard.json"

    @property
    def picture_path(self) -> Path:
        return self.report_dir / "memory.png"

    def event_dirs(self) -> list[Path]:
        """The directories to read events from, most likely first."""
        out = [self.report_dir]
        if self.report_dir.name == REPORT_DIR_NAME:
            parent = self.report_dir.parent
            out.append(parent)
            runs = parent / "runs"
            if runs.is_dir():
                out.extend(sorted((p for p in runs.iterdir() if p.is_dir()), reverse=True))
        return [d for d in out if any(d.glob(_EVENTS_GLOB))]


@dataclass(frozen=True)
class RunEvents:
    """The ``resource_guard/...`` records of a run's event files.

    Attributes:
        scalars: tag (without the ``resource_guard/`` prefix) to ``[(step, value), ...]`` in step order.
        texts: tag (without the prefix and the ``/text_summary`` suffix) to its last text.
    """

    scalars: dict[str, list[tuple[int, float]]]
    texts: dict[str, str]


def find_runs(logdir: str | Path) -> list[RunFiles]:
    """The runs below ``logdir`` (directories with ``report.json`` or ``guard.json``), by name."""
    root = Path(logdir)
    if not root.is_dir():
        return []
    dirs = {p.parent for pattern in ("report.json", "guard.json") for p in root.rglob(pattern)}
    runs = [RunFiles(_name(root, d), d) for d in dirs]
    return sorted(runs, key=lambda r: r.name)


def run_by_name(logdir: str | Path, name: str) -> RunFiles | None:
    """The run called ``name`` below ``logdir`` (``None``: no such run). Never leaves ``logdir``."""
    return next((r for r in find_runs(logdir) if r.name == name), None)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or ``None`` when absent or unreadable (a run still writing it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


_cache: dict[tuple[Any, ...], RunEvents] = {}
_cache_lock = threading.Lock()


def load_events(run: RunFiles) -> RunEvents:
    """The run's ``resource_guard/...`` scalars and texts (empty where it has no event files)."""
    for directory in run.event_dirs():
        files = sorted(directory.glob(_EVENTS_GLOB))
        key = (str(directory), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
        with _cache_lock:
            cached = _cache.get(key)
        if cached is None:
            cached = _read_events(directory)
            with _cache_lock:
                _cache.clear() if len(_cache) > 64 else None
                _cache[key] = cached
        if cached.scalars or cached.texts:
            return cached
    return RunEvents({}, {})


def _read_events(directory: Path) -> RunEvents:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars: dict[str, list[tuple[int, float]]] = {}
    for tag in tags.get("scalars", ()):
        if tag.startswith(_TAG_PREFIX):
            points = {e.step: float(e.value) for e in acc.Scalars(tag)}  # a resumed run: the last wins
            scalars[tag[len(_TAG_PREFIX) :]] = sorted(points.items())
    texts: dict[str, str] = {}
    for tag in tags.get("tensors", ()):
        if tag.startswith(_TAG_PREFIX) and tag.endswith("/text_summary"):
            events = acc.Tensors(tag)
            if events:
                value = tensor_util.make_ndarray(events[-1].tensor_proto)
                item = value.item() if value.size == 1 else value.flatten()[0]
                text = item.decode("utf-8") if isinstance(item, bytes) else str(item)
                texts[tag[len(_TAG_PREFIX) : -len("/text_summary")]] = text
    return RunEvents(scalars, texts)


def _name(root: Path, directory: Path) -> str:
    """The run's name: its path below the log dir; a door's ``resource_guard`` report directory is named
    after the directory above it (the TensorBoard run its events are in) unless that one is a run too."""
    if directory.name == REPORT_DIR_NAME and directory != root:
        parent = directory.parent
        if not any((parent / f).is_file() for f in ("report.json", "guard.json")):
            directory = parent
    rel = directory.relative_to(root).as_posix()
    return "." if rel in ("", ".") else rel
