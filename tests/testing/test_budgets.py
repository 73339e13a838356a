"""The memory budget file and :func:`check_budget` (shared by the pytest plugin and the CLI)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from resource_guard import ConfigurationError, MemoryEstimate, estimate_memory
from resource_guard.testing import Budget, check_budget, load_budgets, save_budgets


def _estimate(width: int = 64, precision: str = "32-true") -> MemoryEstimate:
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 1))
    return estimate_memory(
        model,
        torch.optim.AdamW,
        torch.randn(16, 32),
        lambda m, b: m(b).mean(),
        precision=precision,
        device="cpu",
    )


def test_the_file_is_sorted_plain_json_and_reads_back(tmp_path: Path) -> None:
    est = _estimate()
    path = tmp_path / "budgets.json"
    save_budgets(path, {"zeta": Budget.of(est), "alpha": Budget.of(_estimate(128))})
    text = path.read_text()
    data = json.loads(text)
    assert list(data) == ["alpha", "zeta"] and text.endswith("}\n")
    assert text == json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    entry = data["zeta"]
    assert entry["peak_bytes"] == est.peak_bytes
    assert entry["breakdown_bytes"] == dict(est.breakdown)
    assert (entry["precision"], entry["device"]) == ("32-true", "cpu")
    assert load_budgets(path) == {"zeta": Budget.of(est), "alpha": Budget.of(_estimate(128))}
    assert load_budgets(tmp_path / "missing.json") == {}
    assert [p.name for p in tmp_path.iterdir()] == ["budgets.json"]  # no temporary file left


def test_unchanged_passes_and_growth_names_key_bytes_percent_and_category() -> None:
    small, big = _estimate(64), _estimate(80)
    assert check_budget("mlp", small, Budget.of(small)).status == "ok"
    over = check_budget("mlp", big, Budget.of(small), where="memory_budgets.json")
    assert over.status == "over" and not over.passed
    old, new = small.peak_bytes, big.peak_bytes
    assert over.change == pytest.approx(new / old - 1)
    msg = over.message
    assert "'mlp'" in msg and f"{old:,} → {new:,}" in msg and f", {new / old - 1:+.1%}" in msg
    name, was, now = over.grew  # type: ignore[misc]
    grown = {c: big.breakdown[c] - small.breakdown[c] for c in big.breakdown}
    assert name == max(grown, key=grown.__getitem__) and now - was == grown[name]
    assert f"{name} grew most: {was:,} → {now:,}" in msg and "memory_budgets.json" in msg


def test_tolerance_is_a_fraction_of_the_recorded_peak() -> None:
    est = _estimate()
    budget = Budget.of(est)
    lower = dataclasses.replace(budget, peak_bytes=int(est.peak_bytes / 1.05))  # now 5% above it
    assert check_budget("k", est, lower, tolerance=0.06).status == "ok"
    assert check_budget("k", est, lower, tolerance=0.04).status == "over"
    higher = dataclasses.replace(budget, peak_bytes=est.peak_bytes * 2)
    assert check_budget("k", est, higher).status == "shrank"  # passes; an update records the saving
    with pytest.raises(ConfigurationError, match=r"tolerance=-0.1"):
        check_budget("k", est, budget, tolerance=-0.1)


def test_a_category_that_grew_fails_even_when_the_peak_did_not() -> None:
    est = _estimate()
    budget = Budget.of(est)
    shifted = dict(budget.breakdown_bytes)
    moved = est.peak_bytes // 10
    shifted["activations"] -= moved  # the recorded step had fewer activations, more temporaries
    shifted["temporaries"] += moved
    result = check_budget("k", est, dataclasses.replace(budget, breakdown_bytes=shifted))
    assert result.status == "over" and result.grew is not None and result.grew[0] == "activations"
    assert "+0.0%" in result.message


def test_another_precision_or_device_is_refused_not_compared() -> None:
    bf16 = _estimate(precision="bf16-mixed")
    result = check_budget("k", bf16, Budget.of(_estimate()))
    assert result.status == "mismatch" and not result.passed
    assert "32-true on cpu" in result.message and "bf16-mixed on cpu" in result.message


def test_no_budget_is_new_and_fails() -> None:
    result = check_budget("k", _estimate(), None, update_hint="run the update")
    assert result.status == "new" and not result.passed and "run the update" in result.message


def test_a_malformed_file_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text('{"gpt": {"peak_bytes": "12"}}')
    with pytest.raises(ConfigurationError, match=r"b.json.*'gpt'"):
        load_budgets(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match="JSON object"):
        load_budgets(path)
    path.write_text("{")
    with pytest.raises(ConfigurationError, match="cannot be read as JSON"):
        load_budgets(path)
