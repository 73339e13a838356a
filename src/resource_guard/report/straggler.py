"""The ``straggler`` finding: under data parallelism every rank waits at each step's collective for
the slowest, so one slow rank slows the whole job; the rule names it from every rank's own figures
(``RunStats.ranks``, gathered at close by :class:`~resource_guard.RunMonitor`).

For each rank and each phase of its own work (:data:`OWN_PHASES`: data wait, forward, optimizer, the
user's code, evaluation, checkpointing, logging), the rank's excess is its time in that phase over the
median of the *other* ranks' (so a two-rank job compares the two). The largest excess names the slow
rank and its phase. ``backward``, ``communication`` and ``other`` are where a rank waits for the others
(DDP's gradient all-reduce ends its backward), so they are the waiting, not a cause: the others' time
there beyond the slow rank's is the measured wait (``wait_s``), reported as a share of their step.

A finding needs an excess of at least :data:`STRAGGLER_SHARE` (10%) of the step and
:data:`MIN_EXCESS_S` (0.5 ms): below that it is scheduling noise. Critical from
:data:`CRITICAL_STRAGGLER_SHARE` (25%). The predicted step is the step without the excess (every rank
then finishes its own work as the median rank does).

Example:
    >>> from resource_guard.report.types import RunStats
    >>> fast = {"data_wait": 0.0002, "forward": 0.004, "backward": 0.025, "other": 0.0008}
    >>> slow = {"data_wait": 0.0205, "forward": 0.004, "backward": 0.005, "other": 0.0005}
    >>> ranks = ({"rank": 0, "phases": fast}, {"rank": 1, "phases": slow})
    >>> f = rule_straggler(RunStats(step_time_s=0.03, world_size=2, ranks=ranks))
    >>> f.id, f.evidence["rank"], f.evidence["phase"], round(f.evidence["excess_s"] * 1e3, 1)
    ('straggler', 1, 'data_wait', 20.3)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from resource_guard.report.gains import faster_text
from resource_guard.report.types import Finding, RunStats

__all__ = [
    "CRITICAL_STRAGGLER_SHARE",
    "MIN_EXCESS_S",
    "OWN_PHASES",
    "STRAGGLER_SHARE",
    "WAITING_PHASES",
    "rule_straggler",
]

STRAGGLER_SHARE = 0.10
CRITICAL_STRAGGLER_SHARE = 0.25
MIN_EXCESS_S = 5e-4
OWN_PHASES = ("data_wait", "forward", "optimizer", "host", "evaluation", "checkpoint", "logging")
WAITING_PHASES = ("backward", "communication", "other")
_WORDS = {
    "data_wait": "waiting for its next batch",
    "forward": "the forward pass",
    "optimizer": "the optimizer step",
    "host": "its own code between steps",
    "evaluation": "evaluation",
    "checkpoint": "checkpointing",
    "logging": "logging",
}
_ADVICE = {
    "data_wait": (
        "Find why this rank's loader is slower: its shard of the data (larger or slower samples, a "
        "slower disk or network mount), a transform only it runs, or fewer loader workers or cores "
        "(several ranks on one node share its CPU: give each num_workers = cores per rank - 1)."
    ),
    "forward": (
        "This rank computes more per step: balance its batches (equal lengths per rank, e.g. a "
        "length-grouped distributed sampler), or look for a slower device or a throttled GPU."
    ),
    "optimizer": "This rank's optimizer step is slower: check for rank-specific work in the step.",
    "host": "Move rank-specific work between steps (metrics, printing, I/O) off the training loop.",
    "evaluation": "Evaluate on every rank's shard, or outside the training steps.",
    "checkpoint": "Save from one rank asynchronously, or with a distributed checkpoint every rank shares.",
    "logging": "Log less often on this rank, or asynchronously.",
}


def _excess(ranks: Sequence[Mapping[str, Any]], index: int, phase: str) -> float | None:
    own = (ranks[index].get("phases") or {}).get(phase)
    others = [(r.get("phases") or {}).get(phase) for i, r in enumerate(ranks) if i != index]
    values = [float(v) for v in others if v is not None]
    if own is None or not values:
        return None
    return float(own) - statistics.median(values)


def _waiting_s(phases: Mapping[str, Any]) -> float | None:
    values = [phases.get(p) for p in WAITING_PHASES]
    known = [float(v) for v in values if v is not None]
    return sum(known) if known else None


def rule_straggler(s: RunStats) -> Finding | None:
    """One rank's own work takes longer than the others', who wait for it at every step."""
    ranks = [r for r in s.ranks if r.get("phases")]
    if len(ranks) < 2:
        return None
    best: tuple[float, int, str] | None = None
    for index in range(len(ranks)):
        for phase in OWN_PHASES:
            excess = _excess(ranks, index, phase)
            if excess is not None and (best is None or excess > best[0]):
                best = (excess, index, phase)
    if best is None:
        return None
    excess, index, phase = best
    slow = ranks[index]
    others = [r for i, r in enumerate(ranks) if i != index]
    steps = [float(r["step_time_s"]) for r in others if r.get("step_time_s")]
    step = s.step_time_s or (statistics.median(steps) if steps else None)
    if not step or excess < MIN_EXCESS_S or excess < STRAGGLER_SHARE * step:
        return None
    own_wait = _waiting_s(slow["phases"])
    waits = [w for w in (_waiting_s(r["phases"]) for r in others) if w is not None]
    wait = max(0.0, statistics.median(waits) - own_wait) if waits and own_wait is not None else excess
    wait_share = min(1.0, wait / step)
    predicted = max(step - min(excess, step), 0.0)
    rank = int(slow.get("rank", index))
    medians = {
        p: statistics.median(float((r["phases"]).get(p) or 0.0) for r in others)
        for p in (*OWN_PHASES, *WAITING_PHASES)
    }
    evidence = {
        "rank": rank,
        "phase": phase,
        "excess_s": round(excess, 6),
        "excess_share": round(excess / step, 4),
        "phase_s": round(float(slow["phases"][phase]), 6),
        "median_other_ranks_phase_s": round(medians[phase], 6),
        "wait_s": round(wait, 6),
        "wait_share": round(wait_share, 4),
        "step_time_s": step,
        "ranks": len(ranks),
        "per_rank_phase_s": {int(r.get("rank", i)): r["phases"].get(phase) for i, r in enumerate(ranks)},
        "predicted_step_s": predicted,
    }
    words = _WORDS.get(phase, phase)
    title = (
        f"Straggler: rank {rank} spends {excess * 1e3:.1f} ms more per step {words} than the median "
        f"other rank ({medians[phase] * 1e3:.1f} ms); the other ranks wait for it {wait_share:.0%} of their "
        f"step; {faster_text(step, predicted)} without it"
    )
    advice = (
        _ADVICE.get(phase, "Find what this rank does that the others do not."),
        f"Every rank waits for the slowest at each gradient all-reduce: the job runs at rank {rank}'s pace. "
        "Per-rank figures are in the report's summary (ranks) and TensorBoard's *_max scalars.",
    )
    severity = "critical" if excess >= CRITICAL_STRAGGLER_SHARE * step else "warning"
    return Finding("straggler", severity, title, evidence, advice, predicted)
