"""Stress check: the whole suite (or the fault and monitor tests, N times in a row) under artificial CPU load.

The suite must not depend on the machine's speed (issue #17): tests that wait on background threads
(TensorBoard's writer, the sampler) wait for the event they need, never for the clock. This script starts
``--load`` busy processes (``while True: pass``, default two: a 2-core machine fully booked besides the
tests) and then either

- by default, runs ``python -m pytest -q`` (the whole suite, the README's command, random order, seed =
  run number) ``--runs`` times as separate processes (default 1), every failure listed; or
- with ``--faults``, runs the chosen tests ``--runs`` times in one pytest process (default:
  ``tests/test_faults.py`` and ``tests/observe/test_monitor.py`` without the slow-marked ones, 50
  times): every test is parametrized with an iteration number, each iteration runs the whole set once
  in its own shuffled order (seeded); a run counts as passed when all of its tests pass.

It prints a table (runs, passed, failed, seconds per run) and which tests failed in which runs, and exits
0 (a report, not a test). The busy processes are killed at the end, also on Ctrl-C.

Run:  nice -n 5 python benchmarks/stress_suite.py [--runs 1] [--load 2] [--only PYTEST_ARGS...]
      nice -n 5 python benchmarks/stress_suite.py --faults [--runs 50]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ["tests/test_faults.py", "tests/observe/test_monitor.py", "-m", "not slow"]
BUSY = "while True: pass"


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` processes spinning on a core each, for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


class Repeat:
    """A pytest plugin: every test runs ``runs`` times; iteration-major order, shuffled per iteration."""

    def __init__(self, runs: int, seed: int, minutes: float | None = None) -> None:
        self.runs, self.seed = runs, seed
        self.stop_at = None if minutes is None else time.perf_counter() + 60 * minutes
        self.completed: list[int] = []
        self.session: Any = None
        self.failed: dict[int, list[str]] = defaultdict(list)
        self.seconds: dict[int, float] = defaultdict(float)
        self.run_of: dict[str, int] = {}
        self.left: dict[int, int] = defaultdict(int)

    def pytest_sessionstart(self, session: Any) -> None:
        self.session = session

    def pytest_generate_tests(self, metafunc: Any) -> None:
        metafunc.fixturenames.append("stress_run")
        metafunc.parametrize("stress_run", range(self.runs), ids=lambda i: f"run{i}")

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        by_run: dict[int, list[Any]] = defaultdict(list)
        for item in items:
            self.run_of[item.nodeid] = item.callspec.params["stress_run"]
            by_run[self.run_of[item.nodeid]].append(item)
        ordered = []
        for run in sorted(by_run):
            random.Random(self.seed + run).shuffle(by_run[run])
            ordered += by_run[run]
        items[:] = ordered

    def pytest_collection_finish(self, session: Any) -> None:  # after -k / -m deselection
        for item in session.items:
            self.left[self.run_of[item.nodeid]] += 1

    def pytest_runtest_logreport(self, report: Any) -> None:
        run = self.run_of[report.nodeid]
        self.seconds[run] += report.duration
        if report.failed:
            self.failed[run].append(f"{report.nodeid.split('[')[0]} ({report.when})")
        if report.when == "teardown":
            self.left[run] -= 1
            if self.left[run] == 0:
                self.completed.append(run)
                verdict = "FAILED " + "; ".join(self.failed[run]) if self.failed[run] else "passed"
                # progress, in case the loop is cut short (past pytest's output capture)
                print(f" run {run}: {verdict} ({self.seconds[run]:.0f} s)", file=sys.__stdout__, flush=True)
                if self.stop_at is not None and time.perf_counter() > self.stop_at and self.session:
                    self.session.shouldstop = f"--minutes spent after {len(self.completed)} runs"


def repeat_tests(args: argparse.Namespace) -> list[tuple[int, bool, float, list[str]]]:
    import pytest

    plugin = Repeat(args.runs, args.seed, args.minutes)
    pytest_args = ["-q", "-p", "no:randomly", "-p", "no:cacheprovider", "--no-header", *args.only]
    pytest.main(pytest_args, plugins=[plugin])
    failed, seconds = plugin.failed, plugin.seconds
    return [(run, not failed[run], seconds[run], failed[run]) for run in plugin.completed]


def repeat_suite(args: argparse.Namespace) -> list[tuple[int, bool, float, list[str]]]:
    rows: list[tuple[int, bool, float, list[str]]] = []
    stop_at = None if args.minutes is None else time.perf_counter() + 60 * args.minutes
    for run in range(args.runs):
        if stop_at is not None and time.perf_counter() > stop_at:
            break
        seed = args.seed + run
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.only]
        if _has_randomly():
            command += ["-p", "randomly", f"--randomly-seed={seed}"]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        if done.returncode != 0 and not failed:
            failed = [f"exit {done.returncode}: {done.stdout[-300:]!r}"]
        tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        print(f"run {run} (seed {seed}): exit {done.returncode} in {seconds:.0f} s: {tail}", flush=True)
        if args.output is not None:
            args.output.mkdir(parents=True, exist_ok=True)
            (args.output / f"run{run}.log").write_text(done.stdout + done.stderr)
        rows.append((run, done.returncode == 0, seconds, failed))
    return rows


def _has_randomly() -> bool:
    try:
        import pytest_randomly  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="runs (default 1; 50 with --faults)")
    parser.add_argument("--load", type=int, default=2, help="busy processes (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="first shuffling / random-order seed")
    parser.add_argument("--faults", action="store_true", help="the fault and monitor tests, one process")
    parser.add_argument("--minutes", type=float, default=None, help="start no run after this many minutes")
    parser.add_argument("--output", type=Path, default=None, help="write each run's pytest output here")
    parser.add_argument("--only", nargs=argparse.REMAINDER, default=None, help="pytest arguments (last)")
    args = parser.parse_args(argv)
    args.runs = args.runs or (50 if args.faults else 1)
    args.only = args.only if args.only is not None else (DEFAULT_TESTS if args.faults else [])
    what = " ".join(args.only) if args.faults or args.only else "the whole suite"
    print(f"{what}: up to {args.runs} runs under {args.load} busy processes", flush=True)
    start = time.perf_counter()
    with busy_processes(args.load):
        rows = (repeat_tests if args.faults else repeat_suite)(args)
    wall = time.perf_counter() - start
    passed = sum(ok for _, ok, _, _ in rows)
    seconds = [s for _, _, s, _ in rows]
    print()
    print("| tests | busy processes | runs | passed | failed | median s/run | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {what} | {args.load} | {len(rows)} | {passed} | {len(rows) - passed} "
        f"| {statistics.median(seconds) if seconds else float('nan'):.1f} | {wall:.0f} |"
    )
    for run, ok, _, failed in rows:
        if not ok:
            print(f"run {run}: " + "; ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
