"""The per-rank prediction beside a real 2-rank CPU run (gloo) of FSDP2 and DDP: within 3%."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fsdp_gloo.py"


@pytest.mark.slow
@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_real_ranks_agree_with_the_per_rank_prediction(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH.parent))  # the spawned ranks import the worker by name
    bench = importlib.import_module("fsdp_gloo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's own warnings in the spawned ranks' parent
        real = bench.measured(strategy)
    predicted = bench.predicted(strategy)
    assert abs(predicted - real) / real <= 0.03, (strategy, real, predicted)
