"""The monitor's TensorBoard scalars (issue #38): few, ordered by section, named with units, phases as
shares, nothing always zero; and the time-bounded log cadence (``log_every_n_steps=None``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from resource_guard.errors import ConfigurationError
from resource_guard.observe import monitor
from resource_guard.observe.monitor import LOG_EVERY_STEP_UNTIL, RunMonitor
from resource_guard.report.scalar_tags import phase_values, scalar_values


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def phased_steps(mon: RunMonitor, clock: FakeClock, steps: int, *, evaluation_from: int) -> None:
    """Steps of 10 ms data wait, 30 ms forward, 50 ms backward, 10 ms optimizer, 0.1 ms between steps;
    from step ``evaluation_from`` on, 20 ms of evaluation as well."""
    phases = mon.phases
    assert phases is not None
    for step in range(1, steps + 1):
        phases.switch("data_wait")
        clock.now += 0.01
        mon.batch_ready(torch.zeros(8, 4))
        for phase, seconds in (("forward", 0.03), ("backward", 0.05), ("optimizer", 0.01)):
            phases.switch(phase)
            clock.now += seconds
        if step >= evaluation_from:
            phases.switch("evaluation")
            clock.now += 0.02
        phases.switch("host")
        clock.now += 0.0001
        phases.switch("other")
        mon.step_end()


def test_scalars_are_few_in_units_with_phase_shares_and_no_flat_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(monitor, "_clock", clock)
    mon = RunMonitor(tmp_path, profile=False, summary=False, phase_timing=True, log_interval_s=0.5)
    mon.start()
    phased_steps(mon, clock, 25, evaluation_from=6)
    mon.close()
    tags = scalars(tmp_path)
    names = {t.removeprefix("resource_guard/") for t in tags}
    # every tag in a numbered section, with its unit; no GPU, allocator or raw-byte tags on a CPU run
    assert all(n.split("/")[0][0].isdigit() for n in names), sorted(names)
    assert not [n for n in names if "gpu" in n or "reserved" in n or n.endswith(("_bytes", "_share"))]
    # the time-bounded cadence: every step for the first 20, then one boundary per 0.5 s (4 steps of
    # 120 ms), and the last interval at close
    steps = [s for s, _ in tags["resource_guard/1_step/time_ms"]]
    assert steps == [*range(1, LOG_EVERY_STEP_UNTIL + 1), 24, 25]
    assert tags["resource_guard/1_step/time_ms"][-1][1] == pytest.approx(120.1)  # ms per step
    # phases: ms per step and % of the step; a phase never timed is not written, a phase is written
    # from its first non-zero interval on
    # (the 0.1 ms between steps, under 0.5% of the step, neither)
    assert {"checkpoint", "communication", "host"}.isdisjoint({n.split("/")[-1] for n in names})
    evaluation = tags["resource_guard/2_phase_pct/evaluation"]
    assert evaluation[0][0] == 6 and evaluation[-1] == (25, pytest.approx(20 / 120.1 * 100))
    assert tags["resource_guard/3_phase_ms/backward"][-1][1] == pytest.approx(50.0)
    for step in (3, 10, 25):  # the shares of a logged step add up to the whole step
        shares = [v for t, points in tags.items() if "2_phase_pct" in t for s, v in points if s == step]
        assert sum(shares) == pytest.approx(100.0, abs=0.1)  # all but the 0.1 ms
    # with phases, the data wait is its phase's share, not a second tag
    assert "resource_guard/1_step/data_wait_pct" not in tags
    assert tags["resource_guard/2_phase_pct/data_wait"][-1][1] == pytest.approx(10 / 120.1 * 100)


def test_scalar_values_name_the_memory_by_what_it_counts() -> None:
    row = {
        "memory/peak_bytes": 3 * 2**20,
        "memory/allocated_bytes": 2**20,
        "memory/reserved_bytes": float("nan"),
    }
    cpu = scalar_values(row, cuda=False)
    assert cpu == {"4_memory/rss_peak_mib": 3.0, "4_memory/heap_in_use_mib": 1.0}
    plan = {"capacity_bytes": 256 * 2**20, "usable_bytes": 230 * 2**20}
    cuda = scalar_values(row, cuda=True, plan=plan)
    assert cuda == {
        "4_memory/allocated_peak_mib": 3.0,
        "4_memory/allocated_mib": 1.0,
        "4_memory/capacity_mib": 256.0,
        "4_memory/usable_mib": 230.0,
    }
    assert "4_memory/usable_mib" not in scalar_values(row, cuda=False, plan=plan)  # not beside an RSS
    slowest = scalar_values({"time/step_s": 0.1}, cuda=False, maxes={"time/step_s": 0.15})
    assert slowest["1_step/time_ms_slowest_rank"] == pytest.approx(150.0)


def test_phase_values_write_a_phase_once_it_was_non_zero() -> None:
    first, seen = phase_values({"forward": 0.0, "backward": 0.1, "other": 1e-5}, 0.1, ())
    assert set(first) == {"2_phase_pct/backward", "3_phase_ms/backward"}  # other: 0.01% of the step
    later, seen = phase_values({"forward": 0.05, "backward": 0.05}, 0.1, seen)
    again, _ = phase_values({"forward": 0.0, "backward": 0.1}, 0.1, seen)
    assert later["2_phase_pct/forward"] == pytest.approx(50.0)
    assert again["3_phase_ms/forward"] == 0.0  # seen before: its zero is written (the line continues)


def test_the_time_bounded_cadence_follows_the_step_time() -> None:
    mon = RunMonitor(None, profile=False, summary=False, log_interval_s=2.0)
    assert mon.log_every_n_steps is None
    mon._step = 5
    mon._schedule_log(10.0)  # the first steps: every step, however short
    assert mon._next_log == 6
    mon._step = 40
    mon._schedule_log(0.3)  # 2 s of 0.3 s steps: 6 steps on
    assert mon._next_log == 46
    mon._schedule_log(3.0)  # steps longer than the interval: every step
    assert mon._next_log == 41
    mon._schedule_log(1e-6)  # a very fast loop: at most 1000 steps apart
    assert mon._next_log == 1040
    fixed = RunMonitor(None, profile=False, summary=False, log_every_n_steps=4)
    fixed._step = 8
    assert fixed._log_due()
    fixed._step = 9
    assert not fixed._log_due()


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), True, "2"])
def test_log_interval_s_is_checked(value: object) -> None:
    with pytest.raises(ConfigurationError, match="log_interval_s"):
        RunMonitor(None, log_interval_s=value)  # type: ignore[arg-type]
