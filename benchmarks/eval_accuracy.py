"""Estimated vs real peak memory of one evaluation step, over the cases in ``cases.py``.

For every case without checkpointing (under ``no_grad`` it changes nothing): estimate the evaluation
step with ``resource_guard.estimate_eval_memory`` (eval mode, ``no_grad``, the case's loss) in two
residencies, then build the case again and measure the real peak of a CPU evaluation step with
``measure_eval_step`` (torch.profiler memory records):

- ``fit``: as Lightning's ``fit`` validates mid-accumulation: the optimizer state and every gradient
  resident (one real training step first, then a forward and backward);
- ``alone``: ``trainer.validate`` / a plain loop after ``zero_grad()``: the parameters only.

Prints one row per case and residency, and the summary against the target: never under, within 3%.
A case whose real step this CPU cannot run is listed as skipped. The exit code is always 0.

Run:  python benchmarks/eval_accuracy.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import CASES, is_checkpointed  # noqa: E402

from resource_guard.estimate import estimate_eval_memory, measure_eval_step  # noqa: E402

MIB = 2**20
TARGET_MAX = 3.0


def run(name: str, residency: str) -> tuple[float, float, float, float] | str:
    """``(estimate MiB, real MiB, error %, trace s)`` or the reason it was skipped."""
    in_fit = residency == "fit"
    model, opt, batch, loss_fn = CASES[name]()
    precision = name.rsplit("/", 1)[1]
    est = estimate_eval_memory(
        model, batch, loss_fn, optimizer=opt if in_fit else None, gradients_kept=in_fit,
        precision=precision, device="cpu",
    )  # fmt: skip
    if est.cpu_unsupported:
        return "skipped: " + "; ".join(est.cpu_unsupported)
    model, opt, batch, loss_fn = CASES[name]()
    real = measure_eval_step(
        model, batch, loss_fn, optimizer=opt if in_fit else None, gradients_kept=in_fit, precision=precision
    )
    error = (est.peak_bytes / real.peak_bytes - 1) * 100
    return est.peak_bytes / MIB, real.peak_bytes / MIB, error, est.trace_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    names = [n for n in CASES if not is_checkpointed(n) and args.only in n]
    errors: list[float] = []
    print(f"{'case':<28} {'residency':<9} {'estimate MiB':>12} {'real MiB':>10} {'error':>8} {'trace s':>8}")
    for name in names:
        for residency in ("fit", "alone"):
            row = run(name, residency)
            if isinstance(row, str):
                print(f"{name:<28} {residency:<9} {row}")
                continue
            est, real, error, seconds = row
            errors.append(error)
            print(f"{name:<28} {residency:<9} {est:>12.2f} {real:>10.2f} {error:>+7.2f}% {seconds:>8.2f}")
    if not errors:
        return
    under = [e for e in errors if e < 0]
    print(
        f"\n{len(errors)} steps: median |error| {statistics.median(abs(e) for e in errors):.2f}%, "
        f"max {max(errors, key=abs):+.2f}%, under in {len(under)}"
    )
    ok = not under and max(abs(e) for e in errors) <= TARGET_MAX
    print(f"{'PASS' if ok else 'FAIL'}: never under, within {TARGET_MAX:.0f}%")


if __name__ == "__main__":
    main()
