"""What the guard writes at the end of a run (``guard.json``): what was planned and what was measured."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from resource_guard.observe.oom import is_oom

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = ["measured_peak_bytes", "run_summary"]


def measured_peak_bytes(device: torch.device | None) -> int | None:
    """The CUDA allocator's peak on ``device``; ``None`` elsewhere (or unreadable)."""
    if device is not None and device.type == "cuda":
        try:
            return int(torch.cuda.max_memory_allocated(device))
        except Exception:
            return None
    return None


def run_summary(
    plan: Plan | None,
    device: torch.device | None,
    *,
    optimizer_steps: int,
    micro_steps: int,
    wall_s: float,
    exc: BaseException | None,
    shapes: Any = None,
) -> dict[str, Any]:
    """The summary dict (peak memory where the device reports it, beside the plan's estimate).

    Example:
        >>> run_summary(None, None, optimizer_steps=2, micro_steps=4, wall_s=1.0, exc=None)["outcome"]
        'ok'
    """
    measured = measured_peak_bytes(device)
    out: dict[str, Any] = {
        "optimizer_steps": optimizer_steps,
        "micro_steps": micro_steps,
        "wall_s": wall_s,
        "outcome": "ok" if exc is None else type(exc).__name__,
        "oom": is_oom(exc),
        "measured_peak_bytes": measured,
    }
    if shapes is not None:
        out["shapes"] = shapes.stats()
    if plan is not None:
        out["plan"] = plan.to_dict()
        out["estimated_peak_bytes"] = plan.fit.allocated_peak_bytes
        if measured is not None and plan.fit.allocated_peak_bytes:
            out["estimate_error"] = plan.fit.allocated_peak_bytes / measured - 1
    return out
