"""What each door hands the report: the loader's settings where the loader is reachable (so that loader
advice is about settings the run really has) and the plan's table (so that advice quotes a configuration
the plan evaluated)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from resource_guard import guard


def test_guard_iterate_reads_the_loaders_settings_and_hands_over_the_plans_rows(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    loader = DataLoader(data, batch_size=8, num_workers=0, pin_memory=False)
    with guard(model, optimizer, device="cpu", profile=False, log_dir=tmp_path) as g:
        for x, y in g.iterate(loader):
            g.backward(nn.functional.mse_loss(model(x), y))
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["loader_info"] == {
        "num_workers": 0, "pin_memory": False, "persistent_workers": False, "prefetch_factor": None,
    }  # fmt: skip
    rows = summary["plan_rows"]
    assert rows and sum(r["chosen"] for r in rows) == 1
    assert g.plan is not None and len(rows) == len(g.plan.alternatives)


def test_an_unchanged_loop_reports_no_loader_settings_it_never_read(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=8, num_workers=0)
    with guard(model, optimizer, profile=False, log_dir=tmp_path):
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["loader_info"] == {}  # the loop iterates its loader itself: nothing was read
