"""How many CPU threads a run asks for, against the cores it may use, and what the excess costs.

:func:`thread_demand` is read when monitoring starts, and the intra-op count again at the end (a
loop that calls ``torch.set_num_threads`` after the monitor started ran at that count): torch's
intra-op threads, the processes of this node (``LOCAL_WORLD_SIZE`` as torchrun and Lightning set
it, else the world size) and the DataLoader workers (each worker runs torch with one thread:
``torch.utils.data`` sets it). When the demand exceeds the cores, :func:`oversubscription_slowdown`
measures, once at the end of the run, how much slower a small parallel workload (matmuls and
elementwise ops, sized like the run's typical op) runs at the run's thread count than at a count
that fits: the ``threads`` finding's measured cost. Nothing here runs when the demand fits.

The machine as it is: :func:`thread_demand` also reads the node's CPU times (:func:`read_cpu_times`,
psutil: system-wide busy time, steal, this process's and its children's CPU), and
:meth:`ThreadDemand.to_dict` at the end of the run what other processes took meanwhile
(:func:`node_cpu_use`): the ``cpu-contention`` finding, and the cores left to the run.

Example:
    >>> d = thread_demand(intra_op=16, processes=1, workers=0, cores=2)
    >>> d.threads, d.fitting_threads, d.oversubscribed
    (16, 2, True)
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ThreadDemand",
    "CpuTimes",
    "thread_demand",
    "local_processes",
    "typical_op_us",
    "oversubscription_slowdown",
    "read_cpu_times",
    "node_cpu_use",
]


@dataclass(frozen=True)
class CpuTimes:
    """The node's CPU seconds at one moment (psutil), for the difference over a run.

    Attributes:
        wall_s: ``time.monotonic()``.
        busy_s: system-wide busy CPU seconds, all cores (user, nice, system, irq, softirq; not idle,
            iowait nor steal).
        steal_s: system-wide steal (a hypervisor running other guests on this VM's cores; 0 elsewhere).
        own_s: this process's CPU seconds with its children's (DataLoader workers, alive or joined).
        node_cores: logical cores of the node (``psutil.cpu_count()``).
        load_1m: the 1-minute load average (``None`` where not available).
        thread_cpu_s / thread_wait_s: the reading thread's (the training loop's) time on a CPU and time
            runnable but waiting for one (Linux ``schedstat``; ``None`` elsewhere).
        thread_id: that thread's native id (the end of the run reads the same thread).
    """

    wall_s: float
    busy_s: float
    steal_s: float
    own_s: float
    node_cores: int
    load_1m: float | None = None
    thread_cpu_s: float | None = None
    thread_wait_s: float | None = None
    thread_id: int | None = None


def _schedstat(tid: int) -> tuple[float, float] | None:
    """A thread's seconds on a CPU and waiting on a run queue (``/proc/self/task/<tid>/schedstat``)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return None


def read_cpu_times(psutil_module: Any = None, thread_id: int | None = None) -> CpuTimes | None:
    """The node's :class:`CpuTimes` now; ``None`` where psutil cannot read them (``psutil_module``: a
    seam for tests). ``thread_id``: whose run-queue times to read (default: the calling thread)."""
    try:
        import psutil

        ps = psutil if psutil_module is None else psutil_module
        t = ps.cpu_times()
        busy = sum(float(getattr(t, k, 0.0) or 0.0) for k in ("user", "nice", "system", "irq", "softirq"))
        proc = ps.Process()
        mine = proc.cpu_times()
        joined = getattr(mine, "children_user", 0.0) + getattr(mine, "children_system", 0.0)
        own = float(mine.user + mine.system + joined)
        for child in proc.children(recursive=True):
            try:
                c = child.cpu_times()
                own += float(c.user + c.system)
            except Exception:  # a worker that exits while it is read
                continue
        try:
            load: float | None = float(ps.getloadavg()[0])
        except (AttributeError, OSError):
            load = None
        steal = float(getattr(t, "steal", 0.0) or 0.0)
        tid = threading.get_native_id() if thread_id is None else thread_id
        sched = _schedstat(tid) if psutil_module is None else getattr(psutil_module, "schedstat", None)
        cpu_s, wait_s = sched if sched is not None else (None, None)
        return CpuTimes(
            time.monotonic(), busy, steal, own, int(ps.cpu_count() or 1), load, cpu_s, wait_s, tid
        )
    except Exception:  # psutil missing a field or access denied: the node is simply not read
        return None


def node_cpu_use(
    start: CpuTimes, end: CpuTimes, *, threads: int, cores: int | None, peers: int = 0
) -> dict[str, Any] | None:
    """What the rest of the node took between ``start`` and ``end`` (pure), against what the run asked
    for: ``threads`` (its own busy threads: intra-op × processes + workers) on ``cores`` (those this
    process may use; the node's when ``None``).

    ``other_cores``: cores' worth of CPU that other processes (and the hypervisor's steal) kept busy on
    average, scaled to the cores this process may use. ``contention_share``, the share of the run's
    step the other processes cost: where Linux gives the training thread's run-queue time
    (``schedstat``: runnable, waiting for a core), that wait over the wall time, the part of it the other
    processes' load caused (``other / (other + this process's other threads' CPU)``); elsewhere a
    fair-share model: when the run's own threads (at most the cores) and the other load ask for more
    than the cores, the run gets ``cores / (own + other)`` of what it asked for. ``peers``: the run's
    other processes on this node (DDP ranks), each taken to use what this one used: theirs is the run's
    CPU, not other work's. ``None`` for a span too short to read (under 0.2 s).

    >>> a = CpuTimes(0.0, 0.0, 0.0, 0.0, 2)
    >>> use = node_cpu_use(a, CpuTimes(10.0, 30.0, 0.0, 20.0, 2), threads=2, cores=2)
    >>> use["other_cores"], round(use["contention_share"], 3)
    (1.0, 0.333)
    """
    wall = end.wall_s - start.wall_s
    if wall < 0.2:
        return None
    node = max(1, end.node_cores)
    usable = min(node, cores) if cores else node
    own_s = end.own_s - start.own_s
    other_s = max(0.0, (end.busy_s - start.busy_s) - own_s * (1 + max(0, peers)))
    steal_s = max(0.0, end.steal_s - start.steal_s)
    other = (other_s + steal_s) / wall * usable / node  # the part of it on the cores the run may use
    own = min(max(1, threads), usable)
    waited = None
    if None not in (start.thread_wait_s, end.thread_wait_s, start.thread_cpu_s, end.thread_cpu_s):
        waited = max(0.0, (end.thread_wait_s or 0.0) - (start.thread_wait_s or 0.0)) / wall
        main = max(0.0, (end.thread_cpu_s or 0.0) - (start.thread_cpu_s or 0.0)) / wall
        siblings = max(0.0, own_s / wall - main)  # this process's other threads, competing too
        contention = waited * other / (other + siblings) if other + siblings > 0 else 0.0
    elif own + other > usable:
        contention = max(0.0, 1.0 - usable / (own + other))
    else:
        contention = 0.0
    return {
        "wall_s": round(wall, 3),
        "other_cpu_s": round(other_s, 3),
        "steal_share": round(steal_s / (wall * node), 4),
        "other_cores": round(other, 3),
        "own_threads": own,
        "cores": usable,
        "node_cores": node,
        "load_1m": end.load_1m,
        "run_queue_share": None if waited is None else round(waited, 4),
        "contention_share": round(min(1.0, contention), 4),
    }


_PROBE_REPEATS = 3
_PROBE_ROUNDS = 2  # at least
_PROBE_MAX_ROUNDS = 8
_PROBE_BUDGET_S = 0.5  # more rounds while within it


@dataclass(frozen=True)
class ThreadDemand:
    """Threads a run keeps busy on this node vs the cores available to it.

    Attributes:
        intra_op: ``torch.get_num_threads()`` of this process.
        processes: training processes on this node.
        workers: DataLoader worker processes per training process (one thread each).
        cores: cores available to this process (affinity), ``None`` when unknown.
    """

    intra_op: int
    processes: int
    workers: int
    cores: int | None
    cpu_start: CpuTimes | None = field(default=None, compare=False, repr=False)

    @property
    def threads(self) -> int:
        """Threads that compete for the cores: (intra-op + workers) × processes."""
        return (self.intra_op + self.workers) * self.processes

    @property
    def fitting_threads(self) -> int:
        """The intra-op thread count per process that fits: the cores shared by the processes, less
        the workers (at least 1)."""
        if self.cores is None:
            return self.intra_op
        return max(1, self.cores // self.processes - self.workers)

    @property
    def oversubscribed(self) -> bool:
        return self.cores is not None and self.threads > self.cores

    def to_dict(self) -> dict[str, Any]:
        """The figures; with ``cpu_start``, ``"node"``: the node's CPU since then, read now
        (:func:`node_cpu_use`), which the end of the run calls this for."""
        out: dict[str, Any] = {
            "intra_op_threads": self.intra_op,
            "processes": self.processes,
            "workers": self.workers,
            "cores": self.cores,
            "threads": self.threads,
            "fitting_threads": self.fitting_threads,
        }
        end = read_cpu_times(thread_id=self.cpu_start.thread_id) if self.cpu_start is not None else None
        if self.cpu_start is not None and end is not None:
            # this process's own busy threads: its intra-op threads (workers are its children: own CPU)
            threads, peers = self.intra_op * self.processes, self.processes - 1
            out["node"] = node_cpu_use(self.cpu_start, end, threads=threads, cores=self.cores, peers=peers)
        return out


def local_processes(world_size: int) -> int:
    """Training processes on this node: ``LOCAL_WORLD_SIZE`` when set (torchrun, Lightning), else
    ``world_size`` (one node)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else max(1, world_size)


def thread_demand(
    *, intra_op: int, processes: int, workers: int, cores: int | None, read_node: bool = True
) -> ThreadDemand:
    """The run's :class:`ThreadDemand`, with the node's CPU times now (``read_node``) for the
    difference at the end of the run."""
    start = read_cpu_times() if read_node else None
    return ThreadDemand(max(1, intra_op), max(1, processes), max(0, workers), cores, start)


# The probe's matmul widths: (64, n) @ (n, n) and the elementwise ops on its result. What
# oversubscription costs depends on how long each parallel region lasts (the spin-waits and context
# switches are paid per region): a 192-wide matmul is slowed several times at 16 threads on 2 cores
# where a 1024-wide one, a training step's usual op, is slowed by a third. The width is chosen so
# that one matmul lasts about as long as the run's typical op (:func:`typical_op_us`).
_WIDTHS = (128, 256, 512, 1024, 2048)
_DEFAULT_WIDTH = 512


def typical_op_us(top_ops: Sequence[tuple[str, int, float]]) -> float | None:
    """The duration of the op that carries the typical microsecond of a step: the mean duration of
    the profiled ops weighted by their time (``top_ops``: ``(op, calls, us)`` per step)."""
    rows = [(calls, us) for _, calls, us in top_ops if calls > 0 and us > 0]
    total = sum(us for _, us in rows)
    return sum(us * us / calls for calls, us in rows) / total if total > 0 else None


def _workload(width: int, host_loops: int = 0) -> None:
    """Four matmuls with their elementwise ops, each followed by ``host_loops`` iterations of Python
    (the run's own host work between ops: the loop, hooks, the optimizer's Python)."""
    a = torch.full((64, width), 1e-2)
    w = torch.full((width, width), 1e-3)
    for _ in range(4):
        a = torch.mm(a, w).mul_(0.5).add_(1e-2)
        _host_work(host_loops)


def _host_work(loops: int) -> int:
    total = 0
    for i in range(loops):
        total += i & 7
    return total


def _host_loops(host_us: float) -> int:
    """Iterations of :func:`_host_work` that take about ``host_us`` on this thread (best of three)."""
    if host_us <= 0:
        return 0
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        _host_work(1000)
        best = min(best, time.perf_counter() - t)
    return max(0, round(host_us / (best * 1e6) * 1000))


def _width(op_us: float | None, threads: int) -> int:
    """The width whose matmul at ``threads`` lasts closest to ``op_us`` (log scale)."""
    if not op_us or op_us <= 0:
        return _DEFAULT_WIDTH
    torch.set_num_threads(threads)
    best, best_gap = _DEFAULT_WIDTH, float("inf")
    for width in _WIDTHS:
        us = _matmul_us(width)
        gap = abs(math.log(max(us, 1e-3) / op_us))
        if gap < best_gap:
            best, best_gap = width, gap
        if us > op_us:
            break
    return best


def _matmul_us(width: int) -> float:
    """One probe matmul's time, the best of two after a warm-up."""
    a, w = torch.ones(64, width), torch.ones(width, width)
    torch.mm(a, w)
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        torch.mm(a, w)
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def _best(threads: int, width: int = _DEFAULT_WIDTH, host_loops: int = 0) -> float:
    torch.set_num_threads(threads)
    for _ in range(2):  # the first runs after a change of thread count pay for the pool's resize
        _workload(width, host_loops)
    best = float("inf")
    for _ in range(_PROBE_REPEATS):
        t = time.perf_counter()
        _workload(width, host_loops)
        best = min(best, time.perf_counter() - t)
    return best


def oversubscription_slowdown(
    demand: ThreadDemand, op_us: float | None = None, ops_share: float | None = None
) -> float | None:
    """How many times slower the probe workload runs at ``demand.intra_op`` threads than at
    ``demand.fitting_threads`` (``None`` when they are equal): the best of a few rounds of each.
    ``op_us``: the run's typical op duration (:func:`typical_op_us`), which sizes the probe's ops
    (unknown: 512-wide matmuls). ``ops_share``: the share of the run's step in ops; the probe then
    runs Python between its ops in the same proportion, so that the slowdown is the step's (the idle
    OpenMP threads spin after each parallel region and take the cores from the Python that follows:
    a Lightning step, with more Python between ops, is slowed about as much as its ops). Restores the
    thread count; a fraction of a second, run once at the end of an oversubscribed run."""
    fit = demand.fitting_threads
    if fit >= demand.intra_op:
        return None
    before = torch.get_num_threads()
    slow = fast = float("inf")
    deadline = time.perf_counter() + _PROBE_BUDGET_S
    try:
        width = _width(op_us, fit)
        loops = 0
        if ops_share is not None and 0.0 < ops_share < 1.0:
            op_us = _best(fit, width) / 4 * 1e6  # one op of the workload (a matmul and two elementwise)
            loops = _host_loops(op_us * (1.0 - ops_share) / ops_share)
        # rounds of both counts until the budget is spent, the best of each: on a shared machine a
        # round of the fitting count can lose its cores to other processes for a while
        for i in range(_PROBE_MAX_ROUNDS):
            fast = min(fast, _best(fit, width, loops))
            slow = min(slow, _best(demand.intra_op, width, loops))
            if i + 1 >= _PROBE_ROUNDS and time.perf_counter() > deadline:
                break
    finally:
        torch.set_num_threads(before)
    return slow / fast if fast > 0 else None
