"""The README's usage and the examples/ run as written."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_block_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write their logs into the working directory
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "True" in printed or "False" in printed  # the fit line was printed


def test_readme_names_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in readme and "python -m pytest" in ci
    assert "resource-guard preflight" in readme


def test_gpt_small_example_is_a_valid_preflight_target(capsys):
    from resource_guard.cli import main

    code = main(
        [
            "preflight",
            str(ROOT / "examples" / "gpt_small.py") + ":build",
            "--batch-size",
            "1",
            "--device",
            "a100-40gb",
            "--precision",
            "bf16-mixed",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "a100-40gb" in out and "FITS" in out


def test_gpt_small_example_does_not_fit_a_t4_at_batch_32(capsys):
    from resource_guard.cli import main

    code = main(
        [
            "preflight",
            str(ROOT / "examples" / "gpt_small.py") + ":build",
            "--batch-size",
            "32",
            "--device",
            "t4",
            "--precision",
            "16-mixed",
        ]
    )
    assert code == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.slow
def test_gpt_small_example_runs_as_a_script():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gpt_small.py")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fits=" in result.stdout


def test_main_job_command_prints_the_report():
    result = subprocess.run(
        [sys.executable, "-m", "resource_guard.cli", "preflight", "--batch-size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "peak" in result.stdout and "FITS" in result.stdout


def test_examples_are_importable_without_side_effects():
    namespace = runpy.run_path(str(ROOT / "examples" / "gpt_small.py"), run_name="not_main")
    assert callable(namespace["build"])


def test_demo_command_trains_writes_tensorboard_and_prints_the_report(tmp_path):
    """The second half of the README's main job: ``resource-guard demo``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = subprocess.run(
        [sys.executable, "-m", "resource_guard.cli", "demo", "--steps", "3", "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Plan: " in result.stdout and "resource_guard report: verdict" in result.stdout
    assert "**" not in result.stdout and "\x1b[" not in result.stdout  # a pipe: plain text, no Markdown
    assert "accumulation" in result.stdout  # the 256 MiB cap forces micro-batches
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert any(tag.startswith("resource_guard/") for tag in events.Tags()["scalars"])
    for name in ("report.md", "report.json", "guard.json", "memory.png"):
        assert (tmp_path / name).exists(), name
