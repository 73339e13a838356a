"""The example GitHub Actions workflow (configs/github-actions/resource-guard.yml) runs as written.

The test parses the YAML, expands each job's matrix as GitHub does (the product of its lists, then
``include`` and ``exclude``), and runs every ``run:`` step of every row with bash, the way a runner would
(``bash -e``, the workflow's, job's and step's ``env``, ``${{ matrix.* }}`` substituted), in this
checkout, on the bundled example target. ``resource-guard`` is this checkout's CLI. Steps that set the
machine up (checkout, Python, pip) are skipped, each with its reason recorded; any other step runs.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import resource_guard
from resource_guard.devices import load_catalog

ROOT = Path(resource_guard.__file__).parents[2]
WORKFLOW = ROOT / "configs" / "github-actions" / "resource-guard.yml"

# what the test does not run, and why: the runner's set-up, already done here (and pip never runs in tests)
SET_UP = {
    "actions/checkout": "the test runs in this checkout",
    "actions/setup-python": f"the test runs under this interpreter ({sys.executable})",
    "pip install": "installs packages; the test uses this environment and never runs pip",
}

pytestmark = pytest.mark.skipif(not WORKFLOW.is_file(), reason=f"no {WORKFLOW} (not a source checkout)")


def expand_matrix(matrix: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The rows of a ``strategy.matrix``, in GitHub's rules.

    The product of the list-valued keys; ``exclude`` removes rows matching all its keys; each
    ``include`` entry adds its keys to every row whose original values it matches (without changing an
    original value), or, matching none, becomes a row of its own.
    """
    if not matrix:
        return [{}]
    base = {k: v for k, v in matrix.items() if k not in ("include", "exclude")}
    rows = [dict(zip(base, values)) for values in itertools.product(*base.values())] if base else []
    for ex in matrix.get("exclude", []):
        rows = [r for r in rows if any(r.get(k) != v for k, v in ex.items())]
    originals = [dict(r) for r in rows]
    for inc in matrix.get("include", []):
        matched = False
        for row, orig in zip(rows, originals):
            if all(orig[k] == v for k, v in inc.items() if k in orig):
                row.update({k: v for k, v in inc.items() if k not in orig})
                matched = True
        if not matched:
            rows.append(dict(inc))
    return rows


def test_expand_matrix_follows_githubs_include_rules() -> None:
    matrix = {"os": ["a", "b"], "n": [1, 2], "include": [{"os": "a", "x": 1}, {"os": "c", "n": 9}]}
    matrix["exclude"] = [{"os": "b", "n": 2}]
    assert expand_matrix(matrix) == [
        {"os": "a", "n": 1, "x": 1},
        {"os": "a", "n": 2, "x": 1},
        {"os": "b", "n": 1},
        {"os": "c", "n": 9},
    ]
    assert expand_matrix(None) == [{}]


def _substitute(command: str, row: dict[str, Any]) -> str:
    def value(m: re.Match[str]) -> str:
        expr = m.group(1).strip()
        name = expr.removeprefix("matrix.")
        if name == expr or name not in row:
            raise AssertionError(f"the test cannot evaluate `${{{{ {expr} }}}}` in {command!r}")
        return str(row[name])

    return re.sub(r"\$\{\{(.*?)\}\}", value, command)


def _set_up_reason(step: dict[str, Any]) -> str | None:
    uses = step.get("uses", "")
    for what, why in SET_UP.items():
        if uses.startswith(what + "@") or what in step.get("run", ""):
            return why
    return None


def _shim(bin_dir: Path) -> None:
    """``resource-guard`` on PATH: this interpreter running this checkout's CLI."""
    bin_dir.mkdir()
    script = bin_dir / "resource-guard"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m resource_guard.cli "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.mark.slow
def test_the_workflow_runs_its_resource_guard_commands_on_every_matrix_row(
    tmp_path: Path, record_property: Any
) -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    _shim(tmp_path / "bin")
    src = str(Path(resource_guard.__file__).parents[1])
    catalog = load_catalog()
    ran: list[str] = []
    skipped: dict[str, str] = {}
    for job_name, job in workflow["jobs"].items():
        rows = expand_matrix(job.get("strategy", {}).get("matrix"))
        assert len(rows) >= 2, f"job {job_name}: the gate is meant to run over several target GPUs"
        for row in rows:
            assert row["gpu"] in catalog, f"{row['gpu']!r} is not a catalog device"
            env = {
                **os.environ,
                **{k: str(v) for k, v in workflow.get("env", {}).items()},
                **{k: str(v) for k, v in job.get("env", {}).items()},
                "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
                "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
            }
            for step in job["steps"]:
                name = step.get("name", step.get("uses", step.get("run", "")))
                reason = _set_up_reason(step)
                if reason is not None:
                    skipped[name] = reason
                    continue
                assert "run" in step, f"step {name!r} uses an action the test does not know: {step}"
                command = _substitute(step["run"], row)
                assert command.lstrip().startswith("resource-guard "), f"step {name!r}: {command!r}"
                done = subprocess.run(
                    ["bash", "-e", "-c", command],
                    cwd=ROOT,
                    env={**env, **{k: str(v) for k, v in step.get("env", {}).items()}},
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                assert done.returncode == 0, (
                    f"step {name!r} with {row} exited {done.returncode}:\n{done.stderr[-3000:]}\n"
                    "if an intended change grew the estimate, refresh the budget with the command in the "
                    f"header of {WORKFLOW.name} (add --update-budget)"
                )
                assert "budget: memory budget" in done.stderr and "within the" in done.stderr
                ran.append(f"{name} {row}")
    record_property("skipped_steps", skipped)
    assert set(skipped.values()) == set(SET_UP.values())  # only the set-up was skipped
    assert len(ran) == sum(
        len(expand_matrix(j.get("strategy", {}).get("matrix"))) for j in workflow["jobs"].values()
    )
