"""The rules of where a step's time goes: thresholds, shares, predictions and the ranking."""

from __future__ import annotations

import pytest

from resource_guard.report.findings import analyze
from resource_guard.report.phase_rules import (
    CHECKPOINT_SHARE,
    EVALUATION_SHARE,
    FOREACH_TIME_FRACTION,
    HOST_SHARE,
    LOGGING_SHARE,
    MIN_GAIN_SHARE,
    rule_checkpoint_io,
    rule_evaluation,
    rule_host_loop,
    rule_logging,
    rule_optimizer_step,
)
from resource_guard.report.rules import rule_input_bound
from resource_guard.report.types import Finding, RunStats

STEP = 0.1
BASE = {"forward": 0.02, "backward": 0.04}


def stats(**phases: float) -> RunStats:
    values = {**BASE, **phases}
    values["other"] = max(0.0, STEP - sum(values.values()))
    return RunStats(
        steps=50, step_time_s=STEP, phases=values, data_wait_share=values.get("data_wait", 0.0) / STEP
    )


@pytest.mark.parametrize(
    ("rule", "phase", "threshold", "finding_id"),
    [
        (rule_host_loop, "host", HOST_SHARE, "host-loop"),
        (rule_evaluation, "evaluation", EVALUATION_SHARE, "evaluation"),
        (rule_checkpoint_io, "checkpoint", CHECKPOINT_SHARE, "checkpoint-io"),
        (rule_logging, "logging", LOGGING_SHARE, "logging"),
    ],
)
def test_a_phase_rule_fires_from_its_threshold_with_share_and_prediction(
    rule, phase: str, threshold: float, finding_id: str
) -> None:
    assert rule(stats(**{phase: STEP * threshold * 0.9})) is None
    assert rule(RunStats(steps=5, step_time_s=STEP)) is None  # phases not measured
    f = rule(stats(**{phase: STEP * 0.3}))
    assert isinstance(f, Finding) and f.id == finding_id
    assert f.evidence[f"{phase}_share"] == pytest.approx(0.3)
    assert any(k.endswith("share") for k in f.evidence)
    assert f.predicted_step_s is not None and STEP * 0.7 <= f.predicted_step_s < STEP
    assert "faster" in f.title and f.severity == "critical"


def test_the_cheaper_schedule_brings_the_phase_to_a_few_percent() -> None:
    f = rule_evaluation(stats(evaluation=0.04))
    assert f is not None
    advice = f.advice[0]
    k = int(advice.split("Evaluate ")[1].split("x")[0])
    remaining = 0.04 / k
    assert remaining / (STEP - 0.04 + remaining) <= 0.05  # the target share, at the smallest such k
    remaining_before = 0.04 / (k - 1)
    assert remaining_before / (STEP - 0.04 + remaining_before) > 0.05 or k == 2


def test_the_prediction_is_bounded_by_the_critical_path() -> None:
    s = RunStats(steps=9, step_time_s=STEP, phases={"forward": 0.05, "backward": 0.04, "host": 0.02})
    f = rule_host_loop(s)
    assert f is not None and f.predicted_step_s == pytest.approx(0.09)


def test_optimizer_step_needs_a_for_loop_over_many_tensors() -> None:
    facts = {"name": "AdamW", "tensors": 360, "foreach": False, "for_loop": True, "fused_available": True}
    s = stats(optimizer=0.03)
    assert rule_optimizer_step(s) is None  # no optimizer facts: nothing to advise
    fast = dict(facts, foreach=True, for_loop=False)
    assert rule_optimizer_step(RunStats(**{**s.__dict__, "optimizers": (fast,)})) is None
    few = dict(facts, tensors=4)
    assert rule_optimizer_step(RunStats(**{**s.__dict__, "optimizers": (few,)})) is None
    f = rule_optimizer_step(RunStats(**{**s.__dict__, "optimizers": (facts,)}))
    assert f is not None and f.id == "optimizer-step" and "foreach=True" in f.advice[0]
    assert f.predicted_step_s == pytest.approx(STEP - 0.03 * (1 - FOREACH_TIME_FRACTION))
    assert f.evidence["foreach_gain_source"] == "assumed"
    # measured at the end of the run: the prediction and the stated cost (first "share" key) follow it
    probe = dict(
        facts, for_loop_s=0.025, foreach_s=0.016
    )  # the optimizer phase also holds 5 ms of other work
    g = rule_optimizer_step(RunStats(**{**s.__dict__, "optimizers": (probe,)}))
    assert g is not None and g.predicted_step_s == pytest.approx(STEP - 0.009)
    first_share = next(k for k in g.evidence if k.endswith("share"))
    assert first_share == "for_loop_share" and g.evidence[first_share] == pytest.approx(
        0.009 / STEP, abs=1e-4
    )
    assert g.evidence["optimizer_share"] == pytest.approx(0.03 / STEP, abs=1e-4)
    assert g.evidence["foreach_gain_source"] == "measured"
    # a probe that saves more than the phase took cannot predict more than the phase
    big = dict(facts, for_loop_s=0.5, foreach_s=0.1)
    h = rule_optimizer_step(RunStats(**{**s.__dict__, "optimizers": (big,)}))
    assert h is not None and h.predicted_step_s == pytest.approx(STEP - 0.03)


def test_a_small_gain_is_info_not_a_warning_and_the_run_stays_healthy() -> None:
    # 11% in logging: the cheaper schedule saves less than MIN_GAIN_SHARE of the step? no: it saves ~8%
    s = stats(logging=STEP * 0.11)
    f = rule_logging(s)
    assert f is not None and 1 - f.predicted_step_s / STEP < MIN_GAIN_SHARE and f.severity == "info"
    assert analyze(s).verdict == "healthy"


def test_input_bound_with_phases_needs_a_gain_worth_a_warning() -> None:
    # an in-memory loader collated on the main thread: 6% of the step (the old flicker)
    assert rule_input_bound(stats(data_wait=0.006)) is None
    f = rule_input_bound(stats(data_wait=0.03))
    assert f is not None and f.predicted_step_s == pytest.approx(0.07) and "faster" in f.title
    # without phases (older reports), the stall threshold alone, as before
    assert rule_input_bound(RunStats(data_wait_share=0.06)) is not None


def test_findings_are_ranked_by_the_time_they_cost() -> None:
    s = stats(evaluation=0.015, checkpoint=0.03)
    report = analyze(s)
    assert [f.id for f in report.findings][:2] == ["checkpoint-io", "evaluation"]
    oom = RunStats(**{**s.__dict__, "oom": {"step": 3, "error": "CUDA out of memory"}})
    assert analyze(oom).verdict == "oom"


def test_a_clean_split_is_healthy() -> None:
    report = analyze(stats(optimizer=0.02, host=0.002, data_wait=0.003))
    assert report.verdict == "healthy" and not [f for f in report.findings if f.severity != "info"]
