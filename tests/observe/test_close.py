"""Closing the monitor (issue #40): its own time is in the report, and at most one end-of-run probe runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resource_guard.observe import outputs, threads
from resource_guard.observe.monitor import RunMonitor
from resource_guard.observe.threads import ThreadDemand
from resource_guard.report.markdown import close_text


def _run(monitor: RunMonitor, steps: int = 4) -> None:
    monitor.start()
    for _ in range(steps):
        monitor.batch_ready(torch.zeros(8, 4))
        monitor.step_end()


def test_the_close_time_is_in_the_report_and_its_files(tmp_path: Path) -> None:
    monitor = RunMonitor(tmp_path, interval_s=0.05, profile=False, summary=False)
    _run(monitor)
    report = monitor.close()
    assert report is not None and report.stats.close_s is not None and report.stats.close_s >= 0.0
    assert monitor.close_s is not None and monitor.close_s >= report.stats.close_s
    assert "| monitor close |" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["close_s"] == report.stats.close_s
    first = monitor.close_s
    assert monitor.close() is report and monitor.close_s == first  # closing twice does no work


def test_close_text_lists_the_slower_parts_first() -> None:
    from resource_guard.report.types import RunStats

    assert close_text(RunStats()) is None
    text = close_text(RunStats(close_s=0.5, close_parts={"a": 0.1, "b": 0.3}))
    assert text == "0.50 s (b 0.30 s, a 0.10 s)"


def test_at_most_one_end_of_run_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A for-loop optimizer worth its probe and oversubscribed threads: the optimizer's probe runs, the
    threads' is left out with a note (each is bounded to about half a second)."""
    calls: list[str] = []
    monkeypatch.setattr(outputs, "foreach_probe", lambda opt, step_s=None: calls.append("optimizer") or None)
    monkeypatch.setattr(threads, "oversubscription_slowdown", lambda *a, **k: calls.append("threads") or 2.0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(20)])  # 40 parameter tensors
    monitor = RunMonitor(tmp_path, interval_s=0.05, profile=False, summary=False, phase_timing=True)
    monitor.optimizers = [torch.optim.AdamW(model.parameters(), foreach=False)]
    _run(monitor, 0)
    assert monitor.phases is not None
    for _ in range(4):
        monitor.batch_ready(torch.zeros(8, 4))
        monitor.phases.switch("optimizer")
        monitor.step_end()
    monitor._threads = ThreadDemand(intra_op=16, processes=1, workers=0, cores=2)
    report = monitor.close()
    assert report is not None
    assert calls == ["optimizer"]
    assert any("one end-of-run probe" in n for n in report.stats.notes)
    assert "optimizer probe" in report.stats.close_parts or report.stats.close_parts == {}
