"""Tests for resource_guard.observe.threads: the thread demand against the cores, and the probe that
measures an oversubscription's cost (and restores the thread count)."""

from __future__ import annotations

import doctest

import pytest
import torch

from resource_guard.observe import threads
from resource_guard.observe.threads import local_processes, oversubscription_slowdown, thread_demand


def test_docstring_examples_run() -> None:
    assert doctest.testmod(threads).failed == 0


def test_demand_counts_threads_and_workers_of_every_local_process() -> None:
    d = thread_demand(intra_op=4, processes=2, workers=3, cores=8)
    assert d.threads == 14 and d.oversubscribed and d.fitting_threads == 1
    assert not thread_demand(intra_op=4, processes=2, workers=0, cores=8).oversubscribed
    unknown = thread_demand(intra_op=64, processes=1, workers=0, cores=None)
    assert not unknown.oversubscribed and unknown.fitting_threads == 64


def test_local_processes_reads_torchrun_s_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_processes(4) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_processes(16) == 2


def test_the_probe_compares_the_run_s_count_with_the_fitting_one_and_restores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []

    def best(
        n: int, width: int = 0, loops: int = 0
    ) -> float:  # the workload's time at n threads, as 2 free cores give it
        seen.append(n)
        torch.set_num_threads(n)
        return {2: 0.001, 16: 0.004}[n]

    monkeypatch.setattr(threads, "_best", best)
    before = torch.get_num_threads()
    slowdown = oversubscription_slowdown(thread_demand(intra_op=16, processes=1, workers=0, cores=2))
    assert slowdown == pytest.approx(4.0)
    assert set(seen) == {2, 16} and seen[0] == 2  # the fitting count first (see the function)
    assert torch.get_num_threads() == before
    assert oversubscription_slowdown(thread_demand(intra_op=2, processes=1, workers=0, cores=2)) is None


def test_the_probe_runs_the_real_workload_and_restores_the_thread_count() -> None:
    """The measured ratio depends on the machine's load (on a busy shared host more threads can even
    win a larger share of the cores), so only its form is checked here; benchmarks measure it."""
    before = torch.get_num_threads()
    slowdown = oversubscription_slowdown(thread_demand(intra_op=4, processes=1, workers=0, cores=1))
    assert slowdown is not None and slowdown > 0
    assert torch.get_num_threads() == before


def test_the_typical_op_is_weighted_by_time() -> None:
    # 1000 us in 10 ops of 100 us, 10 us in 100 ops of 0.1 us: the step's time is in the 100 us ops
    assert threads.typical_op_us([("aten::mm", 10, 1000.0), ("aten::add", 100, 10.0)]) == pytest.approx(
        (1000 * 100 + 10 * 0.1) / 1010
    )
    assert threads.typical_op_us([]) is None and threads.typical_op_us([("aten::mm", 0, 5.0)]) is None


def test_the_probe_s_ops_last_about_as_long_as_the_run_s(monkeypatch: pytest.MonkeyPatch) -> None:
    widths: list[int] = []
    monkeypatch.setattr(threads, "_best", lambda n, w, k=0: widths.append(w) or (0.001 if n <= 2 else 0.002))
    monkeypatch.setattr(threads, "_matmul_us", lambda w: w / 10.0)  # 12.8 us at 128 wide ... 204.8 at 2048
    before = torch.get_num_threads()
    demand = thread_demand(intra_op=16, processes=1, workers=0, cores=2)
    assert oversubscription_slowdown(demand, op_us=1e-3) == pytest.approx(2.0)  # tiny ops: the narrowest
    assert set(widths) == {threads._WIDTHS[0]}
    widths.clear()
    oversubscription_slowdown(demand, op_us=1e9)  # ops longer than any probe: the widest
    assert set(widths) == {threads._WIDTHS[-1]}
    widths.clear()
    oversubscription_slowdown(demand, op_us=60.0)  # closest (log scale): 51.2 us at 512 wide
    assert set(widths) == {512}
    widths.clear()
    oversubscription_slowdown(demand)  # unknown: the default
    assert set(widths) == {threads._DEFAULT_WIDTH}
    assert torch.get_num_threads() == before


def test_the_probe_runs_python_between_its_ops_in_the_step_s_proportion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that is 80% ops has a quarter of an op's time in Python after each op: the probe does the
    same, so that its slowdown is the step's (spinning OpenMP threads slow the Python between ops too)."""
    calls: list[tuple[int, int, int]] = []

    def best(n: int, width: int = 0, loops: int = 0) -> float:
        calls.append((n, width, loops))
        return 0.004  # four ops of 1 ms: 1000 us per op

    monkeypatch.setattr(threads, "_best", best)
    monkeypatch.setattr(threads, "_host_loops", lambda us: round(us))  # one loop per microsecond
    demand = thread_demand(intra_op=16, processes=1, workers=0, cores=2)
    oversubscription_slowdown(demand, ops_share=0.8)
    timed = [c for c in calls if c[2]]
    assert timed and {c[2] for c in timed} == {250} and {c[0] for c in timed} == {2, 16}
    calls.clear()
    oversubscription_slowdown(demand)  # no profiled step: ops alone
    assert {c[2] for c in calls} == {0}


def test_the_host_work_is_calibrated_on_this_thread(monkeypatch) -> None:
    """The loop count comes from timing 1000 iterations on this thread (the best of three readings)."""
    readings = iter([0.0, 0.004, 1.0, 1.001, 2.0, 2.002])  # 1000 iterations: 4 ms, 1 ms, 2 ms
    monkeypatch.setattr(threads.time, "perf_counter", lambda: next(readings))
    assert threads._host_loops(2000.0) == 2000  # the fastest reading: 1 us per iteration
    assert threads._host_loops(0.0) == 0 and threads._host_work(16) == 2 * sum(range(8))
