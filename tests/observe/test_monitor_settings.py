"""The monitor's reading of threads and torch.compile figures (at start and at close) into RunStats,
and the findings they lead to in a real run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resource_guard.observe import threads
from resource_guard.observe.monitor import RunMonitor


def _run(mon: RunMonitor, step: object, n: int = 6) -> None:
    mon.start()
    for i in range(n):
        x = torch.randn(4 + i, 8)  # a new length every step
        mon.batch_ready(x)
        step(x)  # type: ignore[operator]
        mon.step_end()


def test_oversubscribed_threads_are_measured_at_close_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        threads, "_best", lambda n, w=0, k=0: 0.001 if n <= 2 else 0.003
    )  # a machine's answer
    monkeypatch.setattr("resource_guard.observe.monitor.available_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        mon = RunMonitor(tmp_path, profile=False, summary=False, loader_info={"num_workers": 0})
        _run(mon, lambda x: x.sum())
        report = mon.close()
        assert torch.get_num_threads() == 8  # the probe put the run's count back
    finally:
        torch.set_num_threads(before)
    assert report is not None
    t = report.stats.threads
    assert (
        t is not None
        and t["intra_op_threads"] == 8
        and t["cores"] == 2
        and t["slowdown"] == pytest.approx(3.0)
    )
    f = report.finding("threads")
    assert f is not None and f.severity == "warning" and "torch.set_num_threads(2)" in f.advice[0]


def test_a_loop_that_raises_the_thread_count_after_start_is_seen_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zoo's threads case and real scripts: torch.set_num_threads(16) inside the loop, after the
    monitor read the demand (1 thread) at start."""
    monkeypatch.setattr(threads, "_best", lambda n, w=0, k=0: 0.001 if n <= 2 else 0.002)
    monkeypatch.setattr("resource_guard.observe.monitor.available_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mon = RunMonitor(tmp_path, profile=False, summary=False, loader_info={"num_workers": 0})
        _run(mon, lambda x: (torch.set_num_threads(16), x.sum()))
        report = mon.close()
    finally:
        torch.set_num_threads(before)
    assert report is not None and report.stats.threads is not None
    assert report.stats.threads["intra_op_threads"] == 16 and report.stats.threads["slowdown"] == 2.0
    f = report.finding("threads")
    assert f is not None and f.severity == "warning" and f.evidence["threads_share"] == pytest.approx(0.5)


def test_fitting_threads_take_no_probe_and_no_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(n: int, width: int = 0) -> float:
        raise AssertionError("the probe runs only when the threads exceed the cores")

    monkeypatch.setattr(threads, "_best", never)
    monkeypatch.setattr("resource_guard.observe.monitor.available_cores", lambda: 64)
    mon = RunMonitor(None, profile=False, summary=False)
    _run(mon, lambda x: x.sum())
    report = mon.close()
    assert (
        report is not None and report.stats.threads is not None and report.stats.threads["slowdown"] is None
    )
    assert report.finding("threads") is None and report.stats.compile is None


def test_recompiles_during_the_run_are_read_from_dynamo(tmp_path: Path) -> None:
    torch._dynamo.reset()

    @torch.compile(backend="eager", dynamic=False)
    def step(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum()

    mon = RunMonitor(None, profile=False, summary=False)
    _run(mon, step, n=4)
    report = mon.close()
    assert report is not None and report.stats.compile is not None
    assert report.stats.compile["recompiles"] >= 2  # a new length each step, shapes static
    f = report.finding("recompiles")
    assert f is not None and "size mismatch" in " ".join(f.advice)


def test_memory_is_not_sampled_while_the_profiler_records(tmp_path: Path) -> None:
    """The profiler's event buffers grow host memory step by step: no memory-growth evidence there."""
    from resource_guard.observe.profiling import ProfileWindow

    sampled: list[bool] = []
    mon = RunMonitor(tmp_path, summary=False, profile=ProfileWindow(skip_first=0, wait=0, warmup=1, active=3))
    original = mon._sample_memory

    def sample(memory: object) -> None:
        assert mon._profiler is not None
        sampled.append(mon._profiler.running)
        original(memory)  # type: ignore[arg-type]

    mon._sample_memory = sample  # type: ignore[method-assign]
    _run(mon, lambda x: x.sum(), n=12)
    mon.close()
    assert sampled and not any(sampled)
