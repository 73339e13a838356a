"""The phase clock: one running phase, switched at boundaries; the parts add up to the wall time."""

from __future__ import annotations

import pytest

from resource_guard.observe.phases import PhaseClock, phase_means, timed
from resource_guard.report.types import PHASES


class Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_switch_charges_the_running_phase_and_take_resets() -> None:
    t = Ticks()
    clock = PhaseClock(0.0, t)
    t.now = 1.0
    assert clock.switch("data_wait") == "other"
    t.now = 3.0
    clock.switch("forward")
    t.now = 3.5
    totals = clock.take(4.0)
    assert totals["other"] == 1.0 and totals["data_wait"] == 2.0 and totals["forward"] == 1.0
    assert sum(totals.values()) == 4.0 and set(totals) == set(PHASES)
    assert clock.take(5.0)["forward"] == 1.0  # still running: charged from the last take on


def test_nested_phase_is_subtracted_from_the_enclosing_one() -> None:
    t = Ticks()
    clock = PhaseClock(0.0, t)
    clock.switch("evaluation")
    t.now = 2.0
    with timed(clock, "checkpoint"):
        t.now = 5.0
    assert clock.current == "evaluation"
    t.now = 6.0
    totals = clock.take(6.0)
    assert totals["evaluation"] == 3.0 and totals["checkpoint"] == 3.0


def test_skip_leaves_time_out_and_charge_keeps_the_phase() -> None:
    t = Ticks()
    clock = PhaseClock(0.0, t)
    clock.switch("host")
    clock.charge(2.0)
    clock.skip(10.0)  # the monitor's own work: nobody's phase
    assert clock.current == "host" and clock.take(11.0)["host"] == 3.0


def test_an_unknown_phase_is_refused_before_it_runs() -> None:
    clock = PhaseClock()
    with pytest.raises(KeyError):
        clock.switch("lunch")
    assert clock.current == "other"


def test_timed_without_a_clock_is_a_no_op() -> None:
    with timed(None, "checkpoint"):
        pass


def test_phase_means_make_other_the_remainder_and_never_exceed_the_step() -> None:
    means = phase_means({"forward": 2.0, "backward": 4.0, "other": 9.0}, steps=2, step_time_s=4.0)
    assert means is not None and means["other"] == pytest.approx(1.0)
    assert sum(means.values()) == pytest.approx(4.0)
    scaled = phase_means({"forward": 6.0, "backward": 6.0}, steps=2, step_time_s=4.0)
    assert scaled is not None and sum(scaled.values()) == pytest.approx(4.0) and scaled["other"] == 0.0
    assert phase_means({}, steps=0, step_time_s=1.0) is None
