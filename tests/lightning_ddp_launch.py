"""Run a script as a two-rank DDP job on CPU (gloo) and read what each rank reported.

The script is launched as a fresh job with the package under test first on its path, also where that
is not the installed copy (a worktree, a relative ``PYTHONPATH``). Each rank writes ``OUT/rank{r}.json``;
a hang is killed and fails the test. :func:`run_lightning_ddp`: Lightning picks a free port and starts
rank 1 itself; :func:`run_torchrun`: ``torchrun --standalone`` starts both (the Hugging Face Trainer).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import resource_guard

__all__ = ["run_lightning_ddp", "run_torchrun"]


def run_lightning_ddp(
    tmp_path: Path, script_text: str, *args: str, timeout_s: float = 240
) -> tuple[int, str, list[dict]]:
    """``(exit code, output, [rank 0's report, rank 1's report])`` of ``script_text`` run as
    ``script OUT *args``."""
    return _run(tmp_path, script_text, [sys.executable], args, timeout_s)


def run_torchrun(
    tmp_path: Path, script_text: str, *args: str, timeout_s: float = 240
) -> tuple[int, str, list[dict]]:
    """The same, the script started on two ranks by ``torchrun --standalone`` (a free port of its own)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return _run(tmp_path, script_text, launcher, args, timeout_s)


def _run(
    tmp_path: Path, script_text: str, launcher: list[str], args: tuple[str, ...], timeout_s: float
) -> tuple[int, str, list[dict]]:
    script, out = tmp_path / "ddp_script.py", tmp_path / "out"
    script.write_text(script_text)
    out.mkdir()
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for name in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a fresh job: the launcher picks a free port and starts the ranks
    source = str(Path(resource_guard.__file__).resolve().parents[1])  # this checkout, not an installed copy
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [*launcher, str(script), str(out), *args], cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        pytest.fail(f"the DDP run {args} hung for {timeout_s} s:\n{stdout[-4000:]}")
    deadline = time.monotonic() + 120  # Lightning's rank 1 is a child of rank 0's launcher: it may end later
    while time.monotonic() < deadline and not (out / "rank1.json").exists():
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    files = [out / f"rank{r}.json" for r in (0, 1)]
    ranks = [json.loads(f.read_text()) for f in files if f.exists()]
    assert len(ranks) == 2, f"both ranks must report:\n{stdout[-4000:]}"
    return proc.returncode, stdout, ranks
