"""The rules of where a step's time goes: each reads the step split by phase (``RunStats.phases``,
measured by the front doors) and names one cause, its measured share of the step and the step time
predicted once its advice is followed (``Finding.predicted_step_s``), "about N% faster".

Thresholds (module constants, each with its reason):

- ``MIN_GAIN_SHARE`` (10%): a time finding is a warning only when its advice is predicted to save at
  least this share of the step. Step times of identical runs on a shared host differ by several
  percent; a smaller gain is within that noise and not worth the user's attention first.
- ``OPTIMIZER_STEP_SHARE`` (10%): the optimizer's share of the step from which a for-loop
  implementation (``foreach=False``, or the CPU default) is worth switching; a fused or for-each
  AdamW is a few percent of a step (pytorch #134191: 2.5% for-each vs 33% for-loop).
- ``FOR_LOOP_MIN_TENSORS`` (32): below this many parameter tensors the for-loop's per-tensor launch
  overhead is small and the for-each path gains little.
- ``FOREACH_TIME_FRACTION`` (0.4): what remains of a for-loop step under ``foreach=True`` when the run
  did not measure it. The monitor measures both at the end of a run whose optimizer phase is worth a
  finding (:func:`resource_guard.observe.optimizer_facts.foreach_probe`: for-each takes 0.37-0.82 of
  the for-loop for AdamW over 360 tensors on the 2-core CI host, the smaller the tensors the lower),
  and the finding predicts the difference it measured; ``benchmarks/bottlenecks.py`` checks it.
- ``HOST_SHARE`` / ``EVALUATION_SHARE`` / ``CHECKPOINT_SHARE`` / ``LOGGING_SHARE`` (10% each): the share
  of the step in the loop's own code between steps, in evaluation, in saving checkpoints, in logging
  from which the finding fires (below ``MIN_GAIN_SHARE`` the cheaper schedule gains too little).
- ``SCHEDULE_TARGET_SHARE`` (5%): the share of the step a cheaper schedule (evaluating, saving or
  logging every k-th time) aims for: k is the smallest interval that brings the phase below it.
- ``CRITICAL_TIME_SHARE`` (25%): from this share the finding is critical (a quarter of the run).

Every prediction goes through :func:`resource_guard.report.gains.bounded_gain`: the phase is clipped to
the step, and the predicted step never falls below forward + backward + optimizer (for the optimizer-step
rule, the part of the optimizer phase it does not remove).

Example:
    >>> phases = {"forward": 0.01, "backward": 0.02, "optimizer": 0.005, "evaluation": 0.015}
    >>> f = rule_evaluation(RunStats(steps=100, step_time_s=0.05, phases=phases))
    >>> f.id, f.evidence["evaluation_share"], round(f.predicted_step_s, 4)
    ('evaluation', 0.3, 0.0367)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from resource_guard.report.gains import bounded_gain, compute_floor_s, faster_text
from resource_guard.report.types import Finding, RunStats

__all__ = [
    "CHECKPOINT_SHARE",
    "CRITICAL_TIME_SHARE",
    "EVALUATION_SHARE",
    "FOREACH_TIME_FRACTION",
    "FOR_LOOP_MIN_TENSORS",
    "HOST_SHARE",
    "LOGGING_SHARE",
    "MIN_GAIN_SHARE",
    "OPTIMIZER_STEP_SHARE",
    "PHASE_RULES",
    "SCHEDULE_TARGET_SHARE",
    "faster_text",
    "phase_share",
    "rule_checkpoint_io",
    "rule_evaluation",
    "rule_host_loop",
    "rule_logging",
    "rule_optimizer_step",
]

MIN_GAIN_SHARE = 0.10
OPTIMIZER_STEP_SHARE = 0.10
FOR_LOOP_MIN_TENSORS = 32
FOREACH_TIME_FRACTION = 0.4
HOST_SHARE = 0.10
EVALUATION_SHARE = 0.10
CHECKPOINT_SHARE = 0.10
LOGGING_SHARE = 0.10
SCHEDULE_TARGET_SHARE = 0.05
CRITICAL_TIME_SHARE = 0.25


def phase_share(s: RunStats, phase: str) -> tuple[float, float] | None:
    """``(seconds per step, share of the step)`` of ``phase``; ``None`` when not measured."""
    if not s.phases or not s.step_time_s or s.step_time_s <= 0:
        return None
    seconds = float(s.phases.get(phase) or 0.0)
    return seconds, seconds / s.step_time_s


def _severity(share: float, gain_share: float) -> str:
    if gain_share < MIN_GAIN_SHARE:
        return "info"
    return "critical" if share >= CRITICAL_TIME_SHARE else "warning"


def _every_k(share: float) -> int:
    """The smallest k with ``share / k`` of the step below :data:`SCHEDULE_TARGET_SHARE` (at least 2)."""
    rest = max(1.0 - share, 1e-9)
    # phase/k over (rest + phase/k) <= target  <=>  k >= phase * (1 - target) / (target * rest)
    k = share * (1.0 - SCHEDULE_TARGET_SHARE) / (SCHEDULE_TARGET_SHARE * rest)
    return max(2, math.ceil(k - 1e-9))


def _finding(
    s: RunStats,
    finding_id: str,
    phase: str,
    threshold: float,
    title: str,
    advice: Callable[[int, str], list[str]],
    removed: Callable[[int, float], float],
    extra: Mapping[str, Any] | None = None,
    cause: str | None = None,
) -> Finding | None:
    """A finding on ``phase`` from ``threshold`` of the step on; the advice removes
    ``removed(k, seconds)`` of the phase's ``seconds`` per step (``k``: the cheaper schedule's interval)."""
    measured = phase_share(s, phase)
    if measured is None or measured[1] < threshold:
        return None
    assert s.step_time_s is not None
    # the phase clipped to the step (a share is at most 100%), the floor what the advice does not touch
    seconds = bounded_gain(s.step_time_s, measured[0]).part_s
    share = seconds / s.step_time_s
    k = _every_k(share)
    removed_s = min(removed(k, seconds), seconds)
    clipped = {**(s.phases or {}), phase: seconds}  # the phase as a share of the step counts it
    floor = compute_floor_s(clipped, without={phase: removed_s} if phase == "optimizer" else None)
    gain = bounded_gain(s.step_time_s, removed_s, floor_s=floor)
    predicted, faster = gain.predicted_step_s, gain.text
    evidence = {  # the first key ending in "share" is what the cause costs: the phase, or ``cause``'s part
        **({f"{cause}_share": round(gain.share, 4)} if cause else {}),
        f"{phase}_share": round(share, 4),
        f"{phase}_s_per_step": seconds,
        "step_time_s": s.step_time_s,
        "predicted_step_s": predicted,
        "floor_step_s": floor,
        "predicted_gain_share": round(gain.removed_s / s.step_time_s, 4),
        **(extra or {}),
    }
    return Finding(
        finding_id,
        _severity(share, gain.removed_s / s.step_time_s),
        f"{title.format(share=share, cause_share=gain.share)}; {faster} without it",
        evidence,
        tuple(advice(k, faster)),
        predicted,
    )


def rule_optimizer_step(s: RunStats) -> Finding | None:
    """The optimizer step runs a for-loop over many tensors where a for-each or fused path exists."""
    slow = [o for o in s.optimizers if o.get("for_loop") and (o.get("tensors") or 0) >= FOR_LOOP_MIN_TENSORS]
    if not slow:
        return None
    first = slow[0]
    name, tensors = first.get("name", "the optimizer"), first.get("tensors")
    fused = bool(first.get("fused_available")) and s.device_kind == "cuda"
    loop_s, each_s = first.get("for_loop_s"), first.get("foreach_s")
    saved_s = None  # what foreach=True saves a step, as measured at the end of the run
    if isinstance(loop_s, float) and isinstance(each_s, float) and 0.0 < each_s < loop_s:
        saved_s = loop_s - each_s
    measured = saved_s is not None

    def advice(_k: int, faster: str) -> list[str]:
        setting = "fused=True" if fused else "foreach=True"
        return [
            f"Construct {name} with {setting} ({faster}): it updates all {tensors} parameter tensors in a "
            f"few multi-tensor kernels instead of a Python loop over each"
            + (" (on the CPU foreach is not the default: pass it)." if s.device_kind == "cpu" else "."),
            "Fewer, larger parameter tensors (fused QKV projections, no per-channel parameters) also cut "
            "the per-tensor cost.",
        ]

    return _finding(
        s,
        "optimizer-step",
        "optimizer",
        OPTIMIZER_STEP_SHARE,
        f"Optimizer step: {name}'s for-loop over {tensors} tensors costs {{cause_share:.0%}} of the step "
        f"(the optimizer step is {{share:.0%}} of it)",
        advice,
        # what the probe measured, bounded by the phase; unmeasured, the assumed fraction of it
        lambda _k, phase_s: (
            phase_s * (1.0 - FOREACH_TIME_FRACTION) if saved_s is None else min(phase_s, saved_s)
        ),
        {
            "optimizer": name,
            "tensors": tensors,
            "foreach": first.get("foreach"),
            "fused": first.get("fused"),
            "for_loop_s": loop_s,
            "foreach_s": each_s,
            "foreach_gain_source": "measured" if measured else "assumed",
        },
        cause="for_loop",
    )


def rule_host_loop(s: RunStats) -> Finding | None:
    """The loop's own code between steps (metrics, prints, hooks) takes a large share of the step."""

    def advice(_k: int, faster: str) -> list[str]:
        return [
            f"Move the work between steps off the hot loop ({faster}): compute metrics every N steps or "
            "on the device (accumulate tensors, call .item() once per log interval), not per step in Python.",
            "In Lightning this is the module's and callbacks' batch hooks (on_train_batch_end, ...); with "
            "guard, the code after g.backward(loss). Wrap checkpoint saving or logging there in "
            "`with g.phase('checkpoint'):` / `g.phase('logging')` to have them named.",
        ]

    return _finding(
        s,
        "host-loop",
        "host",
        HOST_SHARE,
        "Host loop: {share:.0%} of the step in the loop's own code between steps",
        advice,
        lambda _k, phase_s: phase_s,
    )


def rule_evaluation(s: RunStats) -> Finding | None:
    """Evaluation takes a large share of the training run's wall time."""

    def advice(k: int, faster: str) -> list[str]:
        return [
            f"Evaluate {k}x less often ({faster}): Lightning val_check_interval (or check_val_every_n_epoch) "
            f"x{k}; with guard, call g.evaluate every {k}x as many steps.",
            "Or evaluate on fewer batches between epochs (limit_val_batches) and in full at the end.",
        ]

    return _finding(
        s,
        "evaluation",
        "evaluation",
        EVALUATION_SHARE,
        "Evaluation: {share:.0%} of the wall time is spent evaluating",
        advice,
        lambda k, phase_s: phase_s * (1.0 - 1.0 / k),
    )


def rule_checkpoint_io(s: RunStats) -> Finding | None:
    """Saving checkpoints takes a large share of the wall time."""

    def advice(k: int, faster: str) -> list[str]:
        return [
            f"Save {k}x less often ({faster}): ModelCheckpoint(every_n_train_steps=... x{k}) or "
            "train_time_interval; with guard, every k-th step.",
            "Or save asynchronously: Lightning's AsyncCheckpointIO plugin, or "
            "torch.distributed.checkpoint.async_save, so training goes on while the file is written.",
        ]

    return _finding(
        s,
        "checkpoint-io",
        "checkpoint",
        CHECKPOINT_SHARE,
        "Checkpoint I/O: {share:.0%} of the wall time is spent saving checkpoints",
        advice,
        lambda k, phase_s: phase_s * (1.0 - 1.0 / k),
    )


def rule_logging(s: RunStats) -> Finding | None:
    """Logging metrics takes a large share of the step."""

    def advice(k: int, faster: str) -> list[str]:
        return [
            f"Log {k}x less often ({faster}): Trainer(log_every_n_steps=... x{k}), self.log(..., "
            "on_step=False, on_epoch=True) for metrics not needed per step.",
            "Log tensors and let the logger reduce them; avoid sync_dist=True on every step "
            "(a collective per call) and .item() per metric.",
        ]

    return _finding(
        s,
        "logging",
        "logging",
        LOGGING_SHARE,
        "Logging: {share:.0%} of the step is spent logging",
        advice,
        lambda k, phase_s: phase_s * (1.0 - 1.0 / k),
    )


PHASE_RULES: tuple[Callable[[RunStats], Finding | None], ...] = (
    rule_optimizer_step,
    rule_host_loop,
    rule_evaluation,
    rule_checkpoint_io,
    rule_logging,
)
