"""Markdown rendering of a :class:`~resource_guard.Report` (``report.md`` and the TensorBoard text),
the summary rows every rendering shares (:func:`summary_rows`; the console's is
:mod:`resource_guard.report.terminal`), and the value formatting the rules' advice shares.

Memory is compared like with like: on CUDA the allocator's measured peak
(``torch.cuda.max_memory_allocated``) sits beside the estimate of that same quantity, with the
difference; on the CPU the measured figure is the process's RSS (interpreter, libraries and
allocator caches included), labelled so, and the pre-flight tensor estimate is shown apart, marked as
not comparable with it.
"""

from __future__ import annotations

from typing import Any, Protocol

from resource_guard.devices import format_bytes
from resource_guard.report.breakdown import breakdown_markdown
from resource_guard.report.types import Finding, RunStats, plan_mib

__all__ = ["close_text", "format_value", "memory_note", "render_markdown", "summary_rows"]


class Rendered(Protocol):
    """What :func:`render_markdown` reads of a :class:`~resource_guard.Report`."""

    @property
    def verdict(self) -> str: ...
    @property
    def findings(self) -> tuple[Finding, ...]: ...
    @property
    def stats(self) -> RunStats: ...


def format_value(value: Any) -> str:
    """A table or evidence value: ``-`` for unknown, floats to 4 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _plan_rows(s: RunStats) -> list[tuple[str, Any]]:
    """The plan's memory figures, named and written as the plan's text writes them."""
    rows: list[tuple[str, Any]] = []
    if s.predicted_peak_bytes:
        rows.append(("predicted peak (the plan's)", plan_mib(s.predicted_peak_bytes)))
    if s.usable_bytes:
        rows.append(("usable (the plan's)", plan_mib(s.usable_bytes)))
    if s.usable_bytes or s.predicted_peak_bytes:  # planned: the capacity the plan fitted the step into
        rows.append(("capacity (the plan's)", plan_mib(s.capacity_bytes) if s.capacity_bytes else None))
    return rows


def _memory_rows(s: RunStats) -> list[tuple[str, Any]]:
    """Measured and estimated memory, each labelled with what it counts; like beside like only. On a
    planned run, the plan's predicted peak, usable line and capacity, as the plan states them."""
    planned = _plan_rows(s)
    if s.peak_memory_source == "cuda_allocated":
        rows: list[tuple[str, Any]] = [
            ("peak allocated (max_memory_allocated)", format_bytes(s.peak_memory_bytes)),
            ("estimated allocated peak", format_bytes(s.estimated_peak_bytes)),
        ]
        if s.peak_memory_bytes and s.estimated_peak_bytes:
            error = s.peak_memory_bytes / s.estimated_peak_bytes - 1
            rows.append(("measured vs estimate", f"{error:+.1%}"))
        return [*rows, *(planned or [("capacity", format_bytes(s.capacity_bytes))])]
    if s.peak_memory_source == "rss":
        rows = [
            ("process RSS peak (whole process)", format_bytes(s.peak_memory_bytes)),
            ("host RAM", format_bytes(s.measured_capacity_bytes)),
        ]
        if planned:  # the plan's figures count tensor bytes: not comparable with the RSS
            return [*rows, *planned]
        return [
            *rows,
            ("pre-flight tensor estimate (not comparable with RSS)", format_bytes(s.estimated_peak_bytes)),
        ]
    return [
        ("peak memory", format_bytes(s.peak_memory_bytes)),
        ("estimated peak", format_bytes(s.estimated_peak_bytes)),
        *(planned or [("capacity", format_bytes(s.capacity_bytes))]),
    ]


def summary_rows(s: RunStats) -> list[tuple[str, str]]:
    """The report's summary table as ``(metric, value)`` strings, the same for every rendering."""
    rows: list[tuple[str, Any]] = [
        ("step time", None if s.step_time_s is None else f"{s.step_time_s * 1e3:.2f} ms"),
        ("data wait share", None if s.data_wait_share is None else f"{s.data_wait_share:.1%}"),
        ("samples/s", s.samples_per_s),
        ("tokens/s", s.tokens_per_s),
        ("MFU", None if s.mfu is None else f"{s.mfu:.1%}"),
        *_memory_rows(s),
        ("GPU utilization", None if s.gpu_util_percent is None else f"{s.gpu_util_percent:.0f}%"),
        ("process CPU", None if s.process_cpu_percent is None else f"{s.process_cpu_percent:.0f}%"),
        ("precision", s.precision),
        ("monitor close", close_text(s)),
    ]
    return [(name, format_value(value)) for name, value in rows]


def close_text(s: RunStats) -> str | None:
    """The monitor's own close time before the report, with its slower parts.

    >>> close_text(RunStats(close_s=0.31, close_parts={"profile summary": 0.05, "memory picture": 0.2}))
    '0.31 s (memory picture 0.20 s, profile summary 0.05 s)'
    """
    if s.close_s is None:
        return None
    parts = sorted((s.close_parts or {}).items(), key=lambda kv: -kv[1])
    detail = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts)
    return f"{s.close_s:.2f} s" + (f" ({detail})" if detail else "")


def memory_note(s: RunStats) -> str | None:
    """Why the CPU report does not compare its memory figures (None when they are comparable)."""
    if s.peak_memory_source != "rss":
        return None
    return (
        "on the CPU the measured memory is the process's RSS (the interpreter, torch's libraries and "
        "allocator caches as well as tensors); the pre-flight estimate counts live tensors only, so the "
        "two are not compared (the estimate-drift check needs the CUDA allocator's peak)."
    )


def render_markdown(report: Rendered) -> str:
    """The report as markdown: the measured summary table, the findings, the profiler window, notes."""
    s = report.stats
    lines = [
        "# resource_guard report",
        "",
        f"**Verdict: {report.verdict}** ({s.steps} steps on {s.device})",
        "",
    ]
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in summary_rows(s)]
    lines += ["", *breakdown_markdown(s)] if s.phases else []
    lines += ["", "## Findings", ""]
    for f in report.findings:
        lines += [f"### {f.id} ({f.severity})", "", f.title, ""]
        if f.evidence:
            ev = ", ".join(f"{k}={format_value(v)}" for k, v in f.evidence.items() if v is not None)
            lines += [f"Evidence: {ev}", ""]
        lines += [f"- {a}" for a in f.advice] + [""]
    if s.profile is not None:
        p = s.profile
        lines += ["## Profiler window", "", f"{p.steps} steps recorded; trace: {p.trace_path or '-'}", ""]
        if p.top_ops:
            lines += ["| op | calls/step | self CPU us/step |", "|---|---|---|"]
            lines += [f"| {name} | {calls} | {us:.1f} |" for name, calls, us in p.top_ops]
            lines.append("")
    note = memory_note(s)
    lines += [f"Note: {n}" for n in (*s.notes, *([note] if note else []))]
    return "\n".join(lines).rstrip() + "\n"
