"""``resource-guard preflight ... --budget FILE``: memory budgets for projects without pytest.

Exit 1 when the estimate grew beyond the tolerance (or has no budget); ``--update-budget`` writes it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from resource_guard.cli import main

FACTORY = """
import torch
from torch import nn


def build(batch_size=4, width=16):
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))

    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    batch = (torch.randn(batch_size, 8), torch.randint(0, 3, (batch_size,)))
    return model, torch.optim.AdamW(model.parameters()), batch, loss_fn


def build_wider(batch_size=4):
    return build(batch_size, width=20)
"""


@pytest.fixture
def target(tmp_path: Path) -> str:
    path = tmp_path / "factory.py"
    path.write_text(FACTORY)
    return str(path)


def _preflight(target: str, *args: str) -> int:
    return main(["preflight", f"{target}:build", "--device", "t4", "--precision", "16-mixed", *args])


def test_update_then_pass_then_fail_on_growth(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = tmp_path / "budgets.json"
    assert _preflight(target, "--budget", str(budget)) == 1  # no budget recorded yet
    assert "no budget recorded" in capsys.readouterr().err and not budget.exists()

    assert _preflight(target, "--budget", str(budget), "--update-budget") == 0
    err = capsys.readouterr().err
    key = f"{target}:build @ t4, 16-mixed, batch 4"
    data = json.loads(budget.read_text())
    assert list(data) == [key] and f"budget {key!r}: recorded {data[key]['peak_bytes']:,} bytes (new)" in err
    assert (data[key]["precision"], data[key]["device"]) == ("16-mixed", "cuda")

    assert _preflight(target, "--budget", str(budget)) == 0
    assert "within the 2% tolerance" in capsys.readouterr().err

    wider = ["preflight", f"{target}:build_wider", "--device", "t4", "--precision", "16-mixed"]
    assert main([*wider, "--budget", str(budget), "--budget-key", key]) == 1  # fits, but grew
    err = capsys.readouterr().err
    old = data[key]["peak_bytes"]
    found = re.search(
        rf"budget failed: memory budget '.*': peak {old:,} → ([\d,]+) bytes .*, ([+\d.]+)%", err
    )
    assert found is not None
    new = int(found.group(1).replace(",", ""))
    assert float(found.group(2)) == pytest.approx(100 * (new / old - 1), abs=0.05)
    assert re.search(r"(activations|parameters|optimizer_state|gradients|temporaries) grew most", err)
    assert "--update-budget" in err
    assert main([*wider, "--budget", str(budget), "--budget-key", key, "--budget-tolerance", "0.9"]) == 0


def test_json_carries_the_budget_check(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = tmp_path / "b.json"
    assert _preflight(target, "--budget", str(budget), "--update-budget", "--budget-key", "tiny") == 0
    capsys.readouterr()
    assert _preflight(target, "--budget", str(budget), "--budget-key", "tiny", "--json") == 0
    payload = json.loads(capsys.readouterr().out)["budget"]
    assert payload["key"] == "tiny" and payload["status"] == "ok" and payload["passed"] is True
    assert (
        payload["old_peak_bytes"]
        == payload["new_peak_bytes"]
        == json.loads(budget.read_text())["tiny"]["peak_bytes"]
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--update-budget"], "pass --budget too"),
        (["--budget", "b.json", "--train-tokens", "1000"], "cannot be combined"),
        (["--budget", "b.json", "--budget-tolerance", "-1"], "--budget-tolerance -1.0 must be in [0, 1)"),
    ],
)
def test_bad_budget_arguments_exit_2(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    args = [str(tmp_path / a) if a == "b.json" else a for a in args]
    assert _preflight(target, *args) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_a_malformed_budget_file_exits_2(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "b.json"
    bad.write_text("[]")
    assert _preflight(target, "--budget", str(bad)) == 2
    assert "must hold a JSON object" in capsys.readouterr().err
