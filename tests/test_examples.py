"""The README's and the docs/ pages' usage, and the examples/, run as written."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """The page's ```python blocks, each with the line number (1-based) of its first line of code."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _PYTHON_BLOCK.finditer(text)]


def run_block(page: Path, line: int, code: str) -> None:
    """Execute one block in a fresh namespace; a traceback names the page and its own line numbers."""
    name = str(page.relative_to(ROOT))
    exec(compile("\n" * (line - 1) + code, name, "exec"), {"__name__": "__main__"})


_WITH_CODE = [p for p in PAGES if python_blocks(p)]


def test_the_readme_and_the_docs_have_python_blocks():
    """Every block below runs; that must not pass because the blocks were lost (a page renamed, a fence
    changed): the README shows the three front doors in Python, and the docs more."""
    assert len(python_blocks(README)) >= 3
    assert sum(len(python_blocks(p)) for p in PAGES) >= 15
    assert {"lightning.md", "guard.md", "huggingface.md"} <= {p.name for p in _WITH_CODE}


@pytest.mark.parametrize("page", _WITH_CODE, ids=[str(p.relative_to(ROOT)) for p in _WITH_CODE])
def test_every_python_block_of_the_page_runs(page, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write their logs into the working directory
    for line, code in python_blocks(page):
        run_block(page, line, code)
    capsys.readouterr()


def test_the_readme_lightning_block_writes_the_report_where_the_readme_says(tmp_path, monkeypatch):
    """A newcomer follows the README alone: its Lightning block, run as written, leaves the report in the
    directory the README names, and the `tensorboard --logdir` it gives holds the resource_guard/ scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Lightning") : text.index("\n## ", text.index("## Lightning") + 1)]
    ((line, code),) = [(n, c) for n, c in python_blocks(README) if "ResourceGuard(" in c]
    assert "monitor=False" not in code and "logger=False" not in code  # the report is what it is about
    assert "<trainer.log_dir>/resource_guard" in section
    (report_dir,) = re.findall(r"`(lightning_logs/[^`]*/resource_guard)/?`", section)
    (logdir,) = re.findall(r"tensorboard --logdir (\S+)", section)
    monkeypatch.chdir(tmp_path)
    run_block(README, line, code)
    for name in ("report.md", "report.json", "memory.png"):
        assert (tmp_path / report_dir / name).is_file(), f"{report_dir}/{name}"
    assert "verdict" in (tmp_path / report_dir / "report.md").read_text(encoding="utf-8").lower()
    tags = set()
    for events in (tmp_path / logdir).rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    assert {"resource_guard/1_step/time_ms", "resource_guard/3_phase_ms/forward"} <= tags, sorted(tags)


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


@pytest.mark.parametrize("script", ["lightning_transformer.py", "plain_pytorch.py"])
def test_example_help_is_whole_sentences_in_plain_text(script, capsys):
    main = runpy.run_path(str(ROOT / "examples" / script), run_name="not_main")["main"]
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert stopped.value.code == 0 and description.rstrip().endswith("."), description
    assert "``" not in out and ":class:" not in out
