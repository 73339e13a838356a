"""Closing a run costs under a second (issue #40) without losing an output: the memory picture is drawn on
a thread from the start and still written by close (or the report says when), and the profiler window
is read only as far as the report needs it (call sites of the ops it can name) with the same result."""

from __future__ import annotations

import gzip
import json
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from resource_guard.errors import ResourceGuardWarning
from resource_guard.estimate import estimate_memory
from resource_guard.observe import outputs, profile_events, profiling
from resource_guard.observe.monitor import RunMonitor
from resource_guard.observe.profiling import ProfileWindow, StepProfiler


@pytest.fixture(scope="module")
def estimate() -> Any:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    batch = (torch.randn(8, 16), torch.randn(8, 1))
    return estimate_memory(
        model, torch.optim.SGD(model.parameters()), batch, lambda m, b: (m(b[0]) - b[1]).pow(2).mean()
    )


def _run(monitor: RunMonitor, steps: int) -> None:
    monitor.start()
    for _ in range(steps):
        monitor.batch_ready(torch.zeros(8, 4))
        monitor.step_end()


def test_the_picture_is_drawn_on_a_thread_from_the_start_and_written_by_close(
    tmp_path: Path, estimate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []

    def drawing(*args: Any, **kwargs: Any) -> np.ndarray:
        threads.append(threading.current_thread().name)
        return np.full((40, 60, 3), 7, dtype=np.uint8)

    monkeypatch.setattr(outputs, "memory_picture", drawing)
    monitor = RunMonitor(tmp_path, interval_s=0.05, profile=False, summary=False, estimate=estimate)
    _run(monitor, 0)
    assert monitor._picture_job is not None  # started with the monitor, before any step
    _run(monitor, 3)
    report = monitor.close()
    assert report is not None
    assert threads == ["resource_guard-memory-picture"]  # drawn once, not on the training thread
    png = np.asarray(Image.open(tmp_path / "memory.png").convert("RGB"))
    assert png.shape == (40, 60, 3) and (png == 7).all()
    assert "memory picture" not in report.stats.close_parts  # nothing left to wait for at close


def test_no_picture_is_drawn_with_nowhere_to_write_it(estimate: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[int] = []
    monkeypatch.setattr(outputs, "memory_picture", lambda *a, **k: drawn.append(1))
    monitor = RunMonitor(None, interval_s=0.05, profile=False, summary=False, estimate=estimate)
    _run(monitor, 2)
    assert monitor.close() is not None
    assert drawn == []


def test_a_drawing_past_the_deadline_writes_memory_png_itself_and_the_report_says_so(
    tmp_path: Path, estimate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def slow(*args: Any, **kwargs: Any) -> np.ndarray:
        release.wait(20)
        return np.full((30, 30, 3), 200, dtype=np.uint8)

    monkeypatch.setattr(outputs, "memory_picture", slow)
    monkeypatch.setattr(outputs, "PICTURE_DEADLINE_S", 0.05)
    monitor = RunMonitor(tmp_path, interval_s=0.05, profile=False, summary=False, estimate=estimate)
    _run(monitor, 3)
    report = monitor.close()
    assert report is not None
    assert any("memory.png is written when it is done" in n for n in report.stats.notes), report.stats.notes
    assert not (tmp_path / "memory.png").exists()
    release.set()
    for _ in range(200):  # the drawing thread writes it as soon as it is done
        if (tmp_path / "memory.png").exists():
            break
        time.sleep(0.05)
    png = np.asarray(Image.open(tmp_path / "memory.png").convert("RGB"))
    assert png.shape == (30, 30, 3) and (png == 200).all()


def test_a_drawing_that_fails_warns_once_and_the_report_is_still_written(
    tmp_path: Path, estimate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> np.ndarray:
        raise ValueError("no fonts")

    monkeypatch.setattr(outputs, "memory_picture", broken)
    monitor = RunMonitor(tmp_path, interval_s=0.05, profile=False, summary=False, estimate=estimate)
    _run(monitor, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = monitor.close()
    assert report is not None and (tmp_path / "report.json").exists()
    assert not (tmp_path / "memory.png").exists()
    messages = [str(w.message) for w in caught if issubclass(w.category, ResourceGuardWarning)]
    assert messages == ["resource_guard monitoring: memory picture disabled: ValueError: no fonts"]


@pytest.mark.parametrize("profile", [False, True])
def test_the_loop_waits_for_the_rest_of_the_drawing_at_the_end_of_the_start_up_step(
    tmp_path: Path, estimate: Any, monkeypatch: pytest.MonkeyPatch, profile: bool
) -> None:
    """The drawing shares the interpreter with the start-up step alone (left out of the run's figures):
    the rest is waited for at its end, before any measured step or the profiler's window (the loop's
    wait is the monitor's cost, stated in the notes)."""
    finished: list[int] = []
    monitor: RunMonitor

    def slow(*args: Any, **kwargs: Any) -> np.ndarray:
        time.sleep(0.3)
        finished.append(monitor.steps)
        return np.zeros((20, 20, 3), dtype=np.uint8)

    monkeypatch.setattr(outputs, "memory_picture", slow)
    window = ProfileWindow(skip_first=2, wait=0, warmup=1, active=1, with_stack=False) if profile else False
    monitor = RunMonitor(tmp_path, interval_s=0.05, profile=window, summary=False, estimate=estimate)
    _run(monitor, 6)
    report = monitor.close()
    assert report is not None and (report.stats.profile is not None) == profile
    assert finished == [1]  # done at the end of step 1, the loop waiting for it there
    assert monitor._picture_wait_s > 0.1
    assert any("held the loop" in n for n in report.stats.notes), report.stats.notes
    # the monitoring cost names the wait as its own part, apart from the log boundaries
    cost = next(n for n in report.stats.notes if n.startswith("monitoring cost"))
    assert f"memory picture at the end of step 1 {monitor._picture_wait_s * 1e3:.1f} ms" in cost, cost
    assert "memory picture" not in report.stats.close_parts
    assert (tmp_path / "memory.png").exists()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(torch.float64).float()) + x


def test_the_sites_read_for_the_wanted_ops_are_those_of_the_whole_tree() -> None:
    model = nn.Sequential(_Block(), _Block())
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    prof = StepProfiler(ProfileWindow(skip_first=0, wait=0, warmup=1, active=2), None)
    prof.start()
    for _ in range(3):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        optimizer.step()
        loss.item()
        prof.step()
    prof.stop()
    result = prof._captured.profiler.kineto_results
    everything = profile_events.op_sites(result)
    records = profile_events.kineto_records(prof._captured)
    assert records is not None
    with_site = {(r.name, r.start_us): r.site for r in records if r.site is not None}
    names = {name for name, _ in with_site}
    assert {"aten::_to_copy", "aten::copy_", "aten::item"} <= names  # casts and the scalar read
    wanted = set(list(everything)[: len(everything) // 3])
    assert profile_events.op_sites(result, wanted) == {key: everything[key] for key in wanted}
    assert profile_events.op_sites(result, set()) == {}
    # each record's site is the whole tree's for that op
    origin = result.trace_start_ns()
    by_start = {(name, (start - origin) / 1e3): site for (name, start), site in everything.items()}
    for key, site in with_site.items():
        assert by_start[key] == site


def test_the_trace_is_compressed_on_a_thread_and_its_failure_still_reaches_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def window() -> StepProfiler:
        prof = StepProfiler(ProfileWindow(skip_first=0, wait=0, warmup=1, active=1), tmp_path, trace_name="t")
        prof.start()
        for _ in range(2):
            torch.randn(8, 8).matmul(torch.randn(8, 8)).sum().item()
            prof.step()
        return prof

    threads: list[str] = []
    real_open = profiling.gzip.open

    def opening(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(profiling.gzip, "open", opening)
    summary = window().summarize()
    assert summary is not None and summary.trace_path == str(tmp_path / "t.pt.trace.json.gz")
    assert threads and threads[0] != threading.main_thread().name
    with gzip.open(summary.trace_path) as f:
        assert "traceEvents" in json.load(f)

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(profiling.gzip, "open", failing)
    with pytest.raises(OSError, match="disk full"):
        window().summarize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.pt.trace.json.gz"]  # no scratch left behind
