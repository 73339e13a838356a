"""The monitor's projection of the remaining run (issue #13): ETA and cost in the report and TensorBoard."""

from __future__ import annotations

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from resource_guard.devices import load_catalog
from resource_guard.observe.monitor import RunMonitor


def _run(tmp_path, total_steps, steps=4):
    t4 = load_catalog().get("t4")
    monitor = RunMonitor(
        tmp_path, device="cpu", device_spec=t4, profile=False, summary=False, log_every_n_steps=2
    )
    monitor.total_steps = total_steps
    monitor.start()
    batch = torch.zeros(4, 3)
    for _ in range(steps):
        monitor.batch_ready(batch)
        torch.ones(64, 64) @ torch.ones(64, 64)
        monitor.step_end()
    monitor.close()
    return json.loads((tmp_path / "report.json").read_text())


def test_report_carries_eta_and_cost_of_the_remaining_steps(tmp_path):
    data = _run(tmp_path, total_steps=1004)
    left = data["projection"]
    assert left["remaining_steps"] == 1000 and left["device"] == "t4"
    assert left["eta_hours"] == pytest.approx(1000 * left["step_s"] / 3600)
    assert left["cost_usd"] == pytest.approx(left["eta_hours"] * 0.526)
    assert "**Projection**: 1,000 steps left" in (tmp_path / "report.md").read_text()
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0}).Reload()
    assert any("projection" in tag for tag in events.Tags()["tensors"])


def test_without_a_known_length_there_is_no_projection(tmp_path):
    assert "projection" not in _run(tmp_path, total_steps=None)
