"""The ``shapes`` finding: the batch shapes a run produced, checked against the plan before they ran.

The front doors' shape guard (:mod:`resource_guard.frontdoors.shape_guard`) counts the shapes it saw,
the batches it split into smaller micro-batches (``guard``) and the batches it stopped the run before
(Lightning, or a shape no micro-batch of which fits): :attr:`RunStats.shapes`. The finding is raised
when the run saw more than one shape or the guard acted; a stop is a warning (the run ended early,
without an out-of-memory error), the rest is information.

Example:
    >>> from resource_guard.report.types import RunStats
    >>> rule_shapes(RunStats(shapes={"shapes_seen": 2, "splits": 1, "stops": 0})).severity
    'info'
"""

from __future__ import annotations

from resource_guard.report.types import Finding, RunStats

__all__ = ["rule_shapes"]


def rule_shapes(s: RunStats) -> Finding | None:
    """Shapes seen, splits made and stops (each an out-of-memory error that did not happen)."""
    shapes = s.shapes
    if not shapes:
        return None
    seen, splits, stops = (int(shapes.get(k) or 0) for k in ("shapes_seen", "splits", "stops"))
    if seen <= 1 and not splits and not stops:
        return None
    keys = ("shapes_seen", "batches_checked", "splits", "stops", "traces", "split_shapes")
    evidence = {k: shapes[k] for k in keys if k in shapes}
    advice: list[str] = []
    if splits or stops:
        advice += [
            "bound each micro-batch's tokens: a token-budget (bucketing) sampler, at most the budget the "
            "plan's reasons or the stop's report give",
            "declare the run's worst case (`max_seq_len=` or `worst_case_batch=`) so the plan is made for it",
            "activation checkpointing (`checkpointing=True`) for more rows per micro-batch",
        ]
    if stops:
        title = f"{stops} batch shape(s) would not fit: the run stopped before running one (no out-of-memory)"
        return Finding("shapes", "warning", title, evidence, tuple(advice))
    if splits:
        title = f"{splits} batch(es) too big for the plan ran as smaller micro-batches (same optimizer steps)"
        return Finding("shapes", "info", title, evidence, tuple(advice))
    title = f"{seen} batch shapes, each checked against the plan before it ran"
    return Finding("shapes", "info", title, evidence)
