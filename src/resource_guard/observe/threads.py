"""How many CPU threads a run asks for, against the cores it may use, and what the excess costs.

:func:`thread_demand` is read when monitoring starts, and the intra-op count again at the end (a
loop that calls ``torch.set_num_threads`` after the monitor started ran at that count): torch's
intra-op threads, the processes of this node (``LOCAL_WORLD_SIZE`` as torchrun and Lightning set
it, else the world size) and the DataLoader workers (each worker runs torch with one thread:
``torch.utils.data`` sets it). When the demand exceeds the cores, :func:`oversubscription_slowdown`
measures, once at the end of the run, how much slower a small parallel workload (matmuls and
elementwise ops, sized like the run's typical op) runs at the run's thread count than at a count
that fits: the ``threads`` finding's measured cost. Nothing here runs when the demand fits.

Example:
    >>> d = thread_demand(intra_op=16, processes=1, workers=0, cores=2)
    >>> d.threads, d.fitting_threads, d.oversubscribed
    (16, 2, True)
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ThreadDemand", "thread_demand", "local_processes", "typical_op_us", "oversubscription_slowdown"]

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

    def to_dict(self) -> dict[str, int | None]:
        return {
            "intra_op_threads": self.intra_op,
            "processes": self.processes,
            "workers": self.workers,
            "cores": self.cores,
            "threads": self.threads,
            "fitting_threads": self.fitting_threads,
        }


def local_processes(world_size: int) -> int:
    """Training processes on this node: ``LOCAL_WORLD_SIZE`` when set (torchrun, Lightning), else
    ``world_size`` (one node)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else max(1, world_size)


def thread_demand(*, intra_op: int, processes: int, workers: int, cores: int | None) -> ThreadDemand:
    """The run's :class:`ThreadDemand` (pure)."""
    return ThreadDemand(max(1, intra_op), max(1, processes), max(0, workers), cores)


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
