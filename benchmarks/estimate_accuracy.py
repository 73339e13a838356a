"""Estimated vs real peak memory of one training step, over the cases in ``cases.py``.

For every case: build it, estimate with ``resource_guard.estimate_memory`` (timed), build it
again from scratch and measure the real peak of a CPU step with ``measure_training_step`` (the ground
truth: torch.profiler memory records). Prints one row per case and the summary against the targets
of DESIGN.md ("Numbers to reach"): 100% coverage, median |error| <= 1%, max |error| <= 3%, never
under by more than 2%. The exit code is always 0: this is a report, read the PASS/FAIL lines.
A case whose real step this CPU cannot run (the estimate's ``cpu_unsupported``, e.g. a bf16 LSTM on an
AVX2-only CPU) is listed as skipped, with the reason, and left out of the summary.

Run:  python benchmarks/estimate_accuracy.py [--only SUBSTRING] [--json PATH] [--list]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import CASES, is_checkpointed, model_of, precision_of  # noqa: E402

from resource_guard.estimate import measure_training_step  # noqa: E402

MIB = 2**20
TARGET_MEDIAN = 1.0
TARGET_MAX = 3.0
TARGET_UNDER = -2.0


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _load_estimator() -> Any:
    """``estimate_memory`` if the estimator module exists yet, else ``None``."""
    try:
        from resource_guard.estimate import estimate_memory
    except ImportError as exc:
        print(f"(resource_guard.estimate not importable: {exc}; printing the measured truth only)\n")
        return None
    return estimate_memory


def _fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """Cheap state summary to notice an estimator that mutates what it was given."""
    params = list(model.parameters())
    return (
        tuple(float(p.detach().double().sum()) for p in params[:3] + params[-3:]),
        tuple(float(b.double().sum()) for b in list(model.buffers())[:4]),
        sum(p.grad is not None for p in params),
        len(optimizer.state),
        model.training,
    )


def run_case(name: str, estimate_memory: Any) -> dict[str, Any]:
    build = CASES[name]
    precision = precision_of(name)
    row: dict[str, Any] = {
        "case": name,
        "model": model_of(name),
        "precision": precision,
        "checkpointing": is_checkpointed(name),
        "true_bytes": None,
        "est_bytes": None,
        "error_pct": None,
        "method": None,
        "estimate_s": None,
        "measure_s": None,
        "warnings": [],
        "breakdown": None,
        "failure": None,
        "mutated": None,
    }

    if estimate_memory is not None:
        model, optimizer, batch, loss_fn = build()
        before = _fingerprint(model, optimizer)
        t0 = time.perf_counter()
        try:
            est = estimate_memory(model, optimizer, batch, loss_fn, precision=precision, device="cpu")
        except Exception as exc:  # a report: record and carry on
            row["failure"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            row["traceback"] = traceback.format_exc()
        else:
            row["est_bytes"] = int(est.peak_bytes)
            row["method"] = est.method
            row["warnings"] = [str(w) for w in est.warnings]
            row["breakdown"] = {k: int(v) for k, v in est.breakdown.items()}
            if est.cpu_unsupported:  # no ground truth on this CPU: say why rather than crash
                row["skipped"] = "this CPU cannot run the reference: " + "; ".join(est.cpu_unsupported)
        row["estimate_s"] = time.perf_counter() - t0
        row["mutated"] = _fingerprint(model, optimizer) != before
        del model, optimizer, batch, loss_fn
        gc.collect()

    if row.get("skipped"):
        return row
    model, optimizer, batch, loss_fn = build()
    t0 = time.perf_counter()
    truth = measure_training_step(model, optimizer, batch, loss_fn, precision=precision)
    row["measure_s"] = time.perf_counter() - t0
    row["true_bytes"] = int(truth.peak_bytes)
    row["start_bytes"] = int(truth.start_bytes)
    del model, optimizer, batch, loss_fn
    gc.collect()

    if row["est_bytes"] is not None:
        row["error_pct"] = 100.0 * (row["est_bytes"] - row["true_bytes"]) / row["true_bytes"]
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_row(row: dict[str, Any], with_estimate: bool) -> None:
    if row.get("skipped"):
        print(f"{row['case']:<28} {'n/a':>9}  skipped: {row['skipped'][:200]}", flush=True)
        return
    line = f"{row['case']:<28} {row['true_bytes'] / MIB:>9.1f}"
    if with_estimate:
        est = None if row["est_bytes"] is None else row["est_bytes"] / MIB
        line += (
            f" {_fmt(est, '9.1f'):>9} {_fmt(row['error_pct'], '+8.2f'):>8}"
            f" {row['method'] or 'FAILED':<8} {_fmt(row['estimate_s'], '6.2f'):>6}"
        )
        if row["mutated"]:
            line += "  MUTATED model/optimizer"
        if row["failure"]:
            line += f"  {row['failure']}"
    else:
        line += f" {row['start_bytes'] / MIB:>9.1f} {row['measure_s']:>7.2f}"
    print(line, flush=True)


def summarize(rows: list[dict[str, Any]]) -> None:
    skipped = [r["case"] for r in rows if r.get("skipped")]
    if skipped:
        print(f"\nskipped (this CPU cannot run the reference step): {', '.join(skipped)}")
    rows = [r for r in rows if not r.get("skipped")]
    errors = [r["error_pct"] for r in rows if r["error_pct"] is not None]
    coverage = 100.0 * len(errors) / len(rows) if rows else 0.0
    print()
    print(f"cases: {len(rows)}   estimated: {len(errors)}")

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    print(f"coverage            {coverage:6.1f}%   target 100%     {verdict(coverage == 100.0)}")
    if not errors:
        print("no estimates: median/max/under targets not evaluated")
        return
    abs_errors = [abs(e) for e in errors]
    median = statistics.median(abs_errors)
    worst = max(rows, key=lambda r: -1 if r["error_pct"] is None else abs(r["error_pct"]))
    under = min((r for r in rows if r["error_pct"] is not None), key=lambda r: r["error_pct"])
    ok_median = verdict(median <= TARGET_MEDIAN)
    print(f"median |error|      {median:6.2f}%   target <= {TARGET_MEDIAN}%   {ok_median}")
    print(
        f"max |error|         {max(abs_errors):6.2f}%   target <= {TARGET_MAX}%   "
        f"{verdict(max(abs_errors) <= TARGET_MAX)}   ({worst['case']})"
    )
    print(
        f"worst under         {min(0.0, under['error_pct']):+6.2f}%   target >= {TARGET_UNDER}%  "
        f"{verdict(under['error_pct'] >= TARGET_UNDER)}   ({under['case']})"
    )
    mutated = [r["case"] for r in rows if r["mutated"]]
    if mutated:
        print(f"WARNING: estimate_memory changed the model/optimizer in: {', '.join(mutated)}")
    times = [r["estimate_s"] for r in rows if r["estimate_s"] is not None]
    print(f"estimate time       median {statistics.median(times):.2f} s, max {max(times):.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=None, help="run only cases whose name contains SUBSTRING")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON to PATH")
    parser.add_argument("--list", action="store_true", help="list the case names and exit")
    args = parser.parse_args(argv)

    names = [n for n in CASES if args.only is None or args.only in n]
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        print(f"no case matches {args.only!r}")
        return 0

    _quiet()
    estimate_memory = _load_estimator()
    with_estimate = estimate_memory is not None
    header = f"{'case':<28} {'true MiB':>9}"
    if with_estimate:
        header += f" {'est MiB':>9} {'error %':>8} {'method':<8} {'est s':>6}"
    else:
        header += f" {'start MiB':>9} {'meas s':>7}"
    print(header)
    print("-" * len(header))

    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for name in names:
        row = run_case(name, estimate_memory)
        rows.append(row)
        print_row(row, with_estimate)

    if with_estimate:
        summarize(rows)
    print(f"\ntotal time {time.perf_counter() - t_start:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
