"""Advice that agrees with the plan: a finding that recommends a configuration (another precision, a
larger micro-batch, checkpointing off) recommends only one the planner evaluated, and quotes that row
of the plan's table (its memory and fit); a configuration the plan ruled out (does not fit) or never
evaluated is not recommended.

:attr:`RunStats.plan_rows <resource_guard.report.types.RunStats.plan_rows>` holds the plan's rows, as
:func:`plan_rows` reads them from a :class:`~resource_guard.planning.planner.Plan` (its
``alternatives``); empty when the run had no plan (then no configuration is recommended).

Example:
    >>> rows = ({"config": "8×4 bf16-mixed", "precision": "bf16-mixed", "micro_batch_size": 8,
    ...          "checkpointing": 0, "predicted_peak_bytes": 2**30, "fits": True, "chosen": True},
    ...         {"config": "8×4 bf16-true", "precision": "bf16-true", "micro_batch_size": 8,
    ...          "checkpointing": 0, "predicted_peak_bytes": 2**29, "fits": True, "chosen": False})
    >>> quote(find_row(rows, precision="bf16-true"))
    "the plan's row '8×4 bf16-true': 512.00 MiB, fits"
    >>> find_row(rows, precision="16-true") is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resource_guard.devices import format_bytes

__all__ = ["plan_rows", "find_row", "chosen_row", "larger_micro_batch_fits", "quote"]


def plan_rows(plan: Any) -> tuple[dict[str, Any], ...]:
    """The rows of a plan's table (``plan.alternatives``), JSON-ready; ``()`` for anything else."""
    out = []
    for row in getattr(plan, "alternatives", None) or ():
        try:
            out.append({
                "config": row.config(),
                "precision": str(row.precision),
                "micro_batch_size": int(row.micro_batch_size),
                "accumulation_steps": int(row.accumulation_steps),
                "checkpointing": int(row.checkpointing),
                "predicted_peak_bytes": int(row.predicted_peak_bytes),
                "fits": bool(row.fits),
                "chosen": bool(row.chosen),
            })  # fmt: skip
        except (AttributeError, TypeError, ValueError):
            continue
    return tuple(out)


def chosen_row(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    return next((r for r in rows if r.get("chosen")), None)


def find_row(rows: Sequence[Mapping[str, Any]], **match: Any) -> Mapping[str, Any] | None:
    """The first row (best first, as the plan ranks them) whose fields equal ``match``; the chosen row's
    micro-batch and checkpointing are preferred when ``match`` does not name them."""
    chosen = chosen_row(rows) or {}
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    for key in ("micro_batch_size", "checkpointing"):
        same = [r for r in hits if key not in match and r.get(key) == chosen.get(key)]
        hits = same or hits
    return hits[0] if hits else None


def larger_micro_batch_fits(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """A row with the chosen precision and a larger micro-batch that fits; ``None`` when the plan
    capped the micro-batch (the chosen one is the largest that fits) or has no rows."""
    chosen = chosen_row(rows)
    if chosen is None:
        return None
    larger = [
        r
        for r in rows
        if r.get("fits")
        and r.get("precision") == chosen.get("precision")
        and int(r.get("micro_batch_size") or 0) > int(chosen.get("micro_batch_size") or 0)
    ]
    return larger[0] if larger else None


def quote(row: Mapping[str, Any] | None) -> str:
    """One row of the plan's table in words: its configuration, predicted peak and fit."""
    if row is None:
        return ""
    fits = "fits" if row.get("fits") else "does not fit"
    peak = row.get("predicted_peak_bytes")
    memory = f"{format_bytes(int(peak))}, " if isinstance(peak, int) else ""
    return f"the plan's row {row.get('config')!r}: {memory}{fits}"
