"""The rules of the bottleneck report: each a small pure function ``RunStats -> Finding | None``.

:func:`resource_guard.report.findings.analyze` runs :data:`RULES` in order (and adds ``healthy`` when none
raised a warning). The thresholds are module constants:

- oom: the run ended with an out-of-memory error (``torch.OutOfMemoryError``, by type); the evidence
  is the run's last memory figures (:class:`~resource_guard.observe.oom.OomEvent`).
- input-bound: share of wall time waiting for data >= ``RunStats.stall_threshold`` (default 5%, the
  rule of the retired TensorBoard profiler plugin); critical from ``CRITICAL_DATA_WAIT_SHARE`` (25%).
- launch-bound: mean GPU utilization < ``LOW_GPU_UTIL_PERCENT`` (50%) while the profiler saw tiny
  kernels (median < ``TINY_KERNEL_US``, 20 us) or more than ``MANY_KERNELS_PER_STEP`` (1000) kernels
  per step.
- memory-pressure: measured peak > ``MEMORY_PRESSURE_FRACTION`` (90%) of capacity; critical above 97%.
- precision: ``32-true`` with ``float32_matmul_precision == "highest"`` on a tensor-core GPU.
- host-to-device: host-to-device copies >= ``H2D_SHARE`` (10%) of the step (:meth:`RunStats.step_us`:
  the untraced step, what every share of the step divides by).
- alignment: on a GPU, profiled matmuls with a matrix dimension not a multiple of 8 (reported as
  info) when they take at least ``MISALIGNED_MATMUL_SHARE`` (10%) of the matmul time.
- estimate-drift: the CUDA allocator's measured peak (``max_memory_allocated``) > the pre-flight
  estimate of that same quantity (the allocator model's allocated peak) by more than
  ``ESTIMATE_DRIFT_FRACTION`` (5%). Never on the CPU, whose measured figure is the process's RSS.
- memory-growth, fragmentation: memory over time, in :mod:`resource_guard.report.memory_rules`.
- optimizer-step, host-loop, evaluation, checkpoint-io, logging: where the step's time goes, from
  ``RunStats.phases``, in :mod:`resource_guard.report.phase_rules` (with their thresholds).
- casts, host-sync, threads, recompiles, comm-bound: op-level causes, in
  :mod:`resource_guard.report.op_rules`.

The rules are re-exported from :mod:`resource_guard.report.findings`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from resource_guard.devices import format_bytes
from resource_guard.report.gains import bounded_gain, compute_floor_s, faster_text
from resource_guard.report.memory_rules import rule_fragmentation, rule_memory_growth
from resource_guard.report.op_rules import OP_RULES
from resource_guard.report.phase_rules import MIN_GAIN_SHARE, PHASE_RULES
from resource_guard.report.shape_findings import rule_shapes
from resource_guard.report.straggler import rule_straggler
from resource_guard.report.types import Finding, RunStats

__all__ = [
    "CRITICAL_DATA_WAIT_SHARE",
    "LOW_GPU_UTIL_PERCENT",
    "TINY_KERNEL_US",
    "MANY_KERNELS_PER_STEP",
    "MEMORY_PRESSURE_FRACTION",
    "H2D_SHARE",
    "MISALIGNED_MATMUL_SHARE",
    "ESTIMATE_DRIFT_FRACTION",
    "RULES",
    "rule_oom",
    "rule_input_bound",
    "rule_launch_bound",
    "rule_memory_pressure",
    "rule_precision",
    "rule_host_to_device",
    "rule_alignment",
    "rule_estimate_drift",
    "rule_memory_growth",
    "rule_fragmentation",
]

CRITICAL_DATA_WAIT_SHARE = 0.25
LOW_GPU_UTIL_PERCENT = 50.0
TINY_KERNEL_US = 20.0
MANY_KERNELS_PER_STEP = 1000
MEMORY_PRESSURE_FRACTION = 0.9
H2D_SHARE = 0.10
MISALIGNED_MATMUL_SHARE = 0.10
ESTIMATE_DRIFT_FRACTION = 0.05


def rule_input_bound(s: RunStats) -> Finding | None:
    """The loop waited for data for at least ``stall_threshold`` of its wall time.

    With the step split by phase (``s.phases``: the data wait is the loader's own ``__next__``) the wait
    must also reach ``MIN_GAIN_SHARE``: what workers leave on the main thread (receiving each batch) is
    of the order of collating an in-memory batch there, so a smaller wait is no gain worth a warning.
    """
    share = s.data_wait_share
    threshold = s.stall_threshold if s.phases is None else max(s.stall_threshold, MIN_GAIN_SHARE)
    if share is None or share < threshold:
        return None
    share = min(share, 1.0)  # a share is at most the step it is a share of
    info = dict(s.loader_info)
    workers = info.get("num_workers")
    cores = s.available_cores
    advice = []
    n_workers = workers if isinstance(workers, int) else None
    known = n_workers is not None  # the loader was reachable (its settings read)
    if n_workers is None:  # its settings are unknown: none of them is advised
        advice.append(
            "The DataLoader's settings (num_workers, pin_memory, prefetch_factor, persistent_workers) were "
            "not readable in this run (pass the loader to g.iterate, or let the guard see it iterated), so "
            "none is advised: make each sample cheaper, or load in parallel if the loader does not yet."
        )
    elif n_workers < max(1, (cores or 2) - 1):
        target = max(1, (cores or 2) - 1)
        available = (
            f"{cores} cores are available to this process (os.cpu_count() = {s.cpu_count})"
            if cores is not None
            else "the cores this process may use are unknown"
        )
        advice.append(
            f"Raise DataLoader num_workers from {workers} to about {target}: {available}; keep one for the "
            "training loop" + (" and divide them among the ranks of this node." if s.world_size > 1 else ".")
        )
    else:
        advice.append(
            f"num_workers={workers} already uses the {cores or ''} available cores: make each sample cheaper "
            "(pre-process or cache offline, lighter transforms, faster decoding)."
        )
    if known and s.device_kind == "cuda" and not info.get("pin_memory", False):
        advice.append(
            "Set pin_memory=True so host-to-device copies are asynchronous (with non_blocking=True)."
        )
    if n_workers is not None and n_workers > 0:
        if not info.get("persistent_workers", False):
            advice.append("Set persistent_workers=True so workers are not restarted every epoch.")
        prefetch = info.get("prefetch_factor") or 2
        advice.append(
            f"Raise prefetch_factor from {prefetch} to {max(4, 2 * prefetch)} (batches queued per worker) "
            "to absorb slow batches."
        )
    elif known:
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
    predicted = None
    if s.step_time_s:
        # workers load while the step computes: the wait goes, down to the step's forward, backward and
        # optimizer; the wait is the loader's own __next__ (phases), else the interval share of the step
        wait = s.phases.get("data_wait", 0.0) if s.phases else share * s.step_time_s
        gain = bounded_gain(s.step_time_s, wait, floor_s=compute_floor_s(s.phases))
        share = gain.share
        predicted = gain.predicted_step_s
        evidence["data_wait_share"] = round(share, 4)
        evidence["predicted_step_s"] = predicted
        evidence["floor_step_s"] = gain.floor_s
    title = f"Input-bound: {share:.0%} of the step time was spent waiting for the next batch"
    if predicted is not None:
        title += f"; {faster_text(s.step_time_s or 0.0, predicted)} without it"
    return Finding("input-bound", severity, title, evidence, tuple(advice), predicted)


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
            f"The pre-flight estimate was {format_bytes(estimated)} per step of {format_bytes(capacity)}: "
            "if the estimate fit, memory outside the estimated step (a longer batch, evaluation, "
            "fragmentation) ran out; re-plan with the largest batch the run will see, or more headroom."
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
    capacity = s.measured_capacity_bytes
    if not s.peak_memory_bytes or not capacity:
        return None
    fraction = s.peak_memory_bytes / capacity
    if fraction <= MEMORY_PRESSURE_FRACTION:
        return None
    advice = ["Enable activation checkpointing on the largest blocks."]
    if s.precision in (None, "32-true"):
        advice.append("Train in bf16-mixed (or 16-mixed without bf16) to halve activation memory.")
    advice.append("Use a smaller micro-batch with gradient accumulation to keep the effective batch.")
    evidence = {
        "peak_memory_bytes": s.peak_memory_bytes,
        "capacity_bytes": capacity,
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
    p, step_us = s.profile, s.step_us()  # the untraced step, as every share of the step
    if p is None or not step_us or p.h2d_us <= 0:
        return None
    share = min(1.0, p.h2d_us / step_us)
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
    share = p.misaligned_matmul_us / p.matmul_us if p.matmul_us else 1.0
    if share < MISALIGNED_MATMUL_SHARE:
        return None
    shapes = [f"{op}{list(map(list, shapes))}" for op, shapes in p.misaligned_matmuls[:5]]
    advice = (
        "Pad hidden sizes, vocabulary and head dimensions to multiples of 8 (64 is better).",
        "Choose a batch size (× sequence length) that is a multiple of 8.",
    )
    evidence = {
        "misaligned_matmuls": shapes,
        "count": len(p.misaligned_matmuls),
        "share_of_matmul_time": round(share, 3),
    }
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
    rule_shapes,
    rule_straggler,
    rule_input_bound,
    *PHASE_RULES,
    rule_launch_bound,
    rule_memory_pressure,
    rule_precision,
    rule_host_to_device,
    rule_alignment,
    rule_estimate_drift,
    rule_memory_growth,
    rule_fragmentation,
    *OP_RULES,
)
