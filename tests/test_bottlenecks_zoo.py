"""``benchmarks/bottlenecks.py`` stays runnable: a reduced zoo (few steps, two cases, both doors)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _zoo():
    spec = importlib.util.spec_from_file_location("bottlenecks", BENCHMARKS / "bottlenecks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bottlenecks"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_reduced_zoo_runs_and_reports_each_case(capsys: pytest.CaptureFixture[str]) -> None:
    zoo = _zoo()
    assert len(zoo.CASES) >= 8 and len({c.expected for c in zoo.CASES}) == len(zoo.CASES)
    rows = zoo.main(["--steps", "6", "--rounds", "1", "--only", "checkpoint"])
    out = capsys.readouterr().out
    assert [(r["case"], r["door"]) for r in rows] == [("checkpoint", "guard"), ("checkpoint", "lightning")]
    for row in rows:
        assert set(row["verdicts"]) == {"named", "share", "gain", "clean"}
        assert row["clean_ms"] > 0 and row["cause_ms"] > 0 and row["first"]
    assert "every cause named first" in out and "no warning on a clean loop" in out
