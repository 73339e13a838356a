"""The machine as it is (issue #37): CPU that other processes took during the run, read from psutil
(system-wide busy time less this process's, steal), is a ``cpu-contention`` finding with its share;
the threads rule leaves the cores the other load keeps busy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from typing import Any

import pytest
import torch

from resource_guard.observe.monitor import RunMonitor
from resource_guard.observe.threads import CpuTimes, node_cpu_use, read_cpu_times
from resource_guard.report.findings import analyze
from resource_guard.report.op_rules import CPU_CONTENTION_SHARE, rule_cpu_contention, rule_threads
from resource_guard.report.types import RunStats

_Times = namedtuple("_Times", "user nice system idle iowait irq softirq steal")
_Proc = namedtuple("_Proc", "user system children_user children_system")


class _Child:
    def __init__(self, cpu_s: float) -> None:
        self.cpu_s = cpu_s

    def cpu_times(self) -> _Proc:
        return _Proc(self.cpu_s, 0.0, 0.0, 0.0)


class _FakePsutil:
    """psutil's readings as a node would give them (the seam of :func:`read_cpu_times`)."""

    def __init__(self, busy: float, steal: float, own: float, children: tuple[float, ...] = ()) -> None:
        self.busy, self.steal, self.own, self.kids = busy, steal, own, children

    def cpu_times(self) -> _Times:
        return _Times(self.busy, 0.0, 0.0, 100.0, 0.0, 0.0, 0.0, self.steal)

    def cpu_count(self) -> int:
        return 4

    def getloadavg(self) -> tuple[float, float, float]:
        return (5.5, 5.0, 4.0)

    def Process(self) -> Any:  # noqa: N802 (psutil's name)
        fake = self

        class _P:
            def cpu_times(self) -> _Proc:
                return _Proc(fake.own, 0.0, 0.0, 0.0)

            def children(self, recursive: bool = False) -> list[Any]:
                return [_Child(s) for s in fake.kids]

        return _P()


def test_the_node_s_readings_give_other_processes_cpu_and_the_share_it_costs() -> None:
    start = read_cpu_times(_FakePsutil(busy=100.0, steal=1.0, own=10.0))
    end = read_cpu_times(_FakePsutil(busy=130.0, steal=3.0, own=20.0, children=(4.0,)))
    assert start is not None and end is not None and end.load_1m == 5.5 and end.node_cores == 4
    end = CpuTimes(start.wall_s + 10.0, end.busy_s, end.steal_s, end.own_s, end.node_cores, end.load_1m)
    use = node_cpu_use(start, end, threads=4, cores=4)
    assert use is not None
    # 30 busy seconds less 14 of this process and its worker = 16 s by others, + 2 s steal, over 10 s
    assert use["other_cpu_s"] == pytest.approx(16.0) and use["other_cores"] == pytest.approx(1.8)
    assert use["contention_share"] == pytest.approx(1 - 4 / 5.8, abs=1e-4)
    alone = node_cpu_use(start, CpuTimes(start.wall_s + 10.0, 114.0, 1.0, 24.0, 4), threads=4, cores=4)
    assert alone is not None and alone["other_cores"] == 0.0 and alone["contention_share"] == 0.0
    # the run's threads and the other load fit the cores together: nothing lost
    fits = node_cpu_use(start, end, threads=2, cores=4)
    assert fits is not None and fits["contention_share"] == 0.0
    # a DDP rank's peers on the node are the run's own CPU, not other work
    later = CpuTimes(start.wall_s + 10.0, 140.0, 1.0, 20.0, 4)
    ranks = node_cpu_use(start, later, threads=4, cores=4, peers=2)
    assert ranks is not None and ranks["other_cores"] == pytest.approx(1.0)
    assert node_cpu_use(start, CpuTimes(start.wall_s + 0.1, 101.0, 1.0, 10.0, 4), threads=1, cores=4) is None
    assert read_cpu_times(object()) is None  # psutil unusable: not read, never raised


def _stats(other: float, share: float, threads: int = 2, cores: int = 2) -> RunStats:
    node = {"other_cores": other, "contention_share": share, "cores": cores, "own_threads": threads,
            "load_1m": 3.0, "steal_share": 0.0}  # fmt: skip
    demand = {"intra_op_threads": threads, "processes": 1, "workers": 0, "cores": cores, "threads": threads,
              "fitting_threads": min(threads, cores), "node": node}  # fmt: skip
    return RunStats(steps=40, step_time_s=0.1, threads=demand)


def test_contention_is_named_first_with_its_share_and_not_below_the_threshold() -> None:
    busy = analyze(_stats(other=1.0, share=1 - 2 / 3))
    first = busy.findings[0]
    assert first.id == "cpu-contention"
    assert first.evidence["cpu_contention_share"] == pytest.approx(0.3333, abs=1e-3)
    assert "1.0 of 2 cores" in first.title and first.predicted_step_s == pytest.approx(0.1 * 2 / 3, rel=1e-3)
    assert "torch.set_num_threads(1)" in first.advice[1]
    assert rule_cpu_contention(_stats(other=0.1, share=CPU_CONTENTION_SHARE / 2)) is None
    assert rule_cpu_contention(_stats(other=0.1, share=0.5)) is None  # a burst, not load
    assert analyze(_stats(other=0.1, share=0.0)).findings[0].id == "healthy"


def test_the_threads_rule_leaves_the_cores_other_processes_keep_busy() -> None:
    f = rule_threads(_stats(other=1.0, share=0.5, threads=8, cores=4))
    assert f is not None and "torch.set_num_threads(3)" in f.advice[0]
    assert "other processes" in f.title and f.evidence["other_cores"] == 1.0


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _other_processes(count: int) -> list[int]:
    """``count`` processes spinning on a core, started through a shell that exits at once: orphans, not
    this process's children (whose CPU the run counts as its own, as it does its DataLoader workers')."""
    spin = f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 &"
    out = subprocess.run(
        ["sh", "-c", "; ".join([f"{spin} echo $!"] * count)], capture_output=True, text=True, check=True
    )
    return [int(line) for line in out.stdout.split()]


def _loop(seconds: float) -> Any:
    monitor = RunMonitor(None, interval_s=0.2, profile=False, summary=False)
    monitor.start()
    a, w = torch.randn(256, 512), torch.randn(512, 512)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        monitor.batch_ready(a)
        for _ in range(8):
            torch.mm(a, w)
        monitor.step_end()
    return monitor.close()


@pytest.mark.slow
def test_a_loop_beside_busy_processes_names_contention_first_and_alone_sees_less() -> None:
    """A real loop (torch at as many threads as cores) beside processes spinning on every core, and
    the same loop alone. The spinners' own CPU (read from them) must be in what the run saw others take.
    Where the host runs other work (a shared CI box), "alone" is not idle: the finding is then present
    exactly when the other load measured reaches the rule's thresholds."""
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    spinners = _other_processes(cores)
    try:
        time.sleep(0.3)
        before = sum(_cpu_s(pid) for pid in spinners)
        beside = _loop(3.0)
        spun = sum(_cpu_s(pid) for pid in spinners) - before
    finally:
        for pid in spinners:
            os.kill(pid, signal.SIGKILL)
    try:
        alone = _loop(3.0)
    finally:
        torch.set_num_threads(threads)
    assert beside is not None and alone is not None
    assert beside.findings[0].id == "cpu-contention", [f.title for f in beside.findings]
    node_b, node_a = beside.stats.threads["node"], alone.stats.threads["node"]
    assert node_b["other_cpu_s"] >= 0.8 * spun  # the spinners' CPU is seen as other processes'
    found = alone.finding("cpu-contention") is not None
    quiet = node_a["contention_share"] < CPU_CONTENTION_SHARE or node_a["other_cores"] < 0.25
    assert found != quiet, node_a


def test_the_training_thread_s_run_queue_wait_is_the_cost_and_only_others_count() -> None:
    """Linux's schedstat: the time the training thread was runnable but waited for a core. Beside two
    spinners on 2 cores a one-thread loop waits a third of the time; its own 16 threads on 2 cores make
    it wait too, but that is the threads finding's cause, not other processes'."""
    start = CpuTimes(0.0, 0.0, 0.0, 0.0, 2, None, 0.0, 0.0, 7)
    beside = CpuTimes(10.0, 20.0, 0.0, 6.7, 2, None, 6.7, 3.3, 7)  # spinners took 13.3 s of the 20
    use = node_cpu_use(start, beside, threads=1, cores=2)
    assert use is not None and use["run_queue_share"] == pytest.approx(0.33)
    assert use["contention_share"] == pytest.approx(0.33) and use["other_cores"] == pytest.approx(1.33)
    own = CpuTimes(10.0, 20.0, 0.0, 20.0, 2, None, 5.0, 5.0, 7)  # 16 threads of its own, nothing else
    mine = node_cpu_use(start, own, threads=16, cores=2)
    assert mine is not None and mine["run_queue_share"] == 0.5 and mine["contention_share"] == 0.0
    t = read_cpu_times()
    assert t is not None and t.thread_id is not None  # the calling thread, read again at the end
