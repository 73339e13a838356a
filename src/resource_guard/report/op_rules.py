"""The report's rules on op-level causes and the machine: ``casts``, ``host-sync``, ``stall``,
``cpu-contention``, ``threads``, ``recompiles`` and ``comm-bound``. Each is a pure
``RunStats -> Finding | None`` (appended to :data:`resource_guard.report.rules.RULES`), states its
measured share of the step (an evidence key ending in ``share``) and the step time predicted without
its cause (``predicted_step_s``, "about N% faster"). The thresholds, each with its reason:

- casts: copies and dtype casts (``aten::copy_``, ``aten::to``, ``_to_copy``; on a GPU copy kernels
  and device-to-device copies), their median time over the profiled steps over the run's untraced
  step time (:meth:`RunStats.step_us`, what every share here divides by), less their spread over
  those steps (the share must hold across the window), >= ``CASTS_SHARE``.
- host-sync: on a GPU timeline only, device idle time in the gaps opened by host-device syncs >=
  ``HOST_SYNC_SHARE``. On a CPU a ``.item()`` reads memory and waits for nothing: no finding.
- stall: single op calls far slower than their kind in the profiled window (info; the shares count
  them at their kind's usual time).
- cpu-contention: other processes' CPU (and steal) during the run, with the run's own threads, ask for
  more than the cores: the share of the step lost, >= ``CPU_CONTENTION_SHARE``.
- threads: (intra-op threads + DataLoader workers) × processes above the cores, and a measured slowdown
  at that thread count that costs >= ``THREADS_SHARE`` of the step (an ``info`` when not measured); the
  advised count leaves the cores other processes kept busy.
- recompiles: torch.compile recompilations whose compile time is >= ``RECOMPILE_SHARE`` of the run's
  wall time; graph breaks or cheaper recompilations are ``info``.
- comm-bound: exposed communication (not overlapped by compute kernels) >= ``COMM_BOUND_SHARE``.

Every share is clipped to the step and every prediction bounded below by what the advice does not
touch (:func:`resource_guard.report.gains.bounded_gain`): the other op classes for casts, the device's
busy time for host syncs, forward + backward + optimizer for recompiles and communication.

Example:
    >>> from resource_guard.report.types import ProfileSummary
    >>> p = ProfileSummary(steps=3, step_wall_us=10_000.0, op_timeline="host",
    ...                    op_class_us=(("matmul", 5000.0), ("casts", 3000.0)),
    ...                    cast_sites=(("train.py:12 (step)", 4.0, 3000.0),))
    >>> f = rule_casts(RunStats(step_time_s=0.01, profile=p))
    >>> f.id, f.evidence["casts_share"], round(f.predicted_step_s, 4)
    ('casts', 0.3, 0.007)
"""

from __future__ import annotations

import math
from typing import Any

from resource_guard.report.gains import bounded_gain, compute_floor_s
from resource_guard.report.plan_advice import find_row, quote
from resource_guard.report.types import Finding, ProfileSummary, RunStats

__all__ = [
    "CASTS_SHARE",
    "HOST_SYNC_SHARE",
    "THREADS_SHARE",
    "RECOMPILE_SHARE",
    "COMM_BOUND_SHARE",
    "CPU_CONTENTION_SHARE",
    "CPU_CONTENTION_MIN_CORES",
    "OP_RULES",
    "rule_casts",
    "rule_host_sync",
    "rule_threads",
    "rule_recompiles",
    "rule_comm_bound",
    "rule_stall",
    "rule_cpu_contention",
]

# Under autocast every op casts its inputs, so a mixed-precision step always spends some time in
# copies; from a tenth of the step the weights' per-step casts (or a cast inside the loop) dominate
# them, and keeping the weights in the compute dtype gives back a difference a user can measure.
CASTS_SHARE = 0.10
# A sync per step drains the GPU's queue once (tens of microseconds of launch latency); from 5% of the
# step, the rule of thumb the input-bound finding also uses, the idle gaps are worth a code change.
HOST_SYNC_SHARE = 0.05
# Oversubscribed threads cost the context switches and spin-waits of every parallel region; 5% is the
# smallest slowdown the end-of-run probe resolves reliably on a loaded machine.
THREADS_SHARE = 0.05
# Other processes on the node: from a tenth of the step the run lost to them (the cores it asked for
# shared with their load), the machine, not the code, is what to change; under that, a 2-core box's
# background (editors, a shell, the sampler's own thread) would be named on every run.
CPU_CONTENTION_SHARE = 0.10
# ... and only when they kept at least a quarter of a core busy on average (a short burst is not load).
CPU_CONTENTION_MIN_CORES = 0.25
# Compilation is expected once; recompiles that cost 5% of the run's wall time are a pattern (dynamic
# shapes, changing Python values), not the one-time warm-up.
RECOMPILE_SHARE = 0.05
# The last DDP bucket is never overlapped (6–8% of a step in published traces); from 5% exposed, the
# bucket size and overlap settings are worth checking.
COMM_BOUND_SHARE = 0.05


def _step_s(s: RunStats) -> float | None:
    """The step every share divides by (:meth:`RunStats.step_us`: the untraced step)."""
    step_us = s.step_us()
    return None if step_us is None else step_us / 1e6


def _spread_text(spread: float | None, steps: int) -> str:
    """`` (±3 points over 5 profiled steps)``: how far the steps' shares spread around the median."""
    if spread is None or steps < 2:
        return ""
    return (
        f" (±{spread * 100:.0f} point{'s' if round(spread * 100) != 1 else ''} over {steps} profiled steps)"
    )


def _gain(s: RunStats, share: float, floor_share: float | None = None) -> tuple[float, float | None, str]:
    """The cause's share of the step clipped to [0, 1], the step predicted without it (never below
    ``floor_share`` of the step: what the advice does not touch) and the title's phrase, through the
    report's one helper (:func:`~resource_guard.report.gains.bounded_gain`)."""
    step_s = _step_s(s)
    if step_s is None:
        return min(max(share, 0.0), 1.0), None, ""
    floor_s = None if floor_share is None else floor_share * step_s
    gain = bounded_gain(step_s, share * step_s, floor_s=floor_s)
    phrase = f"; without it the step would take about {gain.predicted_step_s * 1e3:.1f} ms ({gain.text})"
    return gain.share, gain.predicted_step_s, phrase


def _compute_floor_share(s: RunStats) -> float | None:
    """Forward + backward + optimizer over the step (``None`` without phases): what a cause outside them
    leaves."""
    step_s, floor_s = s.step_time_s, compute_floor_s(s.phases)
    return floor_s / step_s if step_s and floor_s is not None else None


def _other_ops_share(p: ProfileSummary, name: str, step_s: float | None) -> float | None:
    """The share of the step in the op classes other than ``name``: the ops the advice does not touch.
    The classes are scaled to fit the step when together they measured longer (the profiler's timing of
    each op against the untraced step)."""
    classes = dict(p.op_class_us)
    total_us = sum(classes.values())
    step_us = step_s * 1e6 if step_s else (p.step_wall_us or 0.0)
    if total_us <= 0 or step_us <= 0:
        return None
    scale = min(1.0, step_us / total_us)
    return (total_us - classes.get(name, 0.0)) * scale / step_us


def _sites(rows: Any) -> list[str]:
    return [f"{site}: {calls:.0f} per step, {us / 1e3:.2f} ms" for site, calls, us in rows]


def rule_casts(s: RunStats) -> Finding | None:
    """Copies and dtype casts take at least ``CASTS_SHARE`` of the step: their median over the profiled
    steps (so that the share holds in at least half of them), stated with its spread."""
    p = s.profile
    share = p.class_share("casts", s.step_time_s) if p is not None else None
    if p is None or share is None:
        return None
    spread = p.class_spread("casts", s.step_time_s)
    # it must hold across the window: the median less the steps' spread still reaches the threshold (a
    # share that only the noise of a few steps carries over it flips from run to run)
    if share - (spread or 0.0) < CASTS_SHARE:
        return None
    # the other op classes stay: scaled together with the casts into the step, they are the floor
    floor = _other_ops_share(p, "casts", s.step_time_s)
    share = min(share, 1.0 - (floor or 0.0))
    share, predicted, faster = _gain(s, share, floor)
    sites = _sites(p.cast_sites)
    advice = [
        "Move casts and copies out of the loop: convert inputs once in the Dataset or collate_fn, "
        "create tensors in the dtype and on the device they are used (torch.zeros(..., dtype=, device=)).",
    ]
    if s.precision is not None and s.precision.endswith("-mixed"):  # autocast casts the weights each step
        advice.insert(0, _weights_in_compute_dtype(s.precision, s.plan_rows))
    else:  # no autocast: the copies are the loop's own casts, or layout copies (.contiguous(), .clone())
        advice.append(
            "Layout copies (.contiguous() after permute/transpose, .clone(), .reshape() of a non-contiguous "
            "tensor) count here too: keep tensors in the layout the next op reads, or fuse the step "
            "(torch.compile) so the copies disappear."
        )
    if sites:
        advice.insert(0, "Where the copies are made: " + "; ".join(sites[:3]) + ".")
    evidence = {
        "casts_share": round(share, 4),
        "casts_share_spread": None if spread is None else round(spread, 4),
        "casts_us_per_step": dict(p.op_class_us).get("casts"),
        "timeline": p.op_timeline,
        "call_sites": sites,
        "precision": s.precision,
    }
    title = f"Casts and copies take {share:.0%}{_spread_text(spread, p.steps)} of the step{faster}"
    return Finding("casts", "warning", title, evidence, tuple(advice), predicted)


def _weights_in_compute_dtype(precision: str, rows: Any) -> str:
    """The advice on autocast's per-step weight casts, as the plan allows it: keeping the weights in the
    compute dtype (``bf16-true`` for ``bf16-mixed``) only where the plan evaluated it and it fits."""
    true = precision.replace("-mixed", "-true")
    row = find_row(rows, precision=true)
    casts = f"Under {precision} autocast casts the weights to the compute dtype in every step"
    if row is not None and row.get("fits"):
        return (
            f"{casts}: keep them in it instead ({true}, {quote(row)}; model.to(torch.bfloat16) with an "
            "fp32 master copy in the optimizer)."
        )
    if row is not None:
        return f"{casts}; keeping them in it ({true}) is ruled out by the plan ({quote(row)})."
    return (
        f"{casts}; the plan did not evaluate {true}: plan it (resource_guard.plan(..., precision="
        f"{true!r})) to see whether it fits before changing the precision."
    )


def rule_host_sync(s: RunStats) -> Finding | None:
    """Host-device syncs leave the GPU idle for at least ``HOST_SYNC_SHARE`` of the step."""
    p = s.profile
    step_us = s.step_us()
    if p is None or p.op_timeline != "device" or not step_us or p.syncs_per_step <= 0:
        return None
    share = p.sync_idle_us / step_us
    if share < HOST_SYNC_SHARE:
        return None
    # the kernels themselves stay: the device's busy time is the floor
    share, predicted, faster = _gain(s, share, min(1.0, p.device_busy_us / step_us))
    sites = _sites(p.sync_sites)
    advice = [
        "Keep values on the device between steps: accumulate the loss as a tensor (running += "
        "loss.detach()) and call .item() only when logging, every N steps.",
        "Avoid .cpu(), .tolist(), print(tensor) and Python conditions on tensor values inside the step; "
        "use torch.cuda.set_sync_debug_mode('warn') to find each sync.",
    ]
    if sites:
        advice.insert(0, "Where the syncs happen: " + "; ".join(sites[:3]) + ".")
    evidence = {
        "sync_idle_share": round(share, 4),
        "syncs_per_step": p.syncs_per_step,
        "sync_idle_us_per_step": round(p.sync_idle_us, 1),
        "call_sites": sites,
    }
    idle = f"leave the GPU idle {share:.0%} of the step"
    title = f"Host-device syncs: {p.syncs_per_step:.0f} per step {idle}{faster}"
    return Finding("host-sync", "warning", title, evidence, tuple(advice), predicted)


def rule_threads(s: RunStats) -> Finding | None:
    """More CPU threads than cores, and the slowdown it costs (measured at the end of the run)."""
    t = s.threads
    if not t or t.get("cores") is None or t.get("threads", 0) <= t["cores"]:
        return None
    fit, workers, procs = t.get("fitting_threads"), t.get("workers", 0), t.get("processes", 1)
    node = t.get("node") or {}
    other = float(node.get("other_cores") or 0.0)  # what the rest of the node ran meanwhile
    if other >= CPU_CONTENTION_MIN_CORES and isinstance(fit, int):
        fit = max(1, fit - math.ceil(other / max(1, procs) - 0.25))
    slowdown = t.get("slowdown")
    share = None
    if slowdown and slowdown > 1.0:
        # the probe ran Python between its ops in the step's proportion (``ops_share``): its slowdown
        # is the step's; a probe of ops alone (no profiled step) is what the step spends in ops
        share = 1.0 - 1.0 / slowdown
    measured, predicted, faster = _gain(s, share or 0.0)
    share = None if share is None else measured
    advice = [
        f"Call torch.set_num_threads({fit}) (or set OMP_NUM_THREADS={fit}) in each training process: "
        f"{t['cores']} cores shared by {procs} process(es) with {workers} DataLoader worker(s) each.",
    ]
    if workers:
        advice.append("Or use fewer DataLoader workers, so that (threads + workers) × processes ≤ cores.")
    evidence = {
        "threads_share": None if share is None else round(share, 4),
        "measured_slowdown": None if slowdown is None else round(slowdown, 2),
        **{k: t.get(k) for k in ("intra_op_threads", "processes", "workers", "cores", "threads")},
        "other_cores": round(other, 3) if node else None,
    }
    demand = f"{t['threads']} threads on {t['cores']} cores"
    if other >= CPU_CONTENTION_MIN_CORES:
        demand += f" (and {other:.1f} cores' worth of other processes)"
    if share is None or share < THREADS_SHARE:
        title = f"Threads: {demand} (oversubscribed; no measured cost)"
        return Finding("threads", "info", title, evidence, tuple(advice), None)
    title = f"Threads: {demand} cost about {share:.0%} of the step{faster}"
    return Finding("threads", "warning", title, evidence, tuple(advice), predicted)


def rule_recompiles(s: RunStats) -> Finding | None:
    """torch.compile recompiled (or broke graphs) during the run."""
    c = s.compile
    if not c or not (c.get("recompiles") or c.get("graph_breaks")):
        return None
    recompile_s = float(c.get("recompile_s") or 0.0)
    share = min(1.0, recompile_s / s.duration_s) if s.duration_s else 0.0
    advice = []
    guards = list(c.get("failed_guards") or ())
    if guards:
        advice.append("The guard that failed: " + guards[-1] + ".")
    advice += [
        "For shapes that change (sequence length, last batch): mark them dynamic "
        "(torch._dynamo.mark_dynamic(x, 1), or torch.compile(dynamic=True)), pad to a few bucket sizes, "
        "or drop_last=True.",
        "Keep Python values that change per step (step counters, schedules) out of the compiled "
        "function, or pass them as tensors.",
    ]
    breaks = list(c.get("break_reasons") or ())
    if breaks:
        advice.append(
            "Graph breaks (" + "; ".join(breaks[:3]) + "): see torch._dynamo.explain(fn)(*args) and "
            "TORCH_LOGS=graph_breaks."
        )
    evidence = {
        "recompile_share": round(share, 4),
        "recompiles": c.get("recompiles"),
        "graph_breaks": c.get("graph_breaks"),
        "recompile_s": recompile_s,
        "compile_s": c.get("compile_s"),
        "failed_guards": guards,
        "break_reasons": breaks,
    }
    if share < RECOMPILE_SHARE or not c.get("recompiles"):
        what = f"{c.get('recompiles', 0)} recompilation(s), {c.get('graph_breaks', 0)} graph break(s)"
        return Finding("recompiles", "info", f"torch.compile: {what}", evidence, tuple(advice), None)
    share, predicted, faster = _gain(s, share, _compute_floor_share(s))
    title = f"Recompiles: {c['recompiles']} torch.compile recompilations took {share:.0%} of the run{faster}"
    return Finding("recompiles", "warning", title, evidence, tuple(advice), predicted)


def rule_comm_bound(s: RunStats) -> Finding | None:
    """Communication not hidden by compute takes at least ``COMM_BOUND_SHARE`` of the step."""
    p = s.profile
    step_us = s.step_us()
    if p is None or not step_us or p.exposed_comm_us <= 0:
        return None
    share = p.exposed_comm_us / step_us
    if share < COMM_BOUND_SHARE:
        return None
    share, predicted, faster = _gain(s, share, _compute_floor_share(s))
    hidden = 1.0 - p.exposed_comm_us / p.comm_us if p.comm_us else 0.0
    advice = (
        "Overlap more of the gradient all-reduce with backward: a smaller DDP bucket_cap_mb (e.g. 10 "
        "instead of 25) starts the first all-reduce earlier and shrinks the last, never-overlapped bucket.",
        "Set find_unused_parameters=False (and static_graph=True when the graph does not change): the "
        "unused-parameter search runs after backward and delays the reduction.",
        "Accumulate gradients under model.no_sync() for all but the last micro-batch, or use "
        "gradient_as_bucket_view=True; under FSDP, forward/backward prefetch.",
    )
    evidence = {
        "exposed_comm_share": round(share, 4),
        "exposed_comm_us_per_step": round(p.exposed_comm_us, 1),
        "comm_us_per_step": round(p.comm_us, 1),
        "overlapped_fraction": round(hidden, 3),
        "world_size": s.world_size,
    }
    title = (
        f"Communication-bound: {share:.0%} of the step waits on communication not hidden by compute{faster}"
    )
    return Finding("comm-bound", "warning", title, evidence, advice, predicted)


def rule_stall(s: RunStats) -> Finding | None:
    """Single op calls far slower than the other calls of their kind in the profiled window (a page
    fault, a descheduled thread, a blocked allocation): an event, not a share of any class. Info: the
    shares already count each at its kind's usual time."""
    p = s.profile
    if p is None or not p.stalls:
        return None
    op, us, site = max(p.stalls, key=lambda row: row[1])
    step_us = s.step_us()
    of_step = f" ({us / step_us:.0%} of a step)" if step_us else ""
    where = f" at {site}" if site else ""
    more = f" and {len(p.stalls) - 1} more" if len(p.stalls) > 1 else ""
    title = (
        f"Stall: one {op} call took {us / 1e3:.1f} ms{of_step}{where}{more} in the profiled window; "
        "counted at its usual time, not as a share of the step"
    )
    advice = (
        "A single slow call among many fast ones of the same shape is the machine, not the op: other "
        "processes taking the cores, swapping, or a first-touch allocation. Check the node's load "
        "(the cpu-contention finding) before changing the code.",
    )
    evidence = {"stalls": [list(row) for row in p.stalls], "worst_us": us}
    return Finding("stall", "info", title, evidence, advice, None)


def rule_cpu_contention(s: RunStats) -> Finding | None:
    """Other processes on the node took CPU the run asked for (psutil's system-wide CPU less this
    process's, with steal; read over the run): the share of the step the run lost to them is
    ``1 - cores / (own threads + their load)`` when the two together ask for more than the cores."""
    node = (s.threads or {}).get("node")
    if not node:
        return None
    share, other = float(node.get("contention_share") or 0.0), float(node.get("other_cores") or 0.0)
    if share < CPU_CONTENTION_SHARE or other < CPU_CONTENTION_MIN_CORES:
        return None
    share, predicted, faster = _gain(s, share)
    cores, own = node.get("cores"), node.get("own_threads")
    fit = max(1, int((cores or 1) - math.ceil(other - 0.25)))
    load = f", load average {node['load_1m']:.1f}" if node.get("load_1m") is not None else ""
    steal = f", {node['steal_share']:.0%} stolen by the hypervisor" if node.get("steal_share") else ""
    title = (
        f"CPU contention: other processes kept {other:.1f} of {cores} cores busy during the run"
        f"{load}{steal}; the run's {own} thread(s) lost about {share:.0%} of the step{faster}"
    )
    advice = (
        "Run on an idle node, or reserve the cores for the run (taskset/cgroups, a scheduler's exclusive "
        "allocation): the other processes, not the training code, took this time.",
        f"Sharing the node: torch.set_num_threads({fit}) keeps the run's threads within the cores the other "
        "load leaves, so that they do not wait for each other at every parallel op.",
    )
    evidence = {"cpu_contention_share": round(share, 4), **dict(node)}
    return Finding("cpu-contention", "warning", title, evidence, advice, predicted)


OP_RULES = (
    rule_casts,
    rule_host_sync,
    rule_stall,
    rule_cpu_contention,
    rule_threads,
    rule_recompiles,
    rule_comm_bound,
)
