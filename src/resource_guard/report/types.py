"""The typed input and output of the report's rules: :class:`RunStats` (what the monitor measured
over a run, with the profiler window's :class:`ProfileSummary`) and :class:`Finding` (one
conclusion), with the stable ids and severities.

Re-exported from :mod:`resource_guard.report.findings`, where they are documented for users.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SEVERITIES",
    "FINDING_IDS",
    "PHASES",
    "Finding",
    "ProfileSummary",
    "RunStats",
    "available_cores",
    "plan_mib",
]

SEVERITIES = ("info", "warning", "critical")
FINDING_IDS = (
    "oom",
    "input-bound",
    "launch-bound",
    "memory-pressure",
    "precision",
    "host-to-device",
    "alignment",
    "estimate-drift",
    "memory-growth",
    "fragmentation",
    "shapes",
    # where the time goes (issue 29): each states its measured share of the step (an evidence key
    # ending in ``share``) and the step time predicted without its cause (``Finding.predicted_step_s``)
    "optimizer-step",
    "host-loop",
    "evaluation",
    "checkpoint-io",
    "logging",
    "casts",
    "host-sync",
    "stall",
    "cpu-contention",
    "threads",
    "recompiles",
    "comm-bound",
    "straggler",  # one rank is slower than the others, who wait for it (report/straggler.py)
    "healthy",
)
# The phases a training step's wall time is split into (``RunStats.phases``: mean seconds per step),
# timed at the front doors' own boundaries; they add up to the step's wall time, ``other`` being what
# remains. ``communication`` is exposed (not hidden by compute) communication, from the profiler window.
PHASES = (
    "data_wait",
    "forward",
    "backward",
    "optimizer",
    "host",
    "evaluation",
    "checkpoint",
    "logging",
    "communication",
    "other",
)


@dataclass(frozen=True)
class ProfileSummary:
    """What the profiler window saw.

    Attributes:
        steps: steps recorded.
        step_wall_us: median wall time of a recorded step (``ProfilerStep#`` spans), microseconds.
        device_busy_us: device time (kernels, copies, memsets) per step; 0 on CPU-only runs.
        kernel_count: device kernels per step.
        median_kernel_us: median kernel duration (``None`` without kernels).
        h2d_us / h2d_pageable_us: host-to-device copy time per step (pageable: from unpinned memory).
        matmul_us / fp32_matmul_us: time per step in matmul ops, and in those with float32 inputs.
        misaligned_matmuls: ``(op, shapes)`` of matmuls with a matrix dimension not a multiple of 8.
        misaligned_matmul_us: time per step in those matmuls.
        top_ops: ``(op, calls, self_cpu_us)`` of the most expensive host-side ops, per step.
        op_timeline: where :attr:`op_class_us` was read: ``"device"`` (kernel time) or ``"host"`` (ops'
            self CPU time); ``None`` for a summary without classes.
        op_class_us: ``(class, us per step)`` for every class of
            :data:`resource_guard.observe.opclasses.OP_CLASSES` (matmul, attention, elementwise, casts,
            optimizer, communication, sync, other).
        syncs_per_step: host-device syncs per step (on a CPU run: scalar reads, which wait for nothing).
        sync_idle_us: device idle time per step in the gaps the syncs opened.
        sync_sites / cast_sites: ``(file:line, calls per step, us per step)`` of the user's lines that
            led to syncs and to casts/copies (``with_stack``), most expensive first.
        comm_us / exposed_comm_us: communication kernel time per step, and its part not overlapped by
            compute (the ``communication`` phase).
        op_class_spread_us: ``(class, us)``: half the range of each class's per-step time over the
            window's steps (``op_class_us`` holds their medians): the spread a share is stated with.
        stalls: ``(op, us, call site)`` of single op calls far slower than the other calls of their kind
            (a stall of the machine, not of the op): counted at their kind's usual time in the classes.
        trace_path: the gzipped Chrome trace, or ``None`` (not written, or too large).
        notes: what went differently (trace deleted, window cut short).
    """

    steps: int
    step_wall_us: float | None = None
    device_busy_us: float = 0.0
    kernel_count: float = 0.0
    median_kernel_us: float | None = None
    h2d_us: float = 0.0
    h2d_pageable_us: float = 0.0
    matmul_us: float = 0.0
    fp32_matmul_us: float = 0.0
    misaligned_matmuls: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()
    misaligned_matmul_us: float = 0.0
    top_ops: tuple[tuple[str, int, float], ...] = ()
    trace_path: str | None = None
    notes: tuple[str, ...] = field(default=())
    op_timeline: str | None = None
    op_class_us: tuple[tuple[str, float], ...] = ()
    syncs_per_step: float = 0.0
    sync_idle_us: float = 0.0
    sync_sites: tuple[tuple[str, float, float], ...] = ()
    cast_sites: tuple[tuple[str, float, float], ...] = ()
    comm_us: float = 0.0
    exposed_comm_us: float = 0.0
    op_class_spread_us: tuple[tuple[str, float], ...] = ()
    stalls: tuple[tuple[str, float, str | None], ...] = ()

    def class_share(self, name: str, step_s: float | None = None) -> float | None:
        """The share of the step in op class ``name`` (``None``: not measured): of ``step_s``, the run's
        step measured without the profiler, when given, else of the recorded step's wall time.

        The profiler's own work (recording shapes and stacks) lands between the ops and lengthens the
        recorded steps by a quarter or more on a CPU, while the ops' own times stay close to what they
        take untraced: the ops' time over the untraced step is their share of the step a user runs.
        """
        return self._share(dict(self.op_class_us).get(name, 0.0), step_s)

    def class_spread(self, name: str, step_s: float | None = None) -> float | None:
        """The spread of :meth:`class_share` over the window's steps (half the range of the per-step
        shares, same divisor); ``None`` where not measured."""
        if not self.op_class_spread_us:
            return None
        return self._share(dict(self.op_class_spread_us).get(name, 0.0), step_s)

    def ops_share(self) -> float | None:
        """The share of the recorded step that its ops take, all classes together: the rest is Python
        between them. Host timelines only (a device timeline's kernels overlap the host); ``None``
        where not measured."""
        if self.op_timeline != "host":
            return None
        return self._share(sum(us for _, us in self.op_class_us))

    def _share(self, us: float, step_s: float | None = None) -> float | None:
        if not self.step_wall_us or not self.op_class_us:
            return None
        step_us = step_s * 1e6 if step_s else self.step_wall_us
        return min(1.0, us / step_us)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "step_wall_us": self.step_wall_us,
            "device_busy_us": self.device_busy_us,
            "kernel_count": self.kernel_count,
            "median_kernel_us": self.median_kernel_us,
            "h2d_us": self.h2d_us,
            "h2d_pageable_us": self.h2d_pageable_us,
            "matmul_us": self.matmul_us,
            "fp32_matmul_us": self.fp32_matmul_us,
            "misaligned_matmuls": [[op, [list(s) for s in shapes]] for op, shapes in self.misaligned_matmuls],
            "misaligned_matmul_us": self.misaligned_matmul_us,
            "top_ops": [list(row) for row in self.top_ops],
            "trace_path": self.trace_path,
            "notes": list(self.notes),
            "op_timeline": self.op_timeline,
            "op_class_us": [list(row) for row in self.op_class_us],
            "syncs_per_step": self.syncs_per_step,
            "sync_idle_us": self.sync_idle_us,
            "sync_sites": [list(row) for row in self.sync_sites],
            "cast_sites": [list(row) for row in self.cast_sites],
            "comm_us": self.comm_us,
            "exposed_comm_us": self.exposed_comm_us,
            "op_class_spread_us": [list(row) for row in self.op_class_spread_us],
            "stalls": [list(row) for row in self.stalls],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileSummary:
        values = dict(data)
        values["misaligned_matmuls"] = tuple(
            (op, tuple(tuple(s) for s in shapes)) for op, shapes in values.get("misaligned_matmuls", ())
        )
        for key in ("top_ops", "op_class_us", "sync_sites", "cast_sites", "op_class_spread_us", "stalls"):
            values[key] = tuple(tuple(row) for row in values.get(key, ()))
        values["notes"] = tuple(values.get("notes", ()))
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass(frozen=True)
class Finding:
    """One conclusion of the report.

    Attributes:
        id: stable id (one of :data:`FINDING_IDS`).
        severity: ``"info"``, ``"warning"`` or ``"critical"``.
        title: one line for people.
        evidence: the numbers behind it (JSON-ready).
        advice: what to change, most effective first.
        predicted_step_s: the step time (seconds) predicted once the advice removes the cause; ``None``
            for findings that are not about time.
    """

    id: str
    severity: str
    title: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    advice: tuple[str, ...] = ()
    predicted_step_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "severity": self.severity,
            "title": self.title,
            "evidence": dict(self.evidence),
            "advice": list(self.advice),
            "predicted_step_s": self.predicted_step_s,
        }


@dataclass(frozen=True)
class RunStats:
    """What the monitor measured over a run: the input of the rules. Unknown is ``None``.

    Times are means per step over the run, leaving out the first step (data-loader start, lazy inits).
    ``peak_memory_source`` is ``"cuda_allocated"`` (``torch.cuda.max_memory_allocated``) or ``"rss"``
    (the process's peak resident set size, which includes the interpreter and libraries).
    ``memory_growth`` is the trend of allocated memory at step ends at equal batch shapes
    (:meth:`resource_guard.observe.growth.MemoryTrend.to_dict`). The CUDA allocator's figures, read at
    log boundaries: ``alloc_retries`` (``num_alloc_retries``: cudaMalloc calls that failed and were
    retried after the cache was freed), ``reserved_bytes`` (the highest reserved) and
    ``reserved_gap_bytes`` (reserved minus allocated at that reading); ``expandable_segments`` whether
    ``PYTORCH_CUDA_ALLOC_CONF`` turned them on.

    The step's memory, one story with the plan's (``guard.json``'s ``plan``, the plan's text, the memory
    picture): ``capacity_bytes`` is the capacity the plan fitted the step into (a ``memory_limit``, or
    the device's; without a plan, the device's memory or the host's RAM), ``usable_bytes`` its usable
    part (capacity less the headroom) and ``predicted_peak_bytes`` the plan's predicted peak as the
    device counts it (both ``None`` without a plan); ``estimated_peak_bytes`` the estimated allocated
    peak (what ``torch.cuda.max_memory_allocated`` would read: the plan's on a planned run).
    ``ram_bytes`` is the host's RAM where the measured peak is the process's RSS (on the CPU): that
    peak's yardstick (:attr:`measured_capacity_bytes`), never the plan's capacity on tensor bytes.
    """

    steps: int = 0
    duration_s: float | None = None
    step_time_s: float | None = None
    data_wait_s: float | None = None
    data_wait_share: float | None = None
    max_interval_data_wait_share: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    flops_per_step: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    peak_memory_source: str | None = None
    capacity_bytes: int | None = None
    estimated_peak_bytes: int | None = None
    usable_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    ram_bytes: int | None = None
    gpu_util_percent: float | None = None
    process_cpu_percent: float | None = None
    device: str = "cpu"
    device_kind: str = "cpu"
    device_name: str | None = None
    precision: str | None = None
    float32_matmul_precision: str = "highest"
    tensor_cores: bool = False
    bf16_supported: bool = False
    tf32_supported: bool = False
    loader_info: Mapping[str, Any] = field(default_factory=dict)
    available_cores: int | None = None
    cpu_count: int | None = None
    world_size: int = 1
    stall_threshold: float = 0.05
    profile: ProfileSummary | None = None
    notes: tuple[str, ...] = ()
    oom: Mapping[str, Any] | None = None
    memory_growth: Mapping[str, Any] | None = None
    alloc_retries: int | None = None
    reserved_bytes: int | None = None
    reserved_gap_bytes: int | None = None
    expandable_segments: bool | None = None
    shapes: Mapping[str, Any] | None = None  # the front doors' shape guard: shapes seen, splits, stops
    phases: Mapping[str, float] | None = None  # mean seconds per step by phase (keys from PHASES)
    # the optimizers' facts for the optimizer-step rule (observe/optimizer_facts.py): name, tensors,
    # foreach, fused, for_loop (the implementation that runs), fused_available
    optimizers: tuple[Mapping[str, Any], ...] = ()
    # CPU threads (read at monitor start; observe/threads.py): intra-op threads, processes on this node,
    # DataLoader workers, cores, and the measured slowdown at that thread count when oversubscribed
    threads: Mapping[str, Any] | None = None
    compile: Mapping[str, Any] | None = None  # torch.compile during the run (observe/dynamo.py)
    # the plan's table (report/plan_advice.py: config, precision, micro_batch_size, checkpointing,
    # predicted_peak_bytes, fits, chosen): a finding recommends only a configuration evaluated there
    plan_rows: tuple[Mapping[str, Any], ...] = ()
    # the machine as it is: CPU taken by other processes during the run (observe/threads.py: node_cpu)
    node_cpu: Mapping[str, Any] | None = None
    # the monitor's close up to this report (seconds), and its parts that took 10 ms or more
    close_s: float | None = None
    close_parts: Mapping[str, float] | None = None
    # under torch.distributed, every rank's own figures gathered at close (one collective):
    # ``{"rank", "steps", "step_time_s", "data_wait_s", "phases"}``, for the straggler rule
    ranks: tuple[Mapping[str, Any], ...] = ()

    @property
    def measured_capacity_bytes(self) -> int | None:
        """What the measured peak is held against: the host's RAM where it is the process's RSS, else
        the capacity."""
        if self.peak_memory_source == "rss" and self.ram_bytes:
            return self.ram_bytes
        return self.capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["loader_info"] = dict(self.loader_info)
        out["profile"] = None if self.profile is None else self.profile.to_dict()
        out["notes"] = list(self.notes)
        out["oom"] = None if self.oom is None else dict(self.oom)
        out["memory_growth"] = None if self.memory_growth is None else dict(self.memory_growth)
        out["shapes"] = None if self.shapes is None else dict(self.shapes)
        out["phases"] = None if self.phases is None else dict(self.phases)
        out["optimizers"] = [dict(o) for o in self.optimizers]
        out["plan_rows"] = [dict(r) for r in self.plan_rows]
        out["node_cpu"] = None if self.node_cpu is None else dict(self.node_cpu)
        out["threads"] = None if self.threads is None else dict(self.threads)
        out["compile"] = None if self.compile is None else dict(self.compile)
        out["close_parts"] = None if self.close_parts is None else dict(self.close_parts)
        out["ranks"] = [dict(r) for r in self.ranks]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunStats:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("profile") is not None:
            values["profile"] = ProfileSummary.from_dict(values["profile"])
        values["notes"] = tuple(values.get("notes", ()))
        values["optimizers"] = tuple(values.get("optimizers", ()))
        values["ranks"] = tuple(values.get("ranks", ()))
        values["plan_rows"] = tuple(values.get("plan_rows", ()))
        return cls(**values)

    def step_us(self) -> float | None:
        """What every share of the step divides by: the run's step measured without the profiler
        (``step_time_s``), else the profiled step's wall time; ``None`` when neither is known."""
        if self.step_time_s:
            return self.step_time_s * 1e6
        p = self.profile
        return p.step_wall_us if p is not None and p.step_wall_us else None


def available_cores() -> int | None:
    """CPU cores this process may run on (``os.sched_getaffinity``), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def plan_mib(n_bytes: float) -> str:
    """Bytes as the plan's text writes them (``182.8 MiB``): the one format of the step's memory in
    the plan, the report and the picture."""
    return f"{n_bytes / 2**20:,.1f} MiB"
