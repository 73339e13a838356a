"""The monitor's defaults stay off the compute threads' cores, and its report states what watching cost
(issue #42). Whole-run timings are in ``benchmarks/monitor_overhead.py``; nothing here is timed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from resource_guard.observe import monitor
from resource_guard.observe.monitor import RunMonitor
from resource_guard.observe.profiling import ProfileWindow
from resource_guard.observe.sampler import Sampler


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "resource-guard-sampler"]


def test_a_threadless_sampler_reads_when_asked_at_most_once_per_interval() -> None:
    s = Sampler(interval_s=3600.0, threaded=False)
    s.start()
    assert not _sampler_threads()
    assert s.drain() == {}  # the priming reading (psutil's CPU% over no time) is not kept
    assert not s.maybe_sample()  # within the interval: nothing
    assert s.maybe_sample(force=True)  # the end of the run reads all the same
    gauges = s.drain()
    assert {"host/process_cpu_percent", "host/process_rss_bytes"} <= set(gauges)
    assert s.busy_s > 0
    quick = Sampler(interval_s=1e-6, threaded=False)
    quick.start()
    time.sleep(0.001)
    assert quick.maybe_sample() and "host/available_ram_bytes" in quick.drain()
    threaded = Sampler(interval_s=3600.0)
    assert not threaded.maybe_sample(force=True)  # its thread reads, never the caller
    s.stop()
    quick.stop()


def test_a_cpu_run_has_no_sampler_thread_and_still_reports_host_gauges() -> None:
    mon = RunMonitor(None, interval_s=0.001, log_every_n_steps=3, profile=False, summary=False)
    mon.start()
    for _ in range(9):
        mon.batch_ready(torch.zeros(4, 2))
        time.sleep(0.002)
        mon.step_end()
        assert not _sampler_threads()
    report = mon.close()
    assert report is not None
    assert report.stats.process_cpu_percent is not None  # read at the log boundaries, on this thread
    assert report.stats.peak_memory_bytes is not None


class _Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        self.now += 1e-4  # every reading of the clock takes 0.1 ms: the monitor's own work has a cost
        return self.now


def test_the_report_states_the_cost_of_watching(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(monitor, "_clock", clock)
    window = ProfileWindow(skip_first=2, wait=1, warmup=1, active=1, with_stack=False, record_shapes=False)
    mon = RunMonitor(None, interval_s=0.01, log_every_n_steps=4, profile=window, summary=False)
    mon.start()
    for _ in range(16):
        clock.now += 0.001
        mon.batch_ready(torch.zeros(4, 2))
        clock.now += 0.009
        mon.step_end()
    report = mon.close()
    assert report is not None
    note = next(n for n in report.stats.notes if n.startswith("monitoring cost"))
    assert "% of its" in note and "log boundaries" in note and "host readings" in note
    assert "profiler window (once per run)" in note
    assert 0 < mon._profiler_s < mon._own_s  # the window's steps are part of the monitor's own work
    assert mon._own_s > 0  # the boundaries' and the profiler's steps' own clock readings
    loop_s = report.stats.duration_s
    assert loop_s is not None and mon._own_s < loop_s
