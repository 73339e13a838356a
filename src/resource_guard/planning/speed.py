"""The planner's choice among fitting configurations by predicted step time (rule 4 of the planner).

On this machine's CPU the planner ranks what fits by :class:`~resource_guard.planning.op_time.OpTimeModel`
(a per-operator model from the estimate's fake trace, with this CPU's calibrated speeds); on one CUDA/ROCm
GPU of the catalog by :class:`~resource_guard.planning.gpu_time.GpuOpModel` (the same trace, the catalog's
peak and bandwidth); elsewhere (several GPUs, whose strategies differ by communication; MPS) it keeps
the relative-cost rule of :func:`~resource_guard.planning.search.relative_cost`.

Every optimizer step has the same samples, so the fastest step is the fastest per sample.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from resource_guard.devices import DeviceSpec
from resource_guard.errors import ConfigurationError
from resource_guard.planning.op_time import OpTimeModel, StepTimeModel, StepTimePrediction
from resource_guard.planning.search import Alternative, Candidate
from resource_guard.step.batching import resize_batch

__all__ = [
    "STEP_TIME_CHOICES",
    "Timed",
    "describe_win",
    "mark_times",
    "resolve_step_model",
    "step_ms",
    "time_candidates",
]

STEP_TIME_CHOICES = ("auto", "rule")

Timed = dict[tuple[int, int, str], StepTimePrediction]  # (micro, checkpoint_every, strategy) -> prediction


def resolve_step_model(step_time: Any, device: DeviceSpec, world_size: int = 1) -> StepTimeModel | None:
    """The model that ranks configurations: ``"auto"``: the op model on a CPU or on one catalog GPU
    with a peak and bandwidth, else None (the rule)."""
    if hasattr(step_time, "predict"):
        return step_time  # type: ignore[no-any-return]
    if step_time not in STEP_TIME_CHOICES:
        raise ConfigurationError(
            f"`plan(step_time={step_time!r})` must be 'auto', 'rule' or a step-time model with a `predict` "
            "method (`resource_guard.planning.op_time.OpTimeModel()`)"
        )
    if step_time == "rule":
        return None
    if device.kind == "cpu":
        return OpTimeModel()
    if device.kind in ("cuda", "rocm") and world_size == 1:
        from resource_guard.planning.gpu_time import GpuOpModel

        try:
            return GpuOpModel(device)
        except ConfigurationError:  # no bandwidth or peak in the catalog: the rule
            return None
    return None


def time_candidates(
    candidates: list[Candidate],
    step_model: StepTimeModel,
    model: Any,
    optimizer: Any,
    batch: Any,
    loss_fn: Any,
    precision: str,
) -> Timed:
    """Predict each candidate's micro-step and optimizer update (one trace per configuration)."""
    timed: Timed = {}
    for c in candidates:
        key = (c.micro, int(c.ckpt), c.strategy)
        if key not in timed:
            timed[key] = step_model.predict(
                model, optimizer, resize_batch(batch, c.micro), loss_fn,
                precision=precision, checkpoint_every=int(c.ckpt),
            )  # fmt: skip
    return timed


def step_ms(timed: Timed, c: Candidate, per_rank: int) -> float:
    return timed[(c.micro, int(c.ckpt), c.strategy)].step_s(per_rank // c.micro) * 1e3


def config_words(c: Candidate, per_rank: int, precision: str) -> str:
    every = int(c.ckpt)
    ckpt = "" if not every else " +ckpt" if every == 1 else f" +ckpt every {every}"
    return f"{c.micro}×{per_rank // c.micro} {precision}{ckpt}"


def describe_win(
    best: Candidate, others: list[Candidate], timed: Timed, per_rank: int, precision: str
) -> str:
    """The reason: the winner's predicted step, the runner-up's, and the operator class that makes the gap."""
    mine = timed[(best.micro, int(best.ckpt), best.strategy)]
    line = (
        f"fastest that fits by the step-time model: {config_words(best, per_rank, precision)} "
        f"at {mine.describe(per_rank // best.micro)}"
    )
    rest = sorted((c for c in others if c is not best), key=lambda c: step_ms(timed, c, per_rank))
    if not rest:
        return line
    runner = rest[0]
    theirs = timed[(runner.micro, int(runner.ckpt), runner.strategy)]
    k_mine, k_theirs = per_rank // best.micro, per_rank // runner.micro
    gaps = {
        cls: k_theirs * theirs.micro_step_by_class_s.get(cls, 0.0) - k_mine * secs
        for cls, secs in mine.micro_step_by_class_s.items()
    }
    cls, gap = max(gaps.items(), key=lambda kv: kv[1])
    if gap <= 0:
        why = ""
    elif cls == "framework":
        why = (
            f"; its host time around the operators (dispatch, autograd, the Python between them) is "
            f"{gap * 1e3:,.1f} ms less per step"
        )
    else:
        why = f"; its {cls} operators take {gap * 1e3:,.1f} ms less per step"
    if best.ckpt and not runner.ckpt:
        why += " (the larger micro-batch pays for the recompute)"
    return (
        f"{line}; next: {config_words(runner, per_rank, precision)} at "
        f"{step_ms(timed, runner, per_rank):,.1f} ms/step{why}"
    )


def mark_times(rows: tuple[Alternative, ...], timed: Timed) -> tuple[Alternative, ...]:
    """The alternatives with their predicted ms per step, the timed ones first, fastest first."""
    out = []
    for r in rows:
        pred = timed.get((r.micro_batch_size, int(r.checkpointing), r.strategy)) if r.fits else None
        ms = pred.step_s(r.accumulation_steps) * 1e3 if pred is not None else None
        out.append(dataclasses.replace(r, predicted_step_ms=ms))

    def order(r: Alternative) -> tuple[bool, float]:
        return (not r.fits, r.predicted_step_ms if r.predicted_step_ms is not None else float("inf"))

    return tuple(sorted(out, key=order))
