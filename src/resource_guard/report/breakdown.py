"""The step-time breakdown for people: a table and a stacked bar of ``RunStats.phases``, shared by
``report.md``, the terminal report and the end-of-run summary.

Example:
    >>> s = RunStats(step_time_s=0.1, phases={"data_wait": 0.01, "forward": 0.03, "backward": 0.06})
    >>> stacked_bar(s, width=10)
    'DFFFBBBBBB'
    >>> phase_line(s)
    'step 100.0 ms: data wait 10% · forward 30% · backward 60%'
"""

from __future__ import annotations

from resource_guard.report.types import PHASES, RunStats

__all__ = ["PHASE_LABELS", "PHASE_LETTERS", "breakdown_markdown", "phase_line", "phase_rows", "stacked_bar"]

PHASE_LABELS = {
    "data_wait": "data wait",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "host": "host (between steps)",
    "evaluation": "evaluation",
    "checkpoint": "checkpoint",
    "logging": "logging",
    "communication": "communication",
    "other": "other",
}
PHASE_LETTERS = {
    "data_wait": "D",
    "forward": "F",
    "backward": "B",
    "optimizer": "O",
    "host": "H",
    "evaluation": "E",
    "checkpoint": "C",
    "logging": "L",
    "communication": "M",
    "other": ".",
}


def phase_rows(s: RunStats, min_share: float = 0.0) -> list[tuple[str, float, float]]:
    """``(phase, seconds per step, share of the step)`` in :data:`PHASES` order; empty when unmeasured.

    Phases with a share of ``min_share`` or less are left out (none by default: every non-zero one).
    """
    if not s.phases or not s.step_time_s:
        return []
    rows = [(p, float(s.phases.get(p) or 0.0)) for p in PHASES]
    return [(p, v, v / s.step_time_s) for p, v in rows if v > 0 and v / s.step_time_s > min_share]


def stacked_bar(s: RunStats, width: int = 50) -> str:
    """One letter per ``1/width`` of the step (:data:`PHASE_LETTERS`), largest remainders rounded up."""
    rows = phase_rows(s)
    if not rows:
        return ""
    total = sum(share for _, _, share in rows)
    exact = [(p, share / total * width) for p, _, share in rows]
    cells = {p: int(x) for p, x in exact}
    for p, _ in sorted(exact, key=lambda e: e[1] - int(e[1]), reverse=True)[: width - sum(cells.values())]:
        cells[p] += 1
    return "".join(PHASE_LETTERS[p] * cells[p] for p, _ in exact)


def phase_line(s: RunStats) -> str:
    """The breakdown on one line (phases of at least 0.5% of the step)."""
    rows = phase_rows(s, min_share=0.005)
    if not rows or s.step_time_s is None:
        return ""
    parts = " · ".join(f"{PHASE_LABELS[p].split(' (')[0]} {share:.0%}" for p, _, share in rows)
    return f"step {s.step_time_s * 1e3:.1f} ms: {parts}"


def breakdown_markdown(s: RunStats) -> list[str]:
    """The "Where the time goes" section of ``report.md`` (empty when the phases were not measured)."""
    rows = phase_rows(s)
    if not rows:
        return []
    lines = ["## Where the time goes", "", "| phase | ms/step | share |", "|---|---|---|"]
    lines += [f"| {PHASE_LABELS[p]} | {v * 1e3:.2f} | {share:.1%} |" for p, v, share in rows]
    legend = ", ".join(f"{PHASE_LETTERS[p]} {PHASE_LABELS[p]}" for p, _, _ in rows)
    lines += ["", "```", f"|{stacked_bar(s)}|", "```", f"({legend})", ""]
    return lines
