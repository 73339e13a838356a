"""Markdown rendering of a :class:`~resource_guard.Report` (``report.md``, the TensorBoard
text and ``resource-guard report``), and the value formatting the rules' advice shares.
"""

from __future__ import annotations

from typing import Any, Protocol

from resource_guard.devices import format_bytes
from resource_guard.report.types import Finding, RunStats

__all__ = ["format_value", "render_markdown"]


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


def render_markdown(report: Rendered) -> str:
    """The report as markdown: the measured summary table, the findings, the profiler window, notes."""
    s = report.stats
    lines = [
        "# resource_guard report",
        "",
        f"**Verdict: {report.verdict}** ({s.steps} steps on {s.device})",
        "",
    ]
    rows = [
        ("step time", None if s.step_time_s is None else f"{s.step_time_s * 1e3:.2f} ms"),
        ("data wait share", None if s.data_wait_share is None else f"{s.data_wait_share:.1%}"),
        ("samples/s", s.samples_per_s),
        ("tokens/s", s.tokens_per_s),
        ("MFU", None if s.mfu is None else f"{s.mfu:.1%}"),
        (f"peak memory ({s.peak_memory_source or '-'})", format_bytes(s.peak_memory_bytes)),
        ("estimated peak", format_bytes(s.estimated_peak_bytes)),
        ("capacity", format_bytes(s.capacity_bytes)),
        ("GPU utilization", None if s.gpu_util_percent is None else f"{s.gpu_util_percent:.0f}%"),
        ("process CPU", None if s.process_cpu_percent is None else f"{s.process_cpu_percent:.0f}%"),
        ("precision", s.precision),
    ]
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {name} | {format_value(value)} |" for name, value in rows]
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
    lines += [f"Note: {n}" for n in s.notes]
    return "\n".join(lines).rstrip() + "\n"
