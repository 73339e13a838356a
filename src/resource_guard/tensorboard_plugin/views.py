"""What each view of the Resource Guard tab shows, as JSON-ready dicts in the units people read (ms,
MiB, %): :func:`overview`, :func:`step_time`, :func:`memory`, :func:`plan` and :func:`ops`. Plain
functions of a run's files (:mod:`resource_guard.tensorboard_plugin.runs`); the plugin only serves them.

Unknown is ``None``. Names carry their unit: ``step_ms``, ``share_pct``, ``capacity_mib``.

Example:
    >>> ranked_findings({"findings": [], "summary": {}})
    []
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resource_guard.report.breakdown import PHASE_LABELS
from resource_guard.report.scalar_tags import LEGACY_TAGS, MEMORY_TAGS, PHASE_MS, STEP_MS
from resource_guard.report.types import PHASES
from resource_guard.tensorboard_plugin.runs import RunEvents, RunFiles, load_events, read_json

__all__ = ["MiB", "memory", "ops", "overview", "plan", "ranked_findings", "step_time", "verdict_words"]

MiB = 1024**2
_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def _ms(seconds: Any) -> float | None:
    return None if seconds is None else round(float(seconds) * 1000.0, 3)


def _r3(value: float | None) -> float | None:
    return None if value is None else round(float(value), 3)


def _mib(n_bytes: Any) -> float | None:
    return None if n_bytes is None else round(float(n_bytes) / MiB, 2)


def _pct(fraction: Any) -> float | None:
    return None if fraction is None else round(float(fraction) * 100.0, 2)


def _share(evidence: Mapping[str, Any]) -> float | None:
    """The finding's measured share of the step: its first evidence key ending in ``share``."""
    for key, value in evidence.items():
        if key.endswith("share") and isinstance(value, (int, float)):
            return float(value)
    return None


def _call_sites(evidence: Mapping[str, Any]) -> list[str]:
    sites: list[str] = []
    for key, value in evidence.items():
        if key.endswith("sites") and isinstance(value, list):
            sites.extend(str(v) for v in value)
    return sites


def ranked_findings(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The report's findings ranked by the time they cost (step time minus the predicted step), those
    not about time after them by severity; each with its share, predicted gain, fix and call sites."""
    step_s = (report.get("summary") or {}).get("step_time_s")
    rows = []
    for f in report.get("findings") or ():
        evidence = f.get("evidence") or {}
        predicted = f.get("predicted_step_s")
        cost_s = step_s - predicted if step_s is not None and predicted is not None else None
        gain = step_s / predicted - 1 if step_s and predicted else None
        share = _share(evidence)
        rows.append(
            {
                "id": f.get("id"),
                "severity": f.get("severity"),
                "title": f.get("title"),
                "share_pct": _pct(share),
                "cost_ms": _ms(cost_s),
                "predicted_step_ms": _ms(predicted),
                "gain_pct": _pct(gain),
                "fix": list(f.get("advice") or ()),
                "call_sites": _call_sites(evidence),
                "evidence": evidence,
            }
        )
    rows.sort(
        key=lambda r: (
            r["cost_ms"] is None,
            -(r["cost_ms"] or 0.0),
            _SEVERITY_ORDER.get(r["severity"], 3),
        )
    )
    return rows


def verdict_words(report: Mapping[str, Any]) -> str:
    """The verdict as a sentence: the title of the finding the verdict names (``healthy``: no cause)."""
    verdict = report.get("verdict")
    findings = report.get("findings") or ()
    chosen = next((f for f in findings if f.get("id") == verdict), None)
    if chosen is not None and chosen.get("title"):
        return str(chosen["title"])
    if verdict in (None, "healthy"):
        return "No bottleneck found: the step's time is spent computing."
    return f"Verdict: {verdict}"


def overview(run: RunFiles) -> dict[str, Any]:
    """The verdict in words, the findings ranked by their cost, and the run's facts in units."""
    report = read_json(run.report_path) or {}
    guard_json = read_json(run.guard_path) or {}
    s: Mapping[str, Any] = report.get("summary") or {}
    peak_source = s.get("peak_memory_source")
    facts = [
        ("steps", s.get("steps"), ""),
        ("step time", _ms(s.get("step_time_s")), "ms"),
        ("data wait", _pct(s.get("data_wait_share")), "%"),
        ("samples/s", _round(s.get("samples_per_s")), ""),
        ("tokens/s", _round(s.get("tokens_per_s")), ""),
        ("MFU", _pct(s.get("mfu")), "%"),
        ("GPU utilization", _round(s.get("gpu_util_percent")), "%"),
        ("process CPU", _round(s.get("process_cpu_percent")), "%"),
        (
            "peak memory (process RSS)" if peak_source == "rss" else "peak memory (allocated)",
            _mib(s.get("peak_memory_bytes")),
            "MiB",
        ),
        ("estimated allocated peak", _mib(s.get("estimated_peak_bytes")), "MiB"),
        *_capacity_facts(s, guard_json.get("plan") or {}),
        ("device", s.get("device_name") or s.get("device"), ""),
        ("precision", s.get("precision"), ""),
        ("run time", _round(s.get("duration_s") or guard_json.get("wall_s")), "s"),
    ]
    return {
        "run": run.name,
        "has_report": bool(report),
        "verdict": report.get("verdict"),
        "verdict_text": verdict_words(report) if report else "No report yet: the run has not finished.",
        "findings": ranked_findings(report) if report else [],
        "facts": [{"name": n, "value": v, "unit": u} for n, v, u in facts if v is not None],
        "notes": list(s.get("notes") or ()),
    }


def _capacity_facts(s: Mapping[str, Any], planned: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """The plan's memory figures under the plan's names (``guard.json``'s plan, else the report's: the
    same figures); the host's RAM where the measured peak is the process RSS."""
    plan = planned if planned.get("capacity_bytes") else s
    out: list[tuple[str, Any, str]] = []
    if plan.get("usable_bytes") or plan is planned:
        out += [
            ("predicted peak (the plan's)", _mib(plan.get("predicted_peak_bytes")), "MiB"),
            ("usable (the plan's)", _mib(plan.get("usable_bytes")), "MiB"),
            ("capacity (the plan's)", _mib(plan.get("capacity_bytes")), "MiB"),
        ]
    ram = s.get("ram_bytes")
    if ram is None and s.get("peak_memory_source") == "rss":  # a report written before ram_bytes
        ram = s.get("capacity_bytes") if s.get("capacity_bytes") != planned.get("capacity_bytes") else None
    if ram:
        out.append(("host RAM", _mib(ram), "MiB"))
    elif not out and s.get("capacity_bytes"):
        out.append(("device memory", _mib(s["capacity_bytes"]), "MiB"))
    return out


def _points(events: RunEvents, tag: str) -> list[tuple[int, float]]:
    """A scalar's points under its tag (:mod:`resource_guard.report.scalar_tags`); for a run written
    before those tags, its former tag's, in the new tag's unit."""
    points = events.scalars.get(tag)
    if points:
        return list(points)
    old, scale = LEGACY_TAGS.get(tag, (None, 1.0))
    return [(step, value * scale) for step, value in events.scalars.get(old or "", ())]


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 2)


def step_time(run: RunFiles, events: RunEvents | None = None) -> dict[str, Any]:
    """A bar per logged step split by phase (ms), the phases that are never zero as the series, and
    the run's mean share table (``report.json``: the first step left out)."""
    events = load_events(run) if events is None else events
    report = read_json(run.report_path) or {}
    by_phase = {p: dict(_points(events, PHASE_MS + p)) for p in PHASES}  # ms per step
    steps = sorted({step for points in by_phase.values() for step in points})
    series = [p for p in PHASES if any(v > 0 for v in by_phase[p].values())]
    step_ms = dict(_points(events, STEP_MS))
    bars = [
        {
            "step": step,
            "step_ms": _r3(step_ms.get(step)),
            "phases_ms": {p: _r3(by_phase[p].get(step, 0.0)) for p in series},
        }
        for step in steps
    ]
    mean: Mapping[str, float] = (report.get("summary") or {}).get("phases") or {}
    total = sum(mean.values())
    table = [
        {
            "phase": p,
            "label": PHASE_LABELS[p],
            "ms": _ms(mean[p]),
            "share_pct": _pct(mean[p] / total) if total else None,
        }
        for p in PHASES
        if mean.get(p)
    ]
    return {
        "run": run.name,
        "series": series,
        "labels": {p: PHASE_LABELS[p] for p in series},
        "bars": bars,
        "table": table,
        "mean_step_ms": _ms((report.get("summary") or {}).get("step_time_s")),
    }


def memory(run: RunFiles, events: RunEvents | None = None) -> dict[str, Any]:
    """Allocated/reserved (and the peak and RSS) over the logged steps in MiB, against the capacity the
    plan used, its usable line and the pre-flight estimate."""
    events = load_events(run) if events is None else events
    report = read_json(run.report_path) or {}
    guard_json = read_json(run.guard_path) or {}
    s: Mapping[str, Any] = report.get("summary") or {}
    planned: Mapping[str, Any] = guard_json.get("plan") or {}
    series = [
        {"tag": f"resource_guard/{tag}", "label": label, "points": [[st, round(v, 2)] for st, v in points]}
        for tag, label in MEMORY_TAGS.items()
        if (points := _points(events, tag))
    ]
    # the plan's figures: guard.json's plan, else the report's (the Lightning and Trainer doors write
    # the same figures there: one memory story)
    planned = dict(planned) or {
        k: s[k] for k in ("capacity_bytes", "usable_bytes", "predicted_peak_bytes") if s.get("usable_bytes")
    }
    if planned.get("capacity_bytes"):
        capacity, source = planned["capacity_bytes"], "the plan's"
    else:
        capacity, source = s.get("capacity_bytes"), "the monitor's"
    estimate = planned.get("predicted_peak_bytes") or s.get("estimated_peak_bytes")
    return {
        "run": run.name,
        "series": series,
        "capacity_mib": _mib(capacity),
        "capacity_source": source if capacity is not None else None,
        "usable_mib": _mib(planned.get("usable_bytes")),
        "estimate_mib": _mib(estimate),
        "estimate_source": "plan" if planned.get("predicted_peak_bytes") else "report" if estimate else None,
        "measured_peak_mib": _mib(s.get("peak_memory_bytes") or guard_json.get("measured_peak_bytes")),
        "peak_source": s.get("peak_memory_source"),
        "picture": run.picture_path.is_file(),
    }


def plan(run: RunFiles, events: RunEvents | None = None) -> dict[str, Any]:
    """The plan: configuration, reasons, alternatives, the estimate's method and target (``guard.json``);
    the plan's text where only that was written (Lightning, the Trainer)."""
    guard_json = read_json(run.guard_path) or {}
    p: Mapping[str, Any] = guard_json.get("plan") or {}
    if not p:
        events = load_events(run) if events is None else events
        text = events.texts.get("plan")
        if text is None:  # no plan text in these events (a Trainer not reporting to TensorBoard): the
            # plan's reasons the report carries among its notes
            notes = ((read_json(run.report_path) or {}).get("summary") or {}).get("notes") or []
            if notes:
                text = "The plan's reasons and the run's notes (report.json):\n\n" + "\n".join(
                    f"- {n}" for n in notes
                )
        return {"run": run.name, "has_plan": text is not None, "markdown": text}
    est: Mapping[str, Any] = p.get("estimate") or {}
    config = [
        ("device", p.get("device"), ""),
        ("micro-batch", p.get("micro_batch_size"), ""),
        ("accumulation steps", p.get("accumulation_steps"), ""),
        ("world size", p.get("world_size"), ""),
        ("strategy", p.get("strategy"), ""),
        ("target batch", p.get("target_batch_size"), ""),
        ("precision", p.get("precision"), ""),
        ("activation checkpointing", _ckpt(p), ""),
        ("predicted peak", _mib(p.get("predicted_peak_bytes")), "MiB"),
        ("usable", _mib(p.get("usable_bytes")), "MiB"),
        ("capacity", _mib(p.get("capacity_bytes")), "MiB"),
        ("headroom", _pct(p.get("headroom")), "%"),
        ("verdict", p.get("verdict"), ""),
    ]
    alternatives = [
        {
            "config": a.get("config"),
            "fits": a.get("fits"),
            "predicted_mib": _mib(a.get("predicted_peak_bytes")),
            "relative_cost": _round(a.get("relative_cost")),
            "chosen": bool(a.get("chosen")),
        }
        for a in p.get("alternatives") or ()
    ]
    method = [
        ("method", est.get("method"), ""),
        ("target", est.get("assumed_target"), ""),
        ("peak phase", est.get("peak_phase"), ""),
        ("peak op", est.get("peak_op"), ""),
        ("allocated peak", _mib(est.get("peak_bytes")), "MiB"),
        ("traces", p.get("traces"), ""),
        ("trace time", _round(est.get("trace_seconds")), "s"),
    ]
    return {
        "run": run.name,
        "has_plan": True,
        "configuration": [{"name": n, "value": v, "unit": u} for n, v, u in config if v is not None],
        "reasons": list(p.get("reasons") or ()),
        "alternatives": alternatives,
        "estimate": [{"name": n, "value": v, "unit": u} for n, v, u in method if v is not None],
        "warnings": list(est.get("warnings") or ()),
    }


def _ckpt(p: Mapping[str, Any]) -> str:
    every = p.get("checkpoint_every") or 0
    if not p.get("checkpointing"):
        return "off"
    modules = len(p.get("checkpointed_modules") or ())
    return f"on ({modules} modules)" if every <= 1 else f"every {every} blocks ({modules} modules)"


def ops(run: RunFiles) -> dict[str, Any]:
    """Where the profiled steps' time went by operator (``report.json``'s ``profile``): the op classes
    (ms per step, their spread over the window's steps, share of the profiled step), the top operators
    (calls and ms per step) and the call sites of the casts and the host syncs (the user's line of the
    call, with the module path where a module's forward made it); ``profiled`` is False when the run
    profiled no step (``profile=False``, or the window never closed)."""
    report = read_json(run.report_path) or {}
    profile = (report.get("summary") or {}).get("profile") or {}
    if not profile or not profile.get("steps"):
        return {"run": run.name, "profiled": False}
    step_us = profile.get("step_wall_us")
    spread = dict(profile.get("op_class_spread_us") or ())

    def share(us: float) -> float | None:
        return _pct(us / step_us) if step_us else None

    classes = [
        {
            "class": name,
            "ms": _ms(us / 1e6),
            "spread_ms": _ms(spread[name] / 1e6) if spread.get(name) is not None else None,
            "share_pct": share(us),
        }
        for name, us in profile.get("op_class_us") or ()
        if us
    ]
    top = [
        {"op": name, "calls": calls, "ms": _ms(us / 1e6), "share_pct": share(us)}
        for name, calls, us in profile.get("top_ops") or ()
    ]

    def sites(rows: Any) -> list[dict[str, Any]]:
        return [{"site": site, "calls": calls, "ms": _ms(us / 1e6)} for site, calls, us in rows or ()]

    return {
        "run": run.name,
        "profiled": True,
        "steps": profile.get("steps"),
        "step_ms": _ms(step_us / 1e6) if step_us else None,
        "classes": sorted(classes, key=lambda c: -(c["ms"] or 0.0)),
        "top_ops": top,
        "cast_sites": sites(profile.get("cast_sites")),
        "sync_sites": sites(profile.get("sync_sites")),
        "stalls": list(profile.get("stalls") or ()),
        "trace_path": profile.get("trace_path"),
        "timeline": profile.get("op_timeline"),
    }
