"""``resource-guard preflight TARGET --train-tokens N``: the time and cost table over the catalog (#13)."""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from pathlib import Path

import pytest

from resource_guard.cli import main

FACTORY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 50)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x).relu()
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())


def build(batch_size=8):
    return Net(), torch.optim.AdamW, torch.randint(0, 50, (batch_size, 12))
"""

FIELDS = {"device", "gpus", "fits", "plan", "step_s", "hours", "usd_per_hour", "cost_usd", "calibrated"}
FIELDS |= {"recommended", "reason"}


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "factory.py"
    path.write_text(textwrap.dedent(FACTORY))
    return f"{path}:build"


def test_json_rows_carry_the_fields_of_the_issue(target, capsys):
    code = main(
        [
            "preflight",
            target,
            "--train-tokens",
            "96000",
            "--devices",
            "t4,a100-40gb",
            "--gpus",
            "1,2",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = out["projection"]
    assert len(rows) == 4 and all(set(r) >= FIELDS for r in rows)
    assert out["train_samples"] == 8000 and out["optimizer_steps"] == 1000
    assert sum("cheapest" in r["recommended"] for r in rows) == 1
    assert sum("fastest" in r["recommended"] for r in rows) == 1
    costs = [r["cost_usd"] for r in rows]
    assert costs == sorted(costs)
    assert {r["plan"]["precision"] for r in rows if r["device"] == "t4"} == {"16-mixed"}  # auto per device


def test_text_table_marks_the_recommendation_and_limits_can_exclude_everything(target, capsys):
    assert main(["preflight", target, "--train-samples", "8000", "--devices", "t4", "--gpus", "1"]) == 0
    text = capsys.readouterr().out
    assert "t4" in text and "cheapest" in text and "fastest" in text and "per-operator model" in text
    assert (
        main(["preflight", target, "--train-samples", "8000", "--devices", "t4", "--max-cost", "1e-9"]) == 1
    )
    assert "nothing fits within the limits" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--train-samples", "10", "--gpus", "0,2"], "--gpus"),
        (["--train-samples", "10", "--train-tokens", "10"], "exactly one"),
        (["--train-samples", "10", "--calibrate", "/nonexistent/run"], "report"),
    ],
)
def test_bad_projection_input_exits_2_with_one_paragraph(target, capsys, argv, match):
    assert main(["preflight", target, *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


_ROOT = Path(__file__).resolve().parents[1]
_COMMAND = "resource-guard preflight --train-tokens"
# the pages that show the projection command and its table (README.md and docs/*.md)
_SHOWN = [
    p for p in [_ROOT / "README.md", *sorted((_ROOT / "docs").glob("*.md"))] if _COMMAND in p.read_text()
]


def test_a_page_shows_the_projection_command():
    assert _SHOWN, f"no page of README.md or docs/ shows `{_COMMAND} ...`"


@pytest.mark.parametrize("page", _SHOWN, ids=[str(p.relative_to(_ROOT)) for p in _SHOWN])
def test_the_projection_command_of_the_page_runs_as_written(page, capsys):
    text = page.read_text()
    (line,) = [x for x in text.splitlines() if x.startswith(_COMMAND)]
    assert main([*shlex.split(line)[1:], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["projection"]
    shown = re.findall(r"^(\S+)\s+(\d+)\s+\d+x\d+", text, flags=re.M)
    assert shown and {(r["device"], str(r["gpus"])) for r in rows} == set(shown)


def test_a_cpu_run_calibrates_the_cpu_rows(target, tmp_path, capsys):
    summary = {"step_time_s": 0.01, "flops_per_step": 1e8, "device_kind": "cpu", "precision": "32-true"}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.json").write_text(json.dumps({"summary": summary}))
    argv = ["preflight", target, "--train-samples", "800", "--calibrate", str(tmp_path / "run")]
    assert main([*argv, "--devices", "cpu", "--gpus", "1", "--precision", "32-true", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["projection"]
    assert row["calibrated"] and row["step_s"] == pytest.approx(row["flops_per_step"] / 1e10)
    assert main([*argv, "--devices", "t4", "--gpus", "1"]) == 0
    assert "calibrates only cpu rows" in capsys.readouterr().out
