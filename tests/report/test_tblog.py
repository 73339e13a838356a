"""Tests for resource_guard.report.tensorboard: scalars, layout, text, the memory picture, a real TensorBoard.

One slow test starts ``tensorboard --logdir`` on loopback and asks its HTTP API for the scalar tags
and the report text of a monitored CPU run.
"""

from __future__ import annotations

import doctest
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import lagging_tensorboard
from resource_guard.estimate import estimate_memory
from resource_guard.observe.monitor import RunMonitor
from resource_guard.report import tensorboard as tblog
from resource_guard.report.tensorboard import TBLog, custom_scalar_layout


def _accumulator(log_dir: Path) -> EventAccumulator:
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    ea.Reload()
    return ea


def test_docstring_examples_run() -> None:
    assert doctest.testmod(tblog).failed == 0


def test_layout_groups_related_curves_under_the_prefix() -> None:
    charts = custom_scalar_layout()["resource_guard"]
    kind, regexes = charts["step time (ms)"]
    assert kind == "Multiline" and all(r.startswith("^resource_guard/1_step/") for r in regexes)
    assert any("data_wait_pct" in r for r in charts["data wait (% of the step)"][1])
    # one unit per chart: samples/s apart from tokens/s, MFU apart from CPU %
    assert charts["samples/s"][1] != charts["tokens/s"][1] and "mfu" not in str(
        charts["CPU and GPU busy (%)"]
    )
    cpu = custom_scalar_layout(cuda=False)["resource_guard"]  # no chart that stays empty on a CPU
    assert "GPU power (W)" in charts and not [t for t in cpu if "GPU power" in t or "retries" in t]


def test_scalars_text_and_image_land_in_the_event_file(tmp_path: Path) -> None:
    log = TBLog(log_dir=tmp_path)
    log.layout()
    log.scalars(3, {"time/step_s": 0.5, "skip/none": None, "skip/nan": float("nan")})
    log.text("report", "# hello")
    log.image("memory", np.zeros((4, 6, 3), dtype=np.uint8))
    log.close()
    log.close()
    ea = _accumulator(tmp_path)
    assert ea.Tags()["scalars"] == ["resource_guard/time/step_s"]
    assert ea.Scalars("resource_guard/time/step_s")[0].step == 3
    assert "resource_guard/report/text_summary" in ea.Tags()["tensors"]
    assert "custom_scalars__config__" in ea.Tags()["tensors"]
    image = ea.Images("resource_guard/memory")[0]
    assert (image.width, image.height) == (6, 4)


# the writer thread dies on the injected disk error (its traceback is pytest's warning)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("background", [True, False])
def test_what_was_logged_is_in_the_file_by_the_next_call_however_late_the_writer_thread_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    """The writer thread writes only while someone waits for it. In the background, a call's events
    are on disk once the next call returns (or wait()); in the foreground, once the call returns."""
    disk = lagging_tensorboard.install(monkeypatch)
    log = TBLog(log_dir=tmp_path, background=background)
    log.layout()
    log.scalars(1, {"time/step_s": 0.5})
    log.text("report", "# so far")  # the next call: scalars(1) is on disk when it returns
    assert _accumulator(tmp_path).Scalars("resource_guard/time/step_s")[0].step == 1, "not in the file yet"
    log.wait()
    disk.full()
    with pytest.raises(OSError, match="No space left"):  # the call that hit the fault (or the next) says so
        log.scalars(2, {"time/step_s": 0.6})
        log.wait()
    with pytest.raises(OSError, match="No space left"):
        log.close()  # its thread and file let go of all the same (test_faults checks that)
    ea = _accumulator(tmp_path)
    assert [e.step for e in ea.Scalars("resource_guard/time/step_s")] == [1]
    assert "resource_guard/report/text_summary" in ea.Tags()["tensors"]


def test_background_events_are_on_disk_after_close_and_after_an_exception_in_the_loop(
    tmp_path: Path,
) -> None:
    """The monitor closes its TBLog when the loop raises: what it logged is readable then."""
    from resource_guard import guard

    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(4, 8) for _ in range(60)]
    with pytest.raises(RuntimeError, match="boom"):  # guard logs at steps 1 and 50, and at close
        with guard(model, optimizer, log_dir=tmp_path, profile=False, log_every_n_steps=50) as g:
            for i, x in enumerate(g.iterate(batches)):
                g.backward(model(x).sum())
                if i == 54:
                    raise RuntimeError("boom")
    steps = [e.step for e in _accumulator(tmp_path).Scalars("resource_guard/1_step/time_ms")]
    assert steps == [1, 50, 54], steps  # the last interval, written at close: 54 steps completed
    log = TBLog(log_dir=tmp_path / "plain")
    for step in range(1, 4):
        log.scalars(step, {"time/step_s": step / 10})
    log.close()
    log.close()  # idempotent
    assert [e.step for e in _accumulator(tmp_path / "plain").Scalars("resource_guard/time/step_s")] == [
        1,
        2,
        3,
    ]


def test_the_private_file_writer_hook_still_exists(tmp_path: Path) -> None:
    """``TBLog.scalars`` writes one event per step through ``SummaryWriter._get_file_writer``."""
    writer = SummaryWriter(str(tmp_path))
    assert tblog._file_writer(writer) is not None, "torch moved SummaryWriter._get_file_writer"
    writer.close()


def test_other_writers_get_add_scalar_calls() -> None:
    calls: list[tuple[str, float, int]] = []

    class Minimal:
        def add_scalar(self, tag: str, value: float, step: int) -> None:
            calls.append((tag, value, step))

    log = TBLog(Minimal())
    log.scalars(2, {"a": 1.0, "b": None})
    log.wait()
    assert calls == [("resource_guard/a", 1.0, 2)]


def test_a_given_writer_is_flushed_but_not_closed(tmp_path: Path) -> None:
    writer = SummaryWriter(str(tmp_path))
    log = TBLog(writer)
    log.scalars(1, {"x": 1.0})
    log.close()
    writer.add_scalar("still/open", 1.0, 1)  # would raise if closed
    writer.close()


def test_tblog_needs_a_writer_or_a_log_dir() -> None:
    with pytest.raises(ValueError, match="writer or a log_dir"):
        TBLog().scalars(0, {"x": 1.0})


def test_the_monitor_writes_the_picture_of_its_estimate(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4)
    batch = torch.randn(16, 8)
    est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, lambda m, b: m(b).sum())
    capacity = 4 * est.peak_bytes
    mon = RunMonitor(
        tmp_path, estimate=est, capacity_bytes=capacity, profile=False, interval_s=0.01, summary=False
    )
    mon.start()
    mon.batch_ready(batch)
    mon.step_end()
    mon.close()
    assert (tmp_path / "memory.png").read_bytes().startswith(b"\x89PNG")
    assert "resource_guard/memory" in _accumulator(tmp_path).Tags()["images"]


# -- a real TensorBoard ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str, **params: str) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}{query}", timeout=5) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_a_real_tensorboard_serves_the_scalars_and_the_report(tmp_path: Path) -> None:
    mon = RunMonitor(tmp_path / "run", profile=False, interval_s=0.01, log_every_n_steps=2, summary=False)
    mon.start()
    for _ in range(5):
        time.sleep(0.01)  # a slow loader
        mon.batch_ready(torch.zeros(4, 3))
        mon.step_end()
    report = mon.close()
    assert report is not None
    exe = shutil.which("tensorboard")
    cmd = [exe] if exe else [sys.executable, "-m", "tensorboard.main"]
    port = _free_port()
    proc = subprocess.Popen(
        [*cmd, "--logdir", str(tmp_path), "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # TensorBoard loads the run in a background thread, event by event: poll until the last event
        # (the report, written at close) is served; the deadline only bounds a hang
        deadline = time.monotonic() + 120
        tags: dict[str, Any] = {}
        text_tags: dict[str, Any] = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, "tensorboard exited"
            try:
                text_tags = _get(port, "/data/plugin/text/tags")
                if "resource_guard/report/text_summary" in text_tags.get("run", []):
                    tags = _get(port, "/data/plugin/scalars/tags").get("run", {})
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert "resource_guard/report/text_summary" in text_tags.get("run", []), text_tags
        assert "resource_guard/1_step/data_wait_pct" in tags and "resource_guard/1_step/time_ms" in tags
        texts = _get(port, "/data/plugin/text/text", run="run", tag="resource_guard/report/text_summary")
        assert f"Verdict: {report.verdict}" in texts[-1]["text"]
    finally:
        proc.kill()
        proc.wait(timeout=30)
