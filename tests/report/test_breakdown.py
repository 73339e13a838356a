"""The step-time breakdown in report.md, the terminal report and the summary line."""

from __future__ import annotations

import io

from resource_guard.report.breakdown import PHASE_LETTERS, phase_line, phase_rows, stacked_bar
from resource_guard.report.findings import analyze
from resource_guard.report.terminal import make_console, render_report
from resource_guard.report.types import RunStats

S = RunStats(
    steps=20,
    step_time_s=0.2,
    phases={"data_wait": 0.01, "forward": 0.05, "backward": 0.1, "checkpoint": 0.04},
)


def test_the_bar_has_the_width_and_each_phase_its_share() -> None:
    bar = stacked_bar(S, width=40)
    assert len(bar) == 40
    assert bar.count(PHASE_LETTERS["backward"]) == 20 and bar.count(PHASE_LETTERS["forward"]) == 10
    assert stacked_bar(RunStats()) == "" and phase_rows(RunStats()) == []


def test_the_line_leaves_out_tiny_phases() -> None:
    line = phase_line(S)
    assert line.startswith("step 200.0 ms") and "checkpoint 20%" in line and "other" not in line


def test_report_md_and_terminal_show_the_breakdown() -> None:
    report = analyze(S)
    md = report.to_markdown()
    assert "## Where the time goes" in md and "| checkpoint | 40.00 | 20.0% |" in md
    out = io.StringIO()
    render_report(report, make_console(out))
    text = out.getvalue()
    assert "Where the time goes" in text and stacked_bar(S) in text
    assert "Where the time goes" not in analyze(RunStats(steps=3)).to_markdown()
