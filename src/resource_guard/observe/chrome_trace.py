"""A recorded Chrome trace (what ``torch.profiler``'s ``export_chrome_trace`` and Kineto write) read back
into the :class:`~resource_guard.observe.opclasses.EventRecord`\\ s that
:func:`~resource_guard.observe.profiling.summarize_events` condenses: the same analysis for a live
profiler window and for a trace recorded elsewhere (on a GPU, under NCCL, by another tool).

Events kept: ``ProfilerStep#N`` spans (``user_annotation``; when a trace has none, the whole trace is
one step and a note says so), host ops (``cpu_op``, ``user_annotation``; self time computed from their
nesting on each thread), CUDA runtime calls (``cuda_runtime``), Python frames (``python_function``),
and device kernels, copies and memsets (``kernel``, ``gpu_memcpy``, ``gpu_memset``). Only what falls
inside the steps counts (device work by its start). Flow and metadata events are ignored.

Example:
    >>> trace = {"traceEvents": [
    ...     {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 100, "tid": 1},
    ...     {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 50, "tid": 1},
    ...     {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 20, "dur": 5, "tid": 1}]}
    >>> records, steps, notes = trace_records(trace)
    >>> steps, [(r.name, r.duration_us) for r in records if r.name.startswith("aten")]
    (1, [('aten::mm', 45.0), ('aten::copy_', 5.0)])
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resource_guard.observe.opclasses import EventRecord
from resource_guard.report.types import ProfileSummary

__all__ = ["read_trace", "trace_records", "summarize_trace"]

_HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "python_function")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def read_trace(path: str | Path) -> dict[str, Any]:
    """The JSON of a Chrome trace file, gzipped (``.gz``) or not."""
    path = Path(path)
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace (no traceEvents list)")
    return data


def _span(ev: Mapping[str, Any]) -> tuple[float, float] | None:
    try:
        start, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
    except (KeyError, TypeError, ValueError):
        return None
    return start, dur


def trace_records(trace: Mapping[str, Any]) -> tuple[list[EventRecord], int, list[str]]:
    """The records of a Chrome trace's steps, how many steps, and notes on what was assumed."""
    notes: list[str] = []
    steps: list[tuple[float, float]] = []
    host: list[tuple[Mapping[str, Any], float, float]] = []
    device: list[EventRecord] = []
    for ev in trace.get("traceEvents", ()):
        if not isinstance(ev, Mapping) or ev.get("ph") != "X":
            continue
        cat, name, span = ev.get("cat"), str(ev.get("name", "")), _span(ev)
        if span is None:
            continue
        if cat == "user_annotation" and name.startswith("ProfilerStep#"):
            steps.append(span)
        elif cat in _HOST_CATS:
            host.append((ev, *span))
        elif cat in _DEVICE_CATS:
            device.append(EventRecord(name, True, span[1], start_us=span[0], total_us=span[1]))
    if not steps:
        times = [(s, s + d) for _, s, d in host] + [(r.start_us or 0.0, r.end_us or 0.0) for r in device]
        if not times:
            return [], 0, ["the trace holds no events"]
        first, last = min(a for a, _ in times), max(b for _, b in times)
        steps = [(first, last - first)]
        notes.append("the trace has no ProfilerStep# spans: it was read as one step")
    lo, hi = min(s for s, _ in steps), max(s + d for s, d in steps)
    records = [
        EventRecord(f"ProfilerStep#{i}", False, d, start_us=s, total_us=d) for i, (s, d) in enumerate(steps)
    ]
    records += _host_records([(ev, s, d) for ev, s, d in host if lo <= s < hi])
    records += [r for r in device if r.start_us is not None and lo <= r.start_us < hi]
    return records, len(steps), notes


def _host_records(host: list[tuple[Mapping[str, Any], float, float]]) -> list[EventRecord]:
    """Host events with self times: an op's duration minus its direct children's (ops and runtime
    calls on the same thread nest by time; Python frames are not an op's children)."""
    out: list[EventRecord] = []
    by_thread: dict[Any, list[tuple[Mapping[str, Any], float, float]]] = {}
    for item in host:
        by_thread.setdefault((item[0].get("pid"), item[0].get("tid")), []).append(item)
    for number, items in enumerate(by_thread.values()):
        items.sort(key=lambda t: (t[1], -t[2]))
        stack: list[list[Any]] = []  # [end, index into out]
        for ev, start, dur in items:
            python = ev.get("cat") == "python_function"
            raw = ev.get("args")
            args: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
            record = EventRecord(
                str(ev.get("name", "")),
                False,
                dur,
                _shapes(args.get("Input Dims")),
                tuple(str(t) for t in (args.get("Input type") or ()) if isinstance(t, str)),
                start_us=start,
                total_us=dur,
                thread=number,
                python=python,
            )
            out.append(record)
            if python:
                continue
            while stack and stack[-1][0] <= start:
                stack.pop()
            if stack:  # the enclosing op loses this child's time from its self time
                parent = out[stack[-1][1]]
                out[stack[-1][1]] = dataclasses.replace(
                    parent, duration_us=max(0.0, parent.duration_us - dur)
                )
            stack.append([start + dur, len(out) - 1])
    return out


def _shapes(dims: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(dims, list):
        return ()
    return tuple(
        tuple(int(d) for d in s) for s in dims if isinstance(s, list) and all(isinstance(d, int) for d in s)
    )


def summarize_trace(path: str | Path) -> ProfileSummary:
    """A :class:`ProfileSummary` of a recorded Chrome trace (see the module docstring).

    Its notes name the trace's rank and world size when the trace records them (``distributedInfo``).
    """
    from resource_guard.observe.profiling import summarize_events

    trace = read_trace(path)
    records, steps, notes = trace_records(trace)
    info = trace.get("distributedInfo")
    if isinstance(info, Mapping) and info.get("world_size"):
        notes.append(f"rank {info.get('rank')} of {info.get('world_size')} ({info.get('backend', '?')})")
    summary = summarize_events(records, steps)
    return dataclasses.replace(summary, trace_path=str(path), notes=tuple(notes))
