"""The bottleneck report: measured facts of a run (:class:`RunStats`) → findings → markdown / JSON.

Every rule is a small pure function ``RunStats -> Finding | None``; :func:`analyze` runs them all and
adds ``healthy`` when no rule raised a warning. Finding ids are stable (``report.json`` consumers rely
on them): ``oom``, ``input-bound``, ``launch-bound``, ``memory-pressure``, ``precision``,
``host-to-device``, ``alignment``, ``estimate-drift``, ``healthy``.

Thresholds (module constants, documented where they are defined):

- oom: the run ended with an out-of-memory error (``torch.OutOfMemoryError``, by type); the evidence
  is the run's last memory figures (:class:`~resource_guard.oom.OomEvent`).
- input-bound: share of wall time waiting for data >= ``stall_threshold`` (default 5%, the rule of the
  retired TensorBoard profiler plugin); critical from 25%.
- launch-bound: mean GPU utilization < 50% while the profiler saw tiny kernels (median < 20 us) or
  more than 1000 kernels per step.
- memory-pressure: measured peak > 90% of capacity.
- precision: ``32-true`` with ``float32_matmul_precision == "highest"`` on a tensor-core GPU.
- host-to-device: host-to-device copies >= 10% of the profiled step's wall time.
- alignment: on a GPU, matmuls with a matrix dimension not a multiple of 8 taking >= 10% of matmul time
  (reported as info).
- estimate-drift: measured allocator peak > pre-flight estimate by more than 5%.

Example:
    >>> stats = RunStats(steps=50, data_wait_share=0.4, loader_info={"num_workers": 0}, available_cores=8)
    >>> r = analyze(stats)
    >>> r.verdict, r.findings[0].severity
    ('input-bound', 'critical')
    >>> "num_workers" in r.findings[0].advice[0]
    True
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .profiling import ProfileSummary

__all__ = [
    "SEVERITIES",
    "FINDING_IDS",
    "Finding",
    "Report",
    "RunStats",
    "RULES",
    "analyze",
    "available_cores",
    "report_command",
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
    "healthy",
)
CRITICAL_DATA_WAIT_SHARE = 0.25
LOW_GPU_UTIL_PERCENT = 50.0
TINY_KERNEL_US = 20.0
MANY_KERNELS_PER_STEP = 1000
MEMORY_PRESSURE_FRACTION = 0.9
H2D_SHARE = 0.10
MISALIGNED_MATMUL_SHARE = 0.10
ESTIMATE_DRIFT_FRACTION = 0.05


@dataclass(frozen=True)
class Finding:
    """One conclusion of the report.

    Attributes:
        id: stable id (one of :data:`FINDING_IDS`).
        severity: ``"info"``, ``"warning"`` or ``"critical"``.
        title: one line for people.
        evidence: the numbers behind it (JSON-ready).
        advice: what to change, most effective first.
    """

    id: str
    severity: str
    title: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    advice: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "severity": self.severity,
            "title": self.title,
            "evidence": dict(self.evidence),
            "advice": list(self.advice),
        }


@dataclass(frozen=True)
class RunStats:
    """What the monitor measured over a run: the input of the rules. Unknown is ``None``.

    Times are means per step over the run, leaving out the first step (data-loader start, lazy inits).
    ``peak_memory_source`` is ``"cuda_allocated"`` (``torch.cuda.max_memory_allocated``) or ``"rss"``
    (the process's peak resident set size, which includes the interpreter and libraries).
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

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["loader_info"] = dict(self.loader_info)
        out["profile"] = None if self.profile is None else self.profile.to_dict()
        out["notes"] = list(self.notes)
        out["oom"] = None if self.oom is None else dict(self.oom)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunStats:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("profile") is not None:
            values["profile"] = ProfileSummary.from_dict(values["profile"])
        values["notes"] = tuple(values.get("notes", ()))
        return cls(**values)


def available_cores() -> int | None:
    """CPU cores this process may run on (``os.sched_getaffinity``), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


# -- rules ------------------------------------------------------------------------------------------
def rule_input_bound(s: RunStats) -> Finding | None:
    """The loop waited for data for at least ``stall_threshold`` of its wall time."""
    share = s.data_wait_share
    if share is None or share < s.stall_threshold:
        return None
    info = dict(s.loader_info)
    workers = info.get("num_workers")
    cores = s.available_cores
    advice = []
    if isinstance(workers, int) and cores is not None:
        target = max(1, cores - 1)
        if workers < target:
            advice.append(
                f"Raise DataLoader num_workers from {workers} to about {target}: {cores} cores are available "
                f"to this process (os.cpu_count() = {s.cpu_count}); keep one for the training loop"
                + (" and divide them among the ranks of this node." if s.world_size > 1 else ".")
            )
        else:
            advice.append(
                f"num_workers={workers} already uses the {cores} available cores: make each sample cheaper "
                "(pre-process or cache offline, lighter transforms, faster decoding)."
            )
    else:
        advice.append(
            f"Set DataLoader num_workers (about {max(1, (cores or 2) - 1)} here) to load in parallel."
        )
    if s.device_kind == "cuda" and not info.get("pin_memory", False):
        advice.append(
            "Set pin_memory=True so host-to-device copies are asynchronous (with non_blocking=True)."
        )
    if isinstance(workers, int) and workers > 0:
        if not info.get("persistent_workers", False):
            advice.append("Set persistent_workers=True so workers are not restarted every epoch.")
        prefetch = info.get("prefetch_factor") or 2
        advice.append(
            f"Raise prefetch_factor from {prefetch} to {max(4, 2 * prefetch)} (batches queued per worker) "
            "to absorb slow batches."
        )
    else:
        advice.append(
            "With workers, also set persistent_workers=True (no restart every epoch) and prefetch_factor=4 "
            "(batches queued per worker)."
        )
    severity = "critical" if share >= CRITICAL_DATA_WAIT_SHARE else "warning"
    evidence = {
        "data_wait_share": round(share, 4),
        "threshold": s.stall_threshold,
        "data_wait_s_per_step": s.data_wait_s,
        "step_time_s": s.step_time_s,
        "max_interval_data_wait_share": s.max_interval_data_wait_share,
        **{k: info.get(k) for k in ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")},
        "available_cores": cores,
        "cpu_count": s.cpu_count,
    }
    title = f"Input-bound: {share:.0%} of the step time was spent waiting for the next batch"
    return Finding("input-bound", severity, title, evidence, tuple(advice))


def rule_launch_bound(s: RunStats) -> Finding | None:
    """Low GPU utilization with tiny or very many kernels: the host cannot feed the GPU."""
    p = s.profile
    if s.gpu_util_percent is None or s.gpu_util_percent >= LOW_GPU_UTIL_PERCENT or p is None:
        return None
    tiny = p.median_kernel_us is not None and p.median_kernel_us < TINY_KERNEL_US
    if not (tiny or p.kernel_count > MANY_KERNELS_PER_STEP):
        return None
    evidence = {
        "gpu_util_percent": round(s.gpu_util_percent, 1),
        "kernels_per_step": p.kernel_count,
        "median_kernel_us": p.median_kernel_us,
        "process_cpu_percent": s.process_cpu_percent,
    }
    advice = (
        "Use a larger micro-batch so each kernel does more work.",
        "Compile the model (torch.compile) to fuse small kernels.",
        "Capture the step in CUDA graphs (torch.compile(mode='reduce-overhead')) to cut launch overhead.",
    )
    title = f"Launch/CPU-bound: GPU {s.gpu_util_percent:.0f}% busy, kernels too small to keep it fed"
    return Finding("launch-bound", "warning", title, evidence, advice)


def rule_oom(s: RunStats) -> Finding | None:
    """The run ended with an out-of-memory error: its last memory figures, and what would fit."""
    if not s.oom:
        return None
    ev = s.oom
    estimated, capacity = ev.get("estimated_peak_bytes"), ev.get("capacity_bytes")
    advice = []
    if estimated and capacity:
        advice.append(
            f"The pre-flight estimate was {_bytes(estimated)} per step of {_bytes(capacity)}: if the "
            "estimate fit, memory outside the estimated step (a longer batch, evaluation, fragmentation) "
            "ran out; re-plan with the largest batch the run will see, or more headroom."
        )
    advice += [
        "Use a smaller micro-batch with gradient accumulation to keep the effective batch.",
        "Enable activation checkpointing, or train in bf16-mixed.",
    ]
    if ev.get("snapshot_path"):
        advice.append(
            f"Open {ev['snapshot_path']} at https://pytorch.org/memory_viz to see what was allocated."
        )
    elif s.device_kind == "cuda":
        advice.append("Re-run with memory_history=True for a memory snapshot of the failing step.")
    title = f"Out of memory at step {ev.get('step')}: {ev.get('error')}"
    return Finding("oom", "critical", title, {k: v for k, v in ev.items() if k != "error"}, tuple(advice))


def rule_memory_pressure(s: RunStats) -> Finding | None:
    """The measured peak is above 90% of the device capacity."""
    if not s.peak_memory_bytes or not s.capacity_bytes:
        return None
    fraction = s.peak_memory_bytes / s.capacity_bytes
    if fraction <= MEMORY_PRESSURE_FRACTION:
        return None
    advice = ["Enable activation checkpointing on the largest blocks."]
    if s.precision in (None, "32-true"):
        advice.append("Train in bf16-mixed (or 16-mixed without bf16) to halve activation memory.")
    advice.append("Use a smaller micro-batch with gradient accumulation to keep the effective batch.")
    evidence = {
        "peak_memory_bytes": s.peak_memory_bytes,
        "capacity_bytes": s.capacity_bytes,
        "fraction": round(fraction, 4),
        "source": s.peak_memory_source,
    }
    title = f"Memory pressure: peak {fraction:.0%} of capacity"
    return Finding(
        "memory-pressure", "critical" if fraction > 0.97 else "warning", title, evidence, tuple(advice)
    )


def rule_precision(s: RunStats) -> Finding | None:
    """Float32 matmuls at full precision on a GPU that has tensor cores for a faster format."""
    if s.device_kind != "cuda" or not s.tensor_cores or s.precision not in (None, "32-true"):
        return None
    if s.float32_matmul_precision != "highest":
        return None
    advice = []
    if s.bf16_supported:
        advice.append(
            "Train in bf16-mixed (Lightning precision='bf16-mixed', or torch.autocast(dtype=bfloat16))."
        )
    else:
        advice.append("Train in 16-mixed (autocast float16 with a GradScaler).")
    if s.tf32_supported:
        advice.append(
            'Allow TF32 for the remaining float32 matmuls: torch.set_float32_matmul_precision("high").'
        )
    fp32 = s.profile.fp32_matmul_us if s.profile else None
    evidence: dict[str, Any] = {
        "precision": s.precision or "32-true",
        "float32_matmul_precision": s.float32_matmul_precision,
    }
    evidence["fp32_matmul_us_per_step"] = fp32
    title = "Precision: float32 matmuls on a tensor-core GPU run at a fraction of its peak"
    return Finding("precision", "warning", title, evidence, tuple(advice))


def rule_host_to_device(s: RunStats) -> Finding | None:
    """Host-to-device copies take a large share of the step."""
    p = s.profile
    if p is None or not p.step_wall_us or p.h2d_us <= 0:
        return None
    share = p.h2d_us / p.step_wall_us
    if share < H2D_SHARE:
        return None
    advice = [
        "Pin host memory (DataLoader pin_memory=True) and copy with tensor.to(device, non_blocking=True)."
    ]
    if p.h2d_pageable_us > 0:
        advice.append(
            f"{p.h2d_pageable_us / p.h2d_us:.0%} of the copy time came from pageable (unpinned) memory."
        )
    advice.append(
        "Move preprocessing (normalisation, augmentation) to the GPU to copy fewer bytes, e.g. uint8."
    )
    evidence = {"h2d_share": round(share, 4), "h2d_us_per_step": p.h2d_us, "pageable_us": p.h2d_pageable_us}
    return Finding(
        "host-to-device",
        "warning",
        f"Host-to-device copies take {share:.0%} of the step",
        evidence,
        tuple(advice),
    )


def rule_alignment(s: RunStats) -> Finding | None:
    """Matmul dimensions that are not multiples of 8 miss the tensor cores' fast paths."""
    p = s.profile
    if s.device_kind != "cuda" or p is None or not p.misaligned_matmuls:
        return None
    shapes = [f"{op}{list(map(list, shapes))}" for op, shapes in p.misaligned_matmuls[:5]]
    advice = (
        "Pad hidden sizes, vocabulary and head dimensions to multiples of 8 (64 is better).",
        "Choose a batch size (× sequence length) that is a multiple of 8.",
    )
    evidence = {"misaligned_matmuls": shapes, "count": len(p.misaligned_matmuls)}
    return Finding(
        "alignment", "info", "Tensor-core alignment: matmul dimensions not multiples of 8", evidence, advice
    )


def rule_estimate_drift(s: RunStats) -> Finding | None:
    """The allocator's measured peak exceeds the pre-flight estimate."""
    measured, estimated = s.peak_memory_bytes, s.estimated_peak_bytes
    if s.peak_memory_source != "cuda_allocated" or not measured or not estimated:
        return None
    error = (measured - estimated) / estimated
    if error <= ESTIMATE_DRIFT_FRACTION:
        return None
    evidence = {"measured_peak_bytes": measured, "estimated_peak_bytes": estimated, "error": round(error, 4)}
    advice = (
        "Keep more headroom than the plan assumed, or re-run the pre-flight with the real batch and loss_fn.",
        "Report the model to resource_guard: the estimator missed memory it should have counted.",
    )
    return Finding(
        "estimate-drift", "warning", f"Measured peak is {error:.0%} above the estimate", evidence, advice
    )


RULES: tuple[Callable[[RunStats], Finding | None], ...] = (
    rule_oom,
    rule_input_bound,
    rule_launch_bound,
    rule_memory_pressure,
    rule_precision,
    rule_host_to_device,
    rule_alignment,
    rule_estimate_drift,
)


def _healthy(s: RunStats) -> Finding:
    evidence = {"step_time_s": s.step_time_s, "data_wait_share": s.data_wait_share, "mfu": s.mfu}
    mfu = f", MFU {s.mfu:.0%}" if s.mfu is not None else ""
    advice = (
        "No bottleneck found: the step is compute-bound. Scale the batch or the device for more speed.",
    )
    return Finding("healthy", "info", f"Compute-bound (healthy){mfu}", evidence, advice)


def analyze(stats: RunStats, rules: tuple[Callable[[RunStats], Finding | None], ...] = RULES) -> Report:
    """Run every rule over ``stats``; findings sorted by severity (critical first)."""
    found = [f for f in (rule(stats) for rule in rules) if f is not None]
    if not any(f.severity != "info" for f in found):
        found.insert(0, _healthy(stats))
    found.sort(key=lambda f: -SEVERITIES.index(f.severity))
    return Report(tuple(found), stats)


# -- the report -------------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@dataclass(frozen=True)
class Report:
    """Findings (most severe first) and the measured summary they were drawn from."""

    findings: tuple[Finding, ...]
    stats: RunStats = field(default_factory=RunStats)

    @property
    def verdict(self) -> str:
        """Id of the most severe finding (``"healthy"`` when nothing is wrong)."""
        return self.findings[0].id if self.findings else "healthy"

    def finding(self, finding_id: str) -> Finding | None:
        return next((f for f in self.findings if f.id == finding_id), None)

    def summary_line(self) -> str:
        """One line for the console."""
        s = self.stats
        parts = [f"verdict {self.verdict}", f"{s.steps} steps"]
        if s.step_time_s is not None:
            parts.append(f"{s.step_time_s * 1e3:.1f} ms/step")
        if s.data_wait_share is not None:
            parts.append(f"data wait {s.data_wait_share:.0%}")
        if s.samples_per_s is not None:
            parts.append(f"{s.samples_per_s:.1f} samples/s")
        if s.mfu is not None:
            parts.append(f"MFU {s.mfu:.1%}")
        return "resource_guard: " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "findings": [f.to_dict() for f in self.findings],
            "summary": self.stats.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        findings = tuple(
            Finding(
                f["id"], f["severity"], f["title"], dict(f.get("evidence", {})), tuple(f.get("advice", ()))
            )
            for f in data.get("findings", ())
        )
        return cls(findings, RunStats.from_dict(data.get("summary", {})))

    def to_markdown(self) -> str:
        s = self.stats
        lines = [
            "# resource_guard report",
            "",
            f"**Verdict: {self.verdict}** ({s.steps} steps on {s.device})",
            "",
        ]
        rows = [
            ("step time", None if s.step_time_s is None else f"{s.step_time_s * 1e3:.2f} ms"),
            ("data wait share", None if s.data_wait_share is None else f"{s.data_wait_share:.1%}"),
            ("samples/s", s.samples_per_s),
            ("tokens/s", s.tokens_per_s),
            ("MFU", None if s.mfu is None else f"{s.mfu:.1%}"),
            (f"peak memory ({s.peak_memory_source or '-'})", _bytes(s.peak_memory_bytes)),
            ("estimated peak", _bytes(s.estimated_peak_bytes)),
            ("capacity", _bytes(s.capacity_bytes)),
            ("GPU utilization", None if s.gpu_util_percent is None else f"{s.gpu_util_percent:.0f}%"),
            ("process CPU", None if s.process_cpu_percent is None else f"{s.process_cpu_percent:.0f}%"),
            ("precision", s.precision),
        ]
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {name} | {_fmt(value)} |" for name, value in rows]
        lines += ["", "## Findings", ""]
        for f in self.findings:
            lines += [f"### {f.id} ({f.severity})", "", f.title, ""]
            if f.evidence:
                ev = ", ".join(f"{k}={_fmt(v)}" for k, v in f.evidence.items() if v is not None)
                lines += [f"Evidence: {ev}", ""]
            lines += [f"- {a}" for a in f.advice] + [""]
        if s.profile is not None:
            p = s.profile
            lines += ["## Profiler window", "", f"{p.steps} steps recorded; trace: {p.trace_path or '-'}", ""]
            if p.top_ops:
                lines += ["| op | calls/step | self CPU us/step |", "|---|---|---|"]
                lines += [f"| {name} | {calls} | {us:.1f} |" for name, calls, us in p.top_ops]
                lines.append("")
        lines += [f"Note: {n}" for n in s.notes]
        return "\n".join(lines).rstrip() + "\n"


def _find_report(logdir: Path) -> Path | None:
    direct = logdir / "report.json"
    if direct.is_file():
        return direct
    found = sorted(logdir.rglob("report.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def report_command(logdir: str, *, as_json: bool = False) -> int:
    """``resource-guard report LOGDIR``: print the report of a finished run; returns the exit code.

    Reads ``LOGDIR/report.json`` (or the newest ``report.json`` below it, e.g. a Lightning version
    directory). Exit 0 when printed, 2 when there is no readable report.
    """
    path = _find_report(Path(logdir))
    if path is None:
        print(
            f"resource-guard report: no report.json in {logdir!r} (is it the log dir of a finished run?)",
            file=sys.stderr,
        )
        return 2
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        report = Report.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(
            f"resource-guard report: {path} is not a readable report ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(data, indent=2) if as_json else report.to_markdown())
    return 0
