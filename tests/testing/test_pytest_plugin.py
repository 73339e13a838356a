"""The pytest plugin, run in temporary projects (pytester): update, pass unchanged, fail on growth.

The plugin is loaded explicitly (``-p``), as the tests must pass before the package is reinstalled with
its entry point; :func:`test_the_entry_point_is_declared_and_imports` checks the entry point itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import resource_guard
from resource_guard import estimate_memory

PLUGIN = "resource_guard.testing.pytest_plugin"

# a training step whose hidden width the test rewrites: 64 → 80 grows every category that scales with it
STEP = """
import torch
from torch import nn

from resource_guard import estimate_memory

WIDTH = {width}


def test_mlp_step(memory_budget):
    model = nn.Sequential(nn.Linear(32, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
    est = estimate_memory(model, torch.optim.AdamW, torch.randn(16, 32), lambda m, b: m(b).mean(),
                          device="cpu")
    memory_budget.check("mlp/cpu", est)
"""


@pytest.fixture(autouse=True)
def _modules_imported_once() -> None:
    """Import here what an estimate imports lazily: pytester drops the modules an inner run imported,
    and torch cannot register its operator libraries (``c10d_functional``) a second time."""
    model = nn.Linear(4, 1)
    estimate_memory(model, torch.optim.AdamW, torch.randn(2, 4), lambda m, b: m(b).mean(), device="cpu")


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", PLUGIN, "-p", "no:randomly", "-p", "no:cacheprovider", *args)


def test_update_then_pass_unchanged_then_fail_on_growth(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_step=STEP.format(width=64))
    budget = pytester.path / "memory_budgets.json"

    missing = _run(pytester)  # no budget yet: fails, saying how to record one
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*memory budget 'mlp/cpu': no budget recorded in*--memory-budgets=update*"])
    assert not budget.exists()

    _run(pytester, "--memory-budgets=update").assert_outcomes(passed=1)
    data = json.loads(budget.read_text())
    entry = data["mlp/cpu"]
    assert set(entry) == {"breakdown_bytes", "device", "peak_bytes", "precision", "target"}
    assert (entry["precision"], entry["device"]) == ("32-true", "cpu")
    assert entry["peak_bytes"] > 0 and sum(entry["breakdown_bytes"].values()) > 0
    recorded = budget.read_text()

    _run(pytester).assert_outcomes(passed=1)  # unchanged: passes, file untouched
    assert budget.read_text() == recorded

    pytester.makepyfile(test_step=STEP.format(width=80))
    grown = _run(pytester)
    grown.assert_outcomes(failed=1)
    old = entry["peak_bytes"]
    line = next(x for x in grown.outlines if "memory budget 'mlp/cpu'" in x)
    new = int(re.search(rf"peak {old:,} → ([\d,]+) bytes", line).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert new > old
    assert f"{new / old - 1:+.1%}" in line and "tolerance 2%" in line
    grew = re.search(r"(\w+) grew most: ([\d,]+) → ([\d,]+) bytes", line)
    assert grew is not None and grew.group(1) in entry["breakdown_bytes"]
    assert int(grew.group(2).replace(",", "")) == entry["breakdown_bytes"][grew.group(1)]
    assert str(budget) in line and "--memory-budgets=update" in line
    assert budget.read_text() == recorded  # a failing check never writes

    _run(pytester, "--memory-budgets=update").assert_outcomes(passed=1)
    assert json.loads(budget.read_text())["mlp/cpu"]["peak_bytes"] == new
    _run(pytester).assert_outcomes(passed=1)

    pytester.makepyfile(test_step=STEP.format(width=64))  # smaller again: passes, and says so
    shrunk = _run(pytester)
    shrunk.assert_outcomes(passed=1)
    below = f"*'mlp/cpu': peak {new:,} → {old:,} bytes*below the budget by more than 2%*"
    shrunk.stdout.fnmatch_lines([below])


def test_update_keeps_keys_not_checked_and_reports_what_changed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_step=STEP.format(width=64))
    other = {
        "breakdown_bytes": {"activations": 1},
        "device": "cuda",
        "peak_bytes": 1,
        "precision": "bf16-mixed",
    }
    (pytester.path / "memory_budgets.json").write_text(json.dumps({"other": other}))
    result = _run(pytester, "--memory-budgets=update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*wrote 1 key(s) to*(1 new, 0 changed; 1 not checked in this run, kept)"])
    data = json.loads((pytester.path / "memory_budgets.json").read_text())
    assert list(data) == ["mlp/cpu", "other"] and data["other"]["peak_bytes"] == 1


def test_the_file_is_named_by_an_ini_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_step=STEP.format(width=64))
    pytester.makeini("[pytest]\nmemory_budgets_file = budgets/steps.json\n")
    _run(pytester, "--memory-budgets=update").assert_outcomes(passed=1)
    assert "mlp/cpu" in json.loads((pytester.path / "budgets" / "steps.json").read_text())


def test_one_key_for_two_configurations_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_step=STEP.format(width=64)
        + "\n\ndef test_again(memory_budget):\n    WIDTH = 80\n"
        + "    model = nn.Sequential(nn.Linear(32, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))\n"
        + "    est = estimate_memory(model, torch.optim.AdamW, torch.randn(16, 32), lambda m, b: m(b).mean(),"
        + ' device="cpu")\n    memory_budget.check("mlp/cpu", est)\n'
    )
    result = _run(pytester, "--memory-budgets=update")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*'mlp/cpu' was checked by*test_mlp_step*give each configuration its own key*"]
    )


@pytest.mark.slow
def test_update_under_xdist_writes_every_workers_keys(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("xdist")
    src = str(Path(resource_guard.__file__).parents[1])  # this checkout's package, in the subprocesses too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    steps = {f"test_step{i}": STEP.format(width=64).replace('"mlp/cpu"', f'"mlp{i}"') for i in range(4)}
    pytester.makepyfile(**steps)
    result = pytester.runpytest_subprocess(
        "-p", PLUGIN, "-p", "no:randomly", "-n", "2", "--memory-budgets=update"
    )
    result.assert_outcomes(passed=4)
    assert list(json.loads((pytester.path / "memory_budgets.json").read_text())) == [
        f"mlp{i}" for i in range(4)
    ]


def test_the_entry_point_is_declared_and_imports() -> None:
    root = Path(resource_guard.__file__).parents[2]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip(f"no pyproject.toml at {root}: the package is not run from its source tree")
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    declared = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["pytest11"]
    assert declared == {PLUGIN: PLUGIN}  # the name is the module's: `-p` and the entry point agree
    module = importlib.import_module(declared[PLUGIN])
    assert callable(module.pytest_addoption) and "memory_budget" in module.__all__
    installed = [
        ep
        for ep in importlib.metadata.entry_points(group="pytest11")
        if ep.dist and ep.dist.name == "resource-guard"
    ]
    if not installed:
        pytest.skip(
            "the installed resource-guard predates its pytest11 entry point (reinstall: pip install -e .)"
        )
    assert [(ep.name, ep.value) for ep in installed] == [(PLUGIN, PLUGIN)]
    assert installed[0].load() is module


def test_loading_the_plugin_imports_neither_torch_nor_the_estimator() -> None:
    # pytest loads the plugin in every run where the package is installed: a project that never
    # checks a budget must not pay torch's import (seconds) at start-up
    import subprocess
    import sys

    code = (
        "import sys, resource_guard.testing.pytest_plugin; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('resource_guard.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['resource_guard.testing', 'resource_guard.testing.pytest_plugin']"
