"""``resource-guard compare BASE NEW --max-step-regression 10%``: the speed gate for CI (issue #42).

The runs are written by a real :class:`~resource_guard.RunMonitor` (``report.json`` in its log dir) whose
clock is a fake one the test advances, so each run's step time is exactly what the test says and no
outcome depends on this machine's load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resource_guard.cli import main
from resource_guard.observe import monitor
from resource_guard.observe.monitor import RunMonitor
from resource_guard.tensorboard_plugin.compare import parse_regression, step_gate


class _Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _write_run(log_dir: Path, step_s: float, monkeypatch: pytest.MonkeyPatch, steps: int = 12) -> Path:
    clock = _Clock()
    monkeypatch.setattr(monitor, "_clock", clock)
    mon = RunMonitor(log_dir, log_every_n_steps=4, profile=False, summary=False, interval_s=0.05)
    mon.start()
    for _ in range(steps):
        clock.now += 0.1 * step_s  # the data wait
        mon.batch_ready(torch.zeros(4, 3))
        clock.now += 0.9 * step_s
        mon.step_end()
    assert mon.close() is not None
    assert (log_dir / "report.json").is_file()
    return log_dir


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    return {
        "base": _write_run(tmp_path / "base", 0.040, monkeypatch),
        "slower": _write_run(tmp_path / "slower", 0.052, monkeypatch),  # +30%
        "within": _write_run(tmp_path / "within", 0.0416, monkeypatch),  # +4%
    }


def test_a_run_slower_by_30_percent_fails_a_10_percent_gate(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["compare", str(runs["base"]), str(runs["slower"]), "--max-step-regression", "10%"])
    out = capsys.readouterr().out
    assert code == 1
    assert "speed gate: FAILED" in out and "+30.0%" in out and "40.0 -> 52.0 ms" in out
    # the same regression passes a gate that allows it
    assert main(["compare", str(runs["base"]), str(runs["slower"]), "--max-step-regression", "0.35"]) == 0


def test_a_run_within_the_gate_passes(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["compare", str(runs["base"]), str(runs["within"] / "report.json"), "--max-step-regression", "10%"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "speed gate: passed" in out and "+4.0%" in out
    # a faster run always passes, even a 0% gate
    assert main(["compare", str(runs["slower"]), str(runs["base"]), "--max-step-regression", "0%"]) == 0


def test_the_gate_in_json(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compare", str(runs["base"]), str(runs["slower"]), "--max-step-regression", "10%", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    assert data["step_gate"]["passed"] is False and data["step_gate"]["max_regression"] == pytest.approx(0.1)
    assert data["step_ms"]["delta_pct"] == pytest.approx(30.0)


def test_without_the_flag_compare_never_fails_on_speed(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", str(runs["base"]), str(runs["slower"])]) == 0
    assert "speed gate" not in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["ten", "10", "-5%", "nan%", ""])
def test_a_bad_limit_is_a_clear_error(
    runs: dict[str, Path], bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", str(runs["base"]), str(runs["slower"]), f"--max-step-regression={bad}"]) == 2
    err = capsys.readouterr().err
    assert "--max-step-regression" in err and "a percentage (10%) or a fraction (0.1)" in err
    assert "Traceback" not in err


def test_a_missing_run_or_step_time_is_a_clear_error(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", str(runs["base"]), str(tmp_path / "nope"), "--max-step-regression", "10%"]) == 2
    assert "no readable report.json" in capsys.readouterr().err
    empty = tmp_path / "no_steps.json"
    empty.write_text(json.dumps({"summary": {"step_time_s": None}, "findings": []}))
    assert main(["compare", str(runs["base"]), str(empty), "--max-step-regression", "10%"]) == 2
    err = capsys.readouterr().err
    assert "new run has no measured step time" in err and "Traceback" not in err
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    assert main(["compare", str(garbled), str(runs["base"]), "--max-step-regression", "10%"]) == 2


def test_parse_and_gate_functions() -> None:
    assert parse_regression("10%") == pytest.approx(0.1) and parse_regression(" 0.1 ") == pytest.approx(0.1)
    assert parse_regression("150%") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="percentage"):
        parse_regression("1.5")
    base = {"summary": {"step_time_s": 0.1}}
    assert step_gate(base, {"summary": {"step_time_s": 0.11}}, 0.1)[0]  # exactly at the limit passes
    assert not step_gate(base, {"summary": {"step_time_s": 0.1101}}, 0.1)[0]
    with pytest.raises(ValueError, match="base run has no measured step time"):
        step_gate({"summary": {}}, base, 0.1)
