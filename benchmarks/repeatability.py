"""Does the same run get the same verdict? The demo and each loop of ``benchmarks/bottlenecks.py``,
run N identical times each (issue #37: three runs of the demo said casts 45.6%, 11.5%, 11.5%).

Per case it prints the first finding of every run, how many runs agree on the most common one, the
first finding's stated share (its evidence key ending in ``share``): median, and the largest
distance of a run's share from that median in points, the shares' stated spreads (``..._share_spread``,
the profiled steps' spread each run states) and how many runs set a stall apart; then the first
finding about the loop's code (the machine's ``cpu-contention`` set aside, as the zoo does), its
agreement, and the median contention share the runs reported (the host's load, seen). Targets (issue
#37): the same first finding in at least 9 of 10 runs; the stated shares within ±5 points of their
median; no share of 100% from one outlier (a run whose stated share is >= 99% is counted).

``--busy K`` runs everything beside K processes spinning on the CPU (the issue's "beside two busy
processes"), started before the first run and stopped after the last.

Run:  python benchmarks/repeatability.py [--runs 10] [--only SUBSTRING] [--busy 2] [--door guard|lightning]
      [--steps 40] [--demo-steps 12] [--no-demo]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bottlenecks  # noqa: E402  (the zoo's loops, from this folder)

AGREE = 0.9  # the same first finding in at least 9 of 10 runs
POINTS = 0.05  # stated shares within 5 points of their median


def _share(finding: Any) -> tuple[float | None, float | None]:
    """The finding's stated share and its stated spread (``None`` where it states none)."""
    share = next(
        (v for k, v in finding.evidence.items() if k.endswith("share") and isinstance(v, (int, float))), None
    )
    spread = next(
        (
            v
            for k, v in finding.evidence.items()
            if k.endswith("share_spread") and isinstance(v, (int, float))
        ),
        None,
    )
    return share, spread


def _quiet(fn: Any, *args: Any) -> Any:
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stderr(io.StringIO()),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        return fn(*args)


def run_demo(steps: int) -> Any:
    from resource_guard.demo import run_demo as demo

    with tempfile.TemporaryDirectory() as tmp:
        return _quiet(lambda: demo(steps, log_dir=tmp).report)


def run_zoo(loop: Any, door: str, steps: int) -> Any:
    return _quiet(bottlenecks.run, loop, door, steps)


def summarize(name: str, reports: list[Any]) -> dict[str, Any]:
    firsts = [r.findings[0].id if r is not None and r.findings else "(none)" for r in reports]
    top, agree = collections.Counter(firsts).most_common(1)[0]
    # the first finding about the loop's code (the machine's cpu-contention set aside, as the zoo does)
    code = [bottlenecks._first(r)[0] if r is not None and r.findings else "(none)" for r in reports]
    code_top, code_agree = collections.Counter(code).most_common(1)[0]
    contention = [bottlenecks._contention(r) for r in reports if r is not None]
    shares, spreads, hundred, stalls = [], [], 0, 0
    for r in reports:
        if r is None or not r.findings:
            continue
        stalls += r.finding("stall") is not None
        if r.findings[0].id != top:
            continue
        share, spread = _share(r.findings[0])
        if share is not None:
            shares.append(share)
            hundred += share >= 0.99
        if spread is not None:
            spreads.append(spread)
    median = statistics.median(shares) if shares else None
    worst = max((abs(s - median) for s in shares), default=None) if median is not None else None
    return {
        "case": name,
        "runs": len(reports),
        "firsts": firsts,
        "first": top,
        "agree": agree,
        "code_first": code_top,
        "code_agree": code_agree,
        "contention": statistics.median(contention) if contention else None,
        "median_share": median,
        "max_dev": worst,
        "spread": statistics.median(spreads) if spreads else None,
        "hundred": hundred,
        "stalls": stalls,
        "step_ms": [
            round(r.stats.step_time_s * 1e3, 1) for r in reports if r is not None and r.stats.step_time_s
        ],
    }


def _points(share: float | None) -> float | None:
    return None if share is None else share * 100


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning beside the runs")
    parser.add_argument("--door", choices=("guard", "lightning"), default="guard")
    parser.add_argument("--steps", type=int, default=40, help="steps of each zoo loop (the zoo's default)")
    parser.add_argument("--demo-steps", type=int, default=12, help="steps of the demo (its default)")
    parser.add_argument("--no-demo", action="store_true")
    parser.add_argument("--clean", action="store_true", help="also the zoo's clean loops")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    cases: list[tuple[str, Any]] = []
    if not args.no_demo:
        cases.append(("demo", lambda: run_demo(args.demo_steps)))
    for case in bottlenecks.CASES:
        cases.append((f"{case.name} ({args.door})", lambda c=case: run_zoo(c.cause, args.door, args.steps)))
        if args.clean:
            cases.append((f"{case.name} clean", lambda c=case: run_zoo(c.clean, args.door, args.steps)))
    cases = [(n, f) for n, f in cases if args.only in n]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.runs} runs per case, {args.busy} busy process(es) beside, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, load average {load:.1f} at start")  # fmt: skip
    header = (
        f"{'case':<22} {'first finding':<15} {'agree':>6} {'share':>6} {'±max':>6} {'spread':>6} "
        f"{'100%':>4} {'stalls':>6} {'s/case':>6} {'code first':<15} {'agree':>6} {'cont.':>5}  firsts"
    )
    print(header)
    print("-" * len(header))
    rows = []
    try:
        for name, fn in cases:
            began = time.perf_counter()
            reports = []
            for _ in range(args.runs):
                try:
                    reports.append(fn())
                except Exception as exc:  # a run that fails is a disagreement, not the end of the table
                    print(f"  {name}: {type(exc).__name__}: {exc}", flush=True)
                    reports.append(None)
            row = summarize(name, reports)
            rows.append(row)
            others = collections.Counter(f for f in row["firsts"] if f != row["first"])
            print(
                f"{name:<22} {row['first']:<15} {row['agree']:>3}/{row['runs']:<2} "
                f"{_fmt(row['median_share'], '6.1%')} {_fmt(_points(row['max_dev']), '6.1f')} "
                f"{_fmt(_points(row['spread']), '6.1f')} {row['hundred']:>4} "
                f"{row['stalls']:>6} {time.perf_counter() - began:6.0f} {row['code_first']:<15} "
                f"{row['code_agree']:>3}/{row['runs']:<2} {_fmt(row['contention'], '5.0%')}  "
                + (", ".join(f"{k} ×{v}" for k, v in others.items()) or "all agree"),
                flush=True,
            )
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    need = int(AGREE * args.runs + 0.999)
    agreed = sum(r["agree"] >= need for r in rows)
    code_agreed = sum(r["code_agree"] >= need for r in rows)
    within = sum(r["max_dev"] is None or r["max_dev"] <= POINTS + 1e-9 for r in rows)
    clean = sum(r["hundred"] == 0 for r in rows)
    for passed, text in (
        (agreed, f"same first finding in >= {need}/{args.runs}"),
        (code_agreed, f"same first finding about the code (cpu-contention aside) in >= {need}/{args.runs}"),
        (within, "stated shares within ±5 points of their median"),
        (clean, "no 100% share from one outlier"),
    ):
        print(f"{'PASS' if passed == len(rows) else 'FAIL'}  {text}: {passed}/{len(rows)}")
    return rows


if __name__ == "__main__":
    main()
