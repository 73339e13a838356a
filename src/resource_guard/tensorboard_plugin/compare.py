"""Two runs side by side: step time, phases, memory and findings, and what changed most
(:func:`compare_reports`); the Compare view of the tab and ``resource-guard compare RUN_A RUN_B``.

Example:
    >>> a = {"summary": {"step_time_s": 0.2, "phases": {"forward": 0.1, "backward": 0.1}}, "findings": []}
    >>> b = {"summary": {"step_time_s": 0.3, "phases": {"forward": 0.1, "backward": 0.2}}, "findings": []}
    >>> compare_reports(a, b)["changed_phase"]
    'backward'
    >>> step_gate(a, b, 0.10)
    (False, 'step time 200.0 -> 300.0 ms: +50.0%, over the +10.0% allowed')

The speed gate (:func:`step_gate`) is the CI check beside the memory budget: ``resource-guard compare
BASE NEW --max-step-regression 10%`` exits 1 when NEW's mean step time is more than 10% above BASE's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resource_guard.report.types import PHASES
from resource_guard.tensorboard_plugin.views import PHASE_LABELS, MiB, verdict_words

__all__ = ["compare_reports", "compare_text", "load_report", "parse_regression", "step_gate"]


def _delta(a: float | None, b: float | None, scale: float) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        "a": None if a is None else round(a * scale, 3),
        "b": None if b is None else round(b * scale, 3),
        "delta": None,
        "delta_pct": None,
    }
    if a is not None and b is not None:
        out["delta"] = round((b - a) * scale, 3)
        out["delta_pct"] = round((b / a - 1) * 100, 2) if a else None
    return out


def compare_reports(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """What changed from run ``a`` to run ``b`` (two ``report.json`` dicts): step time (ms), each phase
    (ms per step, largest change first), memory (MiB) and the findings that appeared, went or stayed."""
    sa: Mapping[str, Any] = a.get("summary") or {}
    sb: Mapping[str, Any] = b.get("summary") or {}
    pa: Mapping[str, float] = sa.get("phases") or {}
    pb: Mapping[str, float] = sb.get("phases") or {}
    phases: list[dict[str, Any]] = [
        {"phase": p, "label": PHASE_LABELS[p], **_delta(pa.get(p, 0.0), pb.get(p, 0.0), 1000.0)}
        for p in PHASES
        if pa.get(p) or pb.get(p)
    ]
    phases.sort(key=lambda r: -abs(r["delta"] or 0.0))
    changed = phases[0]["phase"] if phases and phases[0]["delta"] else None
    fa = {f["id"]: f for f in a.get("findings") or ()}
    fb = {f["id"]: f for f in b.get("findings") or ()}
    findings = [
        {
            "id": fid,
            "status": "both" if fid in fa and fid in fb else "gone" if fid in fa else "new",
            "title_a": fa[fid]["title"] if fid in fa else None,
            "title_b": fb[fid]["title"] if fid in fb else None,
        }
        for fid in [*fa, *(k for k in fb if k not in fa)]
    ]
    step = _delta(sa.get("step_time_s"), sb.get("step_time_s"), 1000.0)
    memory = {
        "peak_mib": _delta(sa.get("peak_memory_bytes"), sb.get("peak_memory_bytes"), 1 / MiB),
        "estimate_mib": _delta(sa.get("estimated_peak_bytes"), sb.get("estimated_peak_bytes"), 1 / MiB),
    }
    return {
        "step_ms": step,
        "phases": phases,
        "changed_phase": changed,
        "changed_phase_label": PHASE_LABELS[changed] if changed else None,
        "memory": memory,
        "findings": findings,
        "verdict_a": verdict_words(a),
        "verdict_b": verdict_words(b),
        "headline": _headline(step, phases[0] if changed else None),
    }


def _headline(step: Mapping[str, Any], phase: Mapping[str, Any] | None) -> str:
    if step["delta"] is None:
        return "Step time not measured in both runs."
    words = f"Step time {step['a']:.1f} → {step['b']:.1f} ms ({_signed(step['delta_pct'], '%')})"
    if phase is not None:
        words += f"; {phase['label']} changed most ({_signed(phase['delta'], ' ms')} per step)"
    return words + "."


def _signed(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:+.1f}{unit}"


def load_report(path: str | Path) -> dict[str, Any] | None:
    """``report.json`` of a run: the file, the run's directory, or the newest below a log dir."""
    from resource_guard.report.findings import _find_report
    from resource_guard.tensorboard_plugin.runs import read_json

    p = Path(path)
    found = p if p.is_file() else _find_report(p) if p.is_dir() else None
    return None if found is None else read_json(found)


def compare_text(a: Mapping[str, Any], b: Mapping[str, Any], name_a: str = "A", name_b: str = "B") -> str:
    """:func:`compare_reports` for the terminal: the headline, then phases, memory and findings."""
    c = compare_reports(a, b)
    lines = [c["headline"], f"  A {name_a}: {c['verdict_a']}", f"  B {name_b}: {c['verdict_b']}", ""]
    lines.append(f"{'':28}{'A':>12}{'B':>12}{'change':>14}")
    lines.append(_row("step (ms)", c["step_ms"], " ms"))
    lines.extend(_row(f"  {r['label']} (ms)", r, " ms") for r in c["phases"])
    lines.append(_row("peak memory (MiB)", c["memory"]["peak_mib"], " MiB"))
    lines.append(_row("estimate (MiB)", c["memory"]["estimate_mib"], " MiB"))
    lines.append("")
    for f in c["findings"]:
        title = f["title_b"] if f["status"] != "gone" else f["title_a"]
        lines.append(f"{f['status']:>5}  {f['id']}: {title}")
    return "\n".join(lines)


def _row(label: str, d: Mapping[str, Any], unit: str) -> str:
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:,.2f}"

    return f"{label:28}{cell(d['a']):>12}{cell(d['b']):>12}{_signed(d['delta'], unit):>14}"


def parse_regression(text: str) -> float:
    """The step-time regression allowed, as a fraction: ``"10%"`` or ``"0.1"`` -> 0.1.

    Raises ``ValueError`` (with the accepted forms) for anything else: a negative value, a bare number
    above 1 (``"10"`` is ambiguous: write ``"10%"``), or text that is not a number.

    >>> parse_regression("10%"), parse_regression("0.25"), parse_regression("2.5 %")
    (0.1, 0.25, 0.025)
    """
    raw = str(text).strip()
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1].strip() if percent else raw)
    except ValueError:
        value = math.nan
    if percent:
        value /= 100.0
    if not (math.isfinite(value) and value >= 0) or (not percent and value > 1):
        raise ValueError(
            f"{text!r} is not a step-time regression: write a percentage (10%) or a fraction (0.1)"
        )
    return value


def _step_time(report: Mapping[str, Any], name: str) -> float:
    value = (report.get("summary") or {}).get("step_time_s")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(
            f"the {name} run has no measured step time (summary.step_time_s is {value!r}): "
            "compare the reports of two runs that trained at least two steps"
        )
    return float(value)


def step_gate(a: Mapping[str, Any], b: Mapping[str, Any], max_regression: float) -> tuple[bool, str]:
    """``(passed, one line)``: whether run ``b``'s mean step time is at most ``1 + max_regression``
    times run ``a``'s (two ``report.json`` dicts). Raises ``ValueError`` when either run has no
    measured step time (a run that took no step, or not a report of a training run)."""
    ta, tb = _step_time(a, "base"), _step_time(b, "new")
    change = tb / ta - 1.0
    passed = change <= max_regression
    words = f"step time {ta * 1e3:.1f} -> {tb * 1e3:.1f} ms: {change:+.1%}"
    return passed, words + (
        f", within the +{max_regression:.1%} allowed"
        if passed
        else f", over the +{max_regression:.1%} allowed"
    )
