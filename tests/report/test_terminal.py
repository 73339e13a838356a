"""Console rendering (``resource_guard.report.terminal``): plain off a terminal, coloured on one."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import torch

from resource_guard import plan
from resource_guard.observe.profiling import ProfileSummary
from resource_guard.report.findings import Report, RunStats, analyze
from resource_guard.report.terminal import (
    make_console,
    render_nofit,
    render_plan,
    render_report,
    render_summary,
)

MiB = 2**20
ANSI = re.compile(r"\x1b\[")
COLOUR = re.compile(r"\x1b\[(?:[0-9;]*;)?(?:3[0-7]|9[0-7]|38;[0-9;]+)(?:;[0-9;]*)?m")
MARKDOWN = [
    re.compile(r"\*\*"),
    re.compile(r"^\s*#{1,6} ", re.MULTILINE),
    re.compile(r"\|"),
    re.compile(r"^\s*:?-{3,}", re.MULTILINE),
]


def _report() -> Report:
    stats = RunStats(
        steps=40,
        step_time_s=0.01,
        data_wait_share=0.5,
        samples_per_s=1234.5,
        peak_memory_bytes=int(9.6 * 2**30),
        peak_memory_source="cuda_allocated",
        estimated_peak_bytes=8 * 2**30,
        capacity_bytes=10 * 2**30,
        device="cuda:0",
        device_kind="cuda",
        tensor_cores=True,
        loader_info={"num_workers": 0},
        available_cores=4,
        profile=ProfileSummary(steps=3, top_ops=(("aten::mm", 3, 7.5), ("aten::addmm", 12, 100.25))),
        notes=("a note",),
    )
    return analyze(stats)


def _plan() -> Any:
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    batch = torch.randn(1024, 64)
    return plan(
        model,
        torch.optim.SGD,
        batch,
        lambda m, b: m(b).mean(),
        device="cpu",
        precision="32-true",
        memory_limit="4MiB",
    )


def _render(draw: Any, *, terminal: bool) -> str:
    out = io.StringIO()
    draw(make_console(out, force_terminal=terminal))
    return out.getvalue()


@pytest.fixture(autouse=True)
def _no_colour_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NO_COLOR", "FORCE_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def test_off_a_terminal_there_is_no_markdown_and_no_ansi() -> None:
    report, made = _report(), _plan()
    for draw in (
        lambda c: render_report(report, c),
        lambda c: render_summary(report, c),
        lambda c: render_plan(made, c),
    ):
        text = _render(draw, terminal=False)
        assert not ANSI.search(text), text
        for pattern in MARKDOWN:
            assert not pattern.search(text), (pattern.pattern, text)
        assert all(line == line.rstrip() for line in text.splitlines())
    text = _render(lambda c: render_report(report, c), terminal=False)
    assert "verdict input-bound" in text and "CRITICAL" in text and "aten::addmm" in text


def test_a_file_that_is_not_a_tty_gets_plain_text(tmp_path: Any) -> None:
    path = tmp_path / "out.txt"
    with path.open("w") as handle:
        render_report(_report(), make_console(handle))
    assert not ANSI.search(path.read_text())


def test_on_a_terminal_severities_have_colour() -> None:
    text = _render(lambda c: render_report(_report(), c), terminal=True)
    assert COLOUR.search(text)
    assert COLOUR.search(_render(lambda c: render_summary(_report(), c), terminal=True))


def test_no_color_removes_colour_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    text = _render(lambda c: render_report(_report(), c), terminal=True)
    assert not COLOUR.search(text)
    assert "\x1b[1m" in text  # bold is not colour: NO_COLOR keeps it


def test_tables_are_aligned() -> None:
    text = _render(lambda c: render_report(_report(), c), terminal=False)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("metric"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append(line)
    assert len(rows) >= 6 and len({len(r) for r in rows}) == 1  # values right-aligned in one column
    names = [r.split("  ")[0] for r in rows]
    assert "peak allocated (max_memory_allocated)" in names
    plan_text = _render(lambda c: render_plan(_plan(), c), terminal=False)
    table = [line for line in plan_text.splitlines() if re.search(r"\d+×\d+ ", line)]
    ends = {line.index(" MiB") for line in table}  # the predicted-peak column is right-aligned
    assert len(table) == 3 and len(ends) == 1


def test_the_plan_and_the_no_fit_report_are_rendered_without_markdown() -> None:
    from resource_guard import DoesNotFitError

    made = _plan()
    text = _render(lambda c: render_plan(made, c), terminal=False)
    assert text.startswith("Plan: ") and "(chosen)" in text and all(f"  - {r}" in text for r in made.reasons)
    model = torch.nn.Linear(256, 256)
    with pytest.raises(DoesNotFitError) as caught:
        plan(model, torch.optim.AdamW, torch.randn(8, 256), lambda m, b: m(b).sum(), memory_limit="64KiB")
    text = _render(lambda c: render_nofit(caught.value.report, c), terminal=False)
    assert text.startswith("DOES NOT FIT") and "|" not in text and "**" not in text


def test_the_run_summary_goes_to_stderr_plain_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from resource_guard.observe.outputs import console_summary

    console_summary(_report())
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("resource_guard: verdict input-bound")
    assert "warning memory-pressure: " in err and not ANSI.search(err)
