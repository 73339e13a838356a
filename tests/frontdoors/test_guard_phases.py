"""The guard splits each step by phase at its own boundaries; the parts add up to the step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from resource_guard import guard
from resource_guard.errors import ConfigurationError


def _loop(tmp_path: Path, *, save_s: float = 0.0, host_s: float = 0.0, evaluate: bool = False):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(12)]
    with guard(model, optimizer, device="cpu", profile=False, log_dir=tmp_path) as g:
        for x, y in g.iterate(data):
            g.backward(nn.functional.mse_loss(model(x), y))
            time.sleep(host_s)
            if save_s:
                with g.phase("checkpoint"):
                    time.sleep(save_s)
            if evaluate:
                for vx, _ in g.evaluate(data[:2]):
                    time.sleep(0.01)
                    model(vx)
    assert g.report is not None
    return g.report


def test_checkpoint_and_host_time_are_named_and_add_up(tmp_path: Path) -> None:
    report = _loop(tmp_path, save_s=0.03, host_s=0.01)
    s = report.stats
    assert s.phases is not None and s.step_time_s is not None
    assert sum(s.phases.values()) == pytest.approx(s.step_time_s, rel=1e-6)
    assert s.phases["checkpoint"] >= 0.03 and s.phases["host"] >= 0.01
    assert s.phases["checkpoint"] > s.phases["host"] > s.phases["data_wait"]
    assert report.verdict == "checkpoint-io" and report.findings[1].id == "host-loop"
    assert "Where the time goes" in (tmp_path / "report.md").read_text()


def test_evaluation_is_its_own_phase_not_host_time(tmp_path: Path) -> None:
    s = _loop(tmp_path, evaluate=True).stats
    assert s.phases is not None and s.phases["evaluation"] >= 0.02
    assert s.phases["evaluation"] > 5 * s.phases["host"]


def test_phase_names_are_checked(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    with guard(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu", monitor=False) as g:
        with pytest.raises(ConfigurationError, match="g.phase"):
            g.phase("lunch")
        with g.phase("logging"):  # no monitor: timing nothing, still valid
            pass
