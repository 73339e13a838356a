"""Two runs side by side: step time, phases, memory and findings, and what changed most
(:func:`compare_reports`); the Compare view of the tab and ``resource-guard compare RUN_A RUN_B``.

Example:
    >>> a = {"summary": {"step_time_s": 0.2, "phases": {"forward": 0.1, "backward": 0.1}}, "findings": []}
    >>> b = {"summary": {"step_time_s": 0.3, "phases": {"forward": 0.1, "backward": 0.2}}, "findings": []}
    >>> compare_reports(a, b)["changed_phase"]
    'backward'
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resource_guard.report.types import PHASES
from resource_guard.tensorboard_plugin.views import PHASE_LABELS, MiB, verdict_words

__all__ = ["compare_reports", "compare_text", "load_report"]


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
