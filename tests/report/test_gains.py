"""Predicted gains are bounded by construction: every time rule, fed measurements larger than the step,
states no share above 100% and no predicted step below its floor (issue #40)."""

from __future__ import annotations

import doctest
import re
from collections.abc import Callable

import pytest

from resource_guard.report import gains
from resource_guard.report.findings import analyze
from resource_guard.report.gains import UNMEASURED_FLOOR_SHARE, bounded_gain, compute_floor_s, faster_text
from resource_guard.report.op_rules import (
    rule_casts,
    rule_comm_bound,
    rule_host_sync,
    rule_recompiles,
    rule_threads,
)
from resource_guard.report.phase_rules import (
    rule_checkpoint_io,
    rule_evaluation,
    rule_host_loop,
    rule_logging,
    rule_optimizer_step,
)
from resource_guard.report.rules import rule_input_bound
from resource_guard.report.types import Finding, ProfileSummary, RunStats

STEP = 0.074
COMPUTE = {"forward": 0.01, "backward": 0.02, "optimizer": 0.005}
FLOOR = sum(COMPUTE.values())


def test_docstring_examples_run() -> None:
    assert doctest.testmod(gains).failed == 0


def test_a_part_longer_than_the_step_is_the_whole_step_and_the_floor_stays() -> None:
    g = bounded_gain(0.074, 0.117, floor_s=0.03)
    assert g.share == 1.0 and g.part_s == pytest.approx(0.074)
    assert g.predicted_step_s == pytest.approx(0.03) and g.removed_s == pytest.approx(0.044)
    assert bounded_gain(0.1, 0.5, interval_s=0.02).part_s == pytest.approx(0.02)  # clipped to its interval
    assert bounded_gain(0.1, 0.05, floor_s=0.5).predicted_step_s == pytest.approx(0.1)  # no slower step
    assert bounded_gain(0.1, 0.0).text == "about 0% faster"


def test_one_wording_from_the_predicted_step() -> None:
    assert faster_text(0.1, 0.08) == "about 25% faster"
    assert faster_text(0.1, 0.05) == "2.0x as fast"
    assert compute_floor_s(None) is None
    assert bounded_gain(0.1, 0.5).predicted_step_s == pytest.approx(0.1 * UNMEASURED_FLOOR_SHARE)
    assert compute_floor_s(COMPUTE, without={"optimizer": 1.0}) == pytest.approx(0.03)


def _phases(**extra: float) -> dict[str, float]:
    return {**COMPUTE, **extra}


def _profile(**kwargs: object) -> ProfileSummary:
    values: dict[str, object] = {"steps": 3, "step_wall_us": 1_000_000.0, "op_timeline": "host"}
    values.update(kwargs)
    return ProfileSummary(**values)  # type: ignore[arg-type]


def _oversized() -> list[tuple[str, Callable[[RunStats], Finding | None], RunStats, float]]:
    """(name, rule, stats whose measured part is longer than the step, the prediction's floor)."""
    loop = {"name": "AdamW", "tensors": 360, "for_loop": True, "for_loop_s": 0.5, "foreach_s": 0.1}
    big = 0.117  # seconds per step, on a 0.074 s step
    return [
        (
            "input-bound (phases)",
            rule_input_bound,
            RunStats(steps=50, step_time_s=STEP, phases=_phases(data_wait=big), data_wait_share=big / STEP),
            FLOOR,
        ),
        (
            "input-bound (no phases)",
            rule_input_bound,
            RunStats(steps=50, step_time_s=STEP, data_wait_s=big, data_wait_share=big / STEP),
            STEP * UNMEASURED_FLOOR_SHARE,  # no phases: at most 20x as fast
        ),
        ("host-loop", rule_host_loop, RunStats(steps=50, step_time_s=STEP, phases=_phases(host=big)), FLOOR),
        (
            "evaluation",
            rule_evaluation,
            RunStats(steps=50, step_time_s=STEP, phases=_phases(evaluation=big)),
            FLOOR,
        ),
        (
            "checkpoint-io",
            rule_checkpoint_io,
            RunStats(steps=50, step_time_s=STEP, phases=_phases(checkpoint=big)),
            FLOOR,
        ),
        ("logging", rule_logging, RunStats(steps=50, step_time_s=STEP, phases=_phases(logging=big)), FLOOR),
        (
            "optimizer-step",  # the probe's saving (0.4 s) larger than the optimizer phase and the step
            rule_optimizer_step,
            RunStats(steps=50, step_time_s=STEP, phases=_phases(optimizer=big), optimizers=(loop,)),
            COMPUTE["forward"] + COMPUTE["backward"],
        ),
        (
            "casts",  # the traced casts 1.76 s per step against a 1.17 s step
            rule_casts,
            RunStats(
                steps=50,
                step_time_s=1.17,
                profile=_profile(
                    step_wall_us=1.5e6, op_class_us=(("matmul", 300_000.0), ("casts", 1_760_000.0))
                ),
            ),
            1.17 * 300_000.0 / 2_060_000.0,
        ),
        (
            "host-sync",
            rule_host_sync,
            RunStats(
                steps=50,
                step_time_s=STEP,
                profile=_profile(
                    op_timeline="device",
                    step_wall_us=50_000.0,
                    syncs_per_step=2.0,
                    sync_idle_us=90_000.0,
                    device_busy_us=20_000.0,
                ),
            ),
            20_000.0 / 1e6,  # the device's busy time per step stays (every share is of the untraced step)
        ),
        (
            "threads",
            rule_threads,
            RunStats(
                steps=50,
                step_time_s=STEP,
                threads={
                    "intra_op_threads": 16,
                    "processes": 1,
                    "workers": 0,
                    "cores": 2,
                    "threads": 16,
                    "fitting_threads": 2,
                    "slowdown": 1e9,
                },
            ),  # fmt: skip
            STEP * UNMEASURED_FLOOR_SHARE,
        ),
        (
            "recompiles",
            rule_recompiles,
            RunStats(
                steps=50,
                step_time_s=STEP,
                duration_s=3.0,
                phases=_phases(),
                compile={"recompiles": 4, "recompile_s": 9.0, "graph_breaks": 0},
            ),
            FLOOR,
        ),
        (
            "comm-bound",
            rule_comm_bound,
            RunStats(
                steps=50,
                step_time_s=STEP,
                phases=_phases(),
                profile=_profile(
                    op_timeline="device", step_wall_us=50_000.0, comm_us=90_000.0, exposed_comm_us=80_000.0
                ),
            ),
            FLOOR,
        ),
    ]


@pytest.mark.parametrize(("name", "rule", "stats", "floor"), _oversized(), ids=[c[0] for c in _oversized()])
def test_every_rule_fed_more_than_the_step_states_a_possible_gain(
    name: str, rule: Callable[[RunStats], Finding | None], stats: RunStats, floor: float
) -> None:
    f = rule(stats)
    assert f is not None, name
    step = stats.step_time_s
    assert step is not None
    shares = {k: v for k, v in f.evidence.items() if k.endswith("share") and isinstance(v, (int, float))}
    assert shares and all(0.0 <= v <= 1.0 for v in shares.values()), shares
    assert all(int(n) <= 100 for n in re.findall(r"(\d+)%", f.title)), f.title  # no share or gain above 100%
    assert f.predicted_step_s is not None
    assert floor - 1e-9 <= f.predicted_step_s <= step
    ratio = step / f.predicted_step_s
    assert faster_text(step, f.predicted_step_s) in f.title  # the one wording, from the predicted step
    assert ratio <= step / floor + 1e-9


def test_the_report_ranks_bounded_findings() -> None:
    stats = RunStats(steps=50, step_time_s=STEP, phases=_phases(evaluation=0.05, checkpoint=0.05))
    report = analyze(stats)
    for f in report.findings:
        if f.predicted_step_s is not None:
            assert FLOOR - 1e-9 <= f.predicted_step_s <= STEP
