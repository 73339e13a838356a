"""One memory story (issue #38): a run planned under a memory cap shows the plan's capacity, usable line
and predicted peak, with the plan's names and figures, in report.json, report.md, the memory picture's
inputs and the tab's Memory view; the process RSS is held against the host's RAM, never the cap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest

from resource_guard import plan
from resource_guard.demo import build
from resource_guard.observe import outputs
from resource_guard.observe.monitor import RunMonitor
from resource_guard.tensorboard_plugin import views
from resource_guard.tensorboard_plugin.runs import find_runs

MiB = 2**20


def test_a_capped_run_writes_the_plans_capacity_usable_and_peak_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the demo's model and loop, smaller: planned as if the device had 80 MiB (the demo's 256 MiB cap)
    model, optimizer, (tokens, targets) = build(batch_size=16, seq_len=32, vocab_size=512)
    planned = plan(
        model, optimizer, (tokens, targets), device="cpu", memory_limit="80MiB", precision="32-true"
    )
    fit = planned.fit
    assert fit.capacity_bytes == 80 * MiB and fit.usable_bytes < fit.capacity_bytes
    drawn: dict[str, Any] = {}
    real = outputs.memory_picture

    def spy(timeline: Any, capacity_bytes: int | None = None, **kwargs: Any) -> Any:
        drawn.update(
            capacity_bytes=capacity_bytes, **{k: v for k, v in kwargs.items() if k.endswith("_bytes")}
        )
        return real(timeline, capacity_bytes, **kwargs)

    monkeypatch.setattr(outputs, "memory_picture", spy)
    ram = int(psutil.virtual_memory().total)
    mon = RunMonitor(
        tmp_path,
        estimate=planned.estimate,
        capacity_bytes=ram,  # what a door hands a CPU run: the RSS's yardstick
        planned_capacity_bytes=fit.capacity_bytes,
        planned_fit=fit,
        profile=False,
        summary=False,
    )
    mon.start()
    micro = planned.micro_batch_size
    for _ in range(3):
        mon.batch_ready(tokens[:micro])
        model(tokens[:micro], targets[:micro]).backward()
        optimizer.step()
        optimizer.zero_grad()
        mon.step_end()
    report = mon.close()
    assert report is not None

    plan_dict = planned.to_dict()  # what guard.json's "plan" holds
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    for key in ("capacity_bytes", "usable_bytes", "predicted_peak_bytes"):
        assert summary[key] == plan_dict[key], key
    assert summary["estimated_peak_bytes"] == fit.allocated_peak_bytes  # guard.json's estimated_peak_bytes
    assert summary["ram_bytes"] == ram and summary["peak_memory_source"] == "rss"
    assert "memory-pressure" not in {f.id for f in report.findings}  # RSS vs RAM, not vs the 80 MiB cap

    # the picture's lines are the same figures
    assert drawn == {
        "capacity_bytes": fit.capacity_bytes,
        "usable_bytes": fit.usable_bytes,
        "predicted_peak_bytes": fit.device_total_bytes,
    }
    assert (tmp_path / "memory.png").is_file()

    # the report's text states them as the plan's text does ("predicted 56.5 of 72.0 MiB usable")
    words = planned.summary().splitlines()[0]
    predicted, usable = f"{fit.device_total_bytes / MiB:,.1f} MiB", f"{fit.usable_bytes / MiB:,.1f} MiB"
    assert f"predicted {predicted[:-4]} of {usable}" in words
    markdown = (tmp_path / "report.md").read_text()
    assert f"predicted peak (the plan's) | {predicted}" in markdown
    assert f"usable (the plan's) | {usable}" in markdown and "capacity (the plan's) | 80.0 MiB" in markdown

    # the tab's Memory view reads them from report.json alone (the Lightning and Trainer doors write no
    # guard.json)
    (run,) = find_runs(tmp_path)
    memory = views.memory(run)
    assert memory["capacity_mib"] == 80.0 and memory["capacity_source"] == "the plan's"
    assert memory["usable_mib"] == pytest.approx(fit.usable_bytes / MiB, abs=0.01)
    assert memory["estimate_mib"] == pytest.approx(fit.device_total_bytes / MiB, abs=0.01)
    facts = {f["name"]: f["value"] for f in views.overview(run)["facts"]}
    assert facts["capacity (the plan's)"] == 80.0 and facts["host RAM"] == pytest.approx(ram / MiB, abs=0.01)


def test_the_guard_door_writes_the_same_memory_figures_to_guard_json_and_report_json(tmp_path: Path) -> None:
    """Through the door (frontdoors/run.new_monitor hands the monitor the plan's fit): guard.json's plan
    and report.json's summary state one capacity, usable line and predicted peak."""
    from resource_guard import guard

    model, optimizer, (tokens, targets) = build(batch_size=8, seq_len=32, vocab_size=512)
    batches = [(tokens, targets)] * 3
    with guard(
        model, optimizer, device="cpu", memory_limit="96MiB", log_dir=tmp_path, profile=False,
        loss_fn=lambda m, b: m(*b),
    ) as g:  # fmt: skip
        for x, y in g.iterate(batches):
            g.backward(model(x, y))
    planned = json.loads((tmp_path / "guard.json").read_text())
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    for key in ("capacity_bytes", "usable_bytes", "predicted_peak_bytes"):
        assert summary[key] == planned["plan"][key], key
    assert planned["plan"]["capacity_bytes"] == 96 * MiB
    assert summary["estimated_peak_bytes"] == planned["estimated_peak_bytes"]
    assert summary["ram_bytes"] == int(psutil.virtual_memory().total)
