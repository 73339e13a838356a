"""The analytic fallback, forced, against real CPU steps: it must never be below the real peak.

For every model of ``cases.py`` (the suite's) and ``families.py`` (external families), in 32-true and
bf16-mixed: the analytic figure (``analytic_estimate``, what ``estimate_memory`` returns when a step
cannot be traced) beside the real peak of ``measure_training_step``. Prints the ratio per case and
the summary: below the real peak anywhere (must be none), within 2x (should be most).

Run:  python benchmarks/fallback_bound.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases  # noqa: E402
import families  # noqa: E402

from resource_guard.estimate import measure_training_step  # noqa: E402
from resource_guard.estimate.analytic import analytic_estimate  # noqa: E402
from resource_guard.step.precision import parse_precision  # noqa: E402

__all__ = ["all_cases", "forced_fallback"]


def all_cases() -> dict[str, Callable[[], Any]]:
    """``name -> build()`` for the suite's cases (no checkpointing) and the external families."""
    out: dict[str, Callable[[], Any]] = {
        name: build for name, build in cases.CASES.items() if not cases.is_checkpointed(name)
    }
    for family in families.FAMILIES:
        for precision in families.PRECISIONS:
            out[f"{family}/{precision}"] = lambda f=family, p=precision: families.build(f, p)
    return out


def forced_fallback(name: str, build: Callable[[], Any]) -> tuple[int, int]:
    """``(analytic bytes, real peak bytes)`` of one case."""
    precision = cases.precision_of(name)
    model, optimizer, batch, _ = build()
    from resource_guard.estimate.estimator import unwrap_model

    model = unwrap_model(model)[0]
    est = analytic_estimate(model, optimizer, batch, parse_precision(precision), "cpu", reason="forced")
    del model, optimizer, batch
    model, optimizer, batch, loss_fn = build()
    with cases.native_stderr_silenced():
        truth = measure_training_step(model, optimizer, batch, loss_fn, precision=precision)
    gc.collect()
    return est.peak_bytes, truth.peak_bytes


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--only", default=None, help="run only cases whose name contains SUBSTRING")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    ratios: dict[str, float] = {}
    print(f"{'case':<28} {'real KiB':>10} {'analytic KiB':>13} {'ratio':>7}")
    for name, build in all_cases().items():
        if args.only is not None and args.only not in name:
            continue
        est, true = forced_fallback(name, build)
        ratios[name] = est / true
        flag = "  BELOW THE REAL PEAK" if est < true else ""
        print(f"{name:<28} {true / 1024:>10.1f} {est / 1024:>13.1f} {est / true:>6.2f}x{flag}", flush=True)
    if not ratios:
        return 0
    below = [n for n, r in ratios.items() if r < 1.0]
    within = sum(r <= 2.0 for r in ratios.values())
    models = {n.split("/")[0] for n in ratios}
    print(
        f"\ncases {len(ratios)}, families {len(models)}: below the real peak {len(below)} "
        f"({', '.join(below) or 'none'}); within 2x {within} ({100 * within / len(ratios):.0f}%); "
        f"ratio median {statistics.median(ratios.values()):.2f}x, max {max(ratios.values()):.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
