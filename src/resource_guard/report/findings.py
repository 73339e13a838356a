"""The bottleneck report: measured facts of a run (:class:`RunStats`) → findings → markdown / JSON.

Every rule is a small pure function ``RunStats -> Finding | None`` (:mod:`resource_guard.report.rules`, where
the thresholds are documented); :func:`analyze` runs them all and adds ``healthy`` when no rule raised
a warning. Finding ids are stable (``report.json`` consumers rely on them): ``oom``, ``input-bound``,
``launch-bound``, ``memory-pressure``, ``precision``, ``host-to-device``, ``alignment``,
``estimate-drift``, ``memory-growth``, ``fragmentation``, ``healthy``. The markdown rendering is in
:mod:`resource_guard.report.markdown`.

Example:
    >>> stats = RunStats(steps=50, data_wait_share=0.4, loader_info={"num_workers": 0}, available_cores=8)
    >>> r = analyze(stats)
    >>> r.verdict, r.findings[0].severity
    ('input-bound', 'critical')
    >>> "num_workers" in r.findings[0].advice[0]
    True
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resource_guard.report.markdown import render_markdown
from resource_guard.report.plan_advice import chosen_row, larger_micro_batch_fits, quote
from resource_guard.report.rules import CRITICAL_DATA_WAIT_SHARE as CRITICAL_DATA_WAIT_SHARE
from resource_guard.report.rules import ESTIMATE_DRIFT_FRACTION as ESTIMATE_DRIFT_FRACTION
from resource_guard.report.rules import H2D_SHARE as H2D_SHARE
from resource_guard.report.rules import LOW_GPU_UTIL_PERCENT as LOW_GPU_UTIL_PERCENT
from resource_guard.report.rules import MANY_KERNELS_PER_STEP as MANY_KERNELS_PER_STEP
from resource_guard.report.rules import MEMORY_PRESSURE_FRACTION as MEMORY_PRESSURE_FRACTION
from resource_guard.report.rules import MISALIGNED_MATMUL_SHARE as MISALIGNED_MATMUL_SHARE
from resource_guard.report.rules import RULES
from resource_guard.report.rules import TINY_KERNEL_US as TINY_KERNEL_US
from resource_guard.report.rules import rule_alignment as rule_alignment
from resource_guard.report.rules import rule_estimate_drift as rule_estimate_drift
from resource_guard.report.rules import rule_fragmentation as rule_fragmentation
from resource_guard.report.rules import rule_host_to_device as rule_host_to_device
from resource_guard.report.rules import rule_input_bound as rule_input_bound
from resource_guard.report.rules import rule_launch_bound as rule_launch_bound
from resource_guard.report.rules import rule_memory_growth as rule_memory_growth
from resource_guard.report.rules import rule_memory_pressure as rule_memory_pressure
from resource_guard.report.rules import rule_oom as rule_oom
from resource_guard.report.rules import rule_precision as rule_precision
from resource_guard.report.types import FINDING_IDS, SEVERITIES, Finding, RunStats, available_cores

__all__ = [
    "SEVERITIES",
    "FINDING_IDS",
    "Finding",
    "Report",
    "RunStats",
    "RULES",
    "analyze",
    "rank_key",
    "available_cores",
    "report_command",
]


def _healthy(s: RunStats) -> Finding:
    evidence: dict[str, Any] = {
        "step_time_s": s.step_time_s,
        "data_wait_share": s.data_wait_share,
        "mfu": s.mfu,
    }
    mfu = f", MFU {s.mfu:.0%}" if s.mfu is not None else ""
    advice = (_healthy_advice(s.plan_rows),)
    title = f"Compute-bound (healthy){mfu}"
    if s.phases and s.step_time_s:  # why: the step is its own compute, nothing else costs 10%
        compute = sum(float(s.phases.get(p) or 0.0) for p in ("forward", "backward", "optimizer"))
        evidence["compute_share"] = round(compute / s.step_time_s, 4)
        title += f": forward, backward and the optimizer are {compute / s.step_time_s:.0%} of the step"
    return Finding("healthy", "info", title, evidence, advice)


def _healthy_advice(rows: Any) -> str:
    """More speed for a compute-bound step, as the plan allows: a larger micro-batch only where the
    plan's table has one that fits (quoted), never past the micro-batch the plan capped."""
    head = "No bottleneck found: the step is compute-bound."
    larger = larger_micro_batch_fits(rows)
    if larger is not None:
        return f"{head} For more speed: a larger micro-batch ({quote(larger)}), or a faster device."
    chosen = chosen_row(rows)
    if chosen is not None:
        return (
            f"{head} The plan's micro-batch is the largest that fits ({quote(chosen)}): for more speed, "
            "a faster device or more of them."
        )
    return f"{head} For more speed, a faster device or more of them (plan a larger batch before using one)."


def analyze(stats: RunStats, rules: tuple[Callable[[RunStats], Finding | None], ...] = RULES) -> Report:
    """Run every rule over ``stats``; findings ranked so that the first is the one to fix first
    (:func:`rank_key`)."""
    found = [f for f in (rule(stats) for rule in rules) if f is not None]
    if not any(f.severity != "info" and f.id not in MACHINE_IDS for f in found):
        found.insert(0, _healthy(stats))  # the code is healthy, however busy the machine
    found.sort(key=lambda f: rank_key(f, stats.step_time_s))
    if found and found[0].id == "healthy":  # the machine's cost, when it has one, is what to know first
        machine = [f for f in found if f.id in MACHINE_IDS and f.severity != "info"]
        found = machine + [f for f in found if f not in machine]
    return Report(tuple(found), stats)


# findings about the machine the run shares, not about its code: beside them the code can be healthy
MACHINE_IDS = ("cpu-contention",)


_STOPS = ("oom", "shapes")  # the run stopped (or will): fixed before any speed-up matters


def rank_key(finding: Finding, step_time_s: float | None) -> tuple[int, int, float]:
    """Where ``finding`` goes: ``healthy`` first when present (only info findings beside it); then
    critical ``oom`` and shape stops; then by the time the finding costs (the step minus its predicted
    step), with findings that cost no measured time after those that do, each group by severity. The
    machine's findings (:data:`MACHINE_IDS`: other processes' CPU) come after the causes in the code,
    which the user can change and which stay the same on an idle machine (:func:`analyze` names the
    machine's cost first when the code is healthy)."""
    severity = -SEVERITIES.index(finding.severity)
    if finding.id == "healthy":
        return (0, severity, 0.0)
    if finding.id in _STOPS and finding.severity == "critical":
        return (1, severity, 0.0)
    if finding.severity != "info" and finding.predicted_step_s is not None and step_time_s:
        return (2, int(finding.id in MACHINE_IDS), -(step_time_s - finding.predicted_step_s))
    return (3, severity, 0.0)


@dataclass(frozen=True)
class Report:
    """Findings (most severe first) and the measured summary they were drawn from."""

    findings: tuple[Finding, ...]
    stats: RunStats = field(default_factory=RunStats)

    @property
    def verdict(self) -> str:
        """Id of the most severe finding (``"healthy"`` when nothing is wrong)."""
        return self.findings[0].id if self.findings else "healthy"

    def finding(self, finding_id: str) -> Finding | None:
        return next((f for f in self.findings if f.id == finding_id), None)

    def summary_line(self) -> str:
        """One line for the console."""
        s = self.stats
        parts = [f"verdict {self.verdict}", f"{s.steps} steps"]
        if s.step_time_s is not None:
            parts.append(f"{s.step_time_s * 1e3:.1f} ms/step")
        if s.data_wait_share is not None:
            parts.append(f"data wait {s.data_wait_share:.0%}")
        if s.samples_per_s is not None:
            parts.append(f"{s.samples_per_s:.1f} samples/s")
        if s.mfu is not None:
            parts.append(f"MFU {s.mfu:.1%}")
        return "resource_guard: " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "findings": [f.to_dict() for f in self.findings],
            "summary": self.stats.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        findings = tuple(
            Finding(
                f["id"],
                f["severity"],
                f["title"],
                dict(f.get("evidence", {})),
                tuple(f.get("advice", ())),
                f.get("predicted_step_s"),
            )
            for f in data.get("findings", ())
        )
        return cls(findings, RunStats.from_dict(data.get("summary", {})))

    def to_markdown(self) -> str:
        """The report as markdown (``report.md``)."""
        return render_markdown(self)


def _find_report(logdir: Path) -> Path | None:
    direct = logdir / "report.json"
    if direct.is_file():
        return direct
    found = sorted(logdir.rglob("report.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def report_command(logdir: str, *, as_json: bool = False, as_markdown: bool = False) -> int:
    """``resource-guard report LOGDIR``: print the report of a finished run; returns the exit code.

    Reads ``LOGDIR/report.json`` (or the newest ``report.json`` below it, e.g. a Lightning version
    directory) and prints it for the terminal (:mod:`resource_guard.report.terminal`), or as JSON, or
    as the Markdown of ``report.md``. Exit 0 when printed, 2 when there is no readable report.
    """
    path = _find_report(Path(logdir))
    if path is None:
        print(
            f"resource-guard report: no report.json in {logdir!r} (is it the log dir of a finished run?)",
            file=sys.stderr,
        )
        return 2
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        report = Report.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(
            f"resource-guard report: {path} is not a readable report ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return 2
    if as_json or as_markdown:
        print(json.dumps(data, indent=2) if as_json else report.to_markdown())
    else:
        from resource_guard.report.terminal import render_report

        render_report(report)
    return 0
