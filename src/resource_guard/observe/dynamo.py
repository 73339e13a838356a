"""torch.compile's recompilations and graph breaks during a run, from dynamo's own counters.

:func:`compile_counters` reads ``torch._dynamo.utils``' process-wide tallies (private: the one place
this package reads them; ``tests/observe/test_dynamo.py`` fails loudly if they move): frames compiled,
graph breaks by reason, the guards that failed (why a frame was recompiled) and the seconds spent
compiling. The monitor reads them at start and at close and keeps the difference: cheap (a few dict
reads), and nothing when dynamo was never imported.

Example:
    >>> a = CompileCounters(frames=1, graph_breaks=0, recompiles=0, compile_s=0.5)
    >>> b = CompileCounters(frames=4, graph_breaks=2, recompiles=3, compile_s=2.0,
    ...                     failed_guards=("0/1: tensor 'x' size mismatch at index 0",))
    >>> d = b.since(a)
    >>> d.recompiles, d.recompile_s
    (3, 1.5)
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CompileCounters", "compile_counters"]

_MAX_REASONS = 5


@dataclass(frozen=True)
class CompileCounters:
    """Dynamo's tallies (or the difference of two readings).

    Attributes:
        frames: frames compiled (first compilations and recompilations).
        graph_breaks: graph breaks.
        recompiles: recompilations (one per failed guard set).
        compile_s: seconds spent compiling.
        failed_guards: the guard failures dynamo recorded, newest last (at most five).
        break_reasons: the most frequent graph-break reasons (at most five).
    """

    frames: int = 0
    graph_breaks: int = 0
    recompiles: int = 0
    compile_s: float = 0.0
    failed_guards: tuple[str, ...] = ()
    break_reasons: tuple[str, ...] = ()

    @property
    def recompile_s(self) -> float:
        """The compile seconds of the recompilations (their share of the frames compiled)."""
        if not self.frames or not self.recompiles:
            return 0.0
        return self.compile_s * min(1.0, self.recompiles / self.frames)

    def since(self, start: CompileCounters) -> CompileCounters:
        """What happened between ``start`` and this reading."""
        guards = self.failed_guards if self.recompiles > start.recompiles else ()
        return CompileCounters(
            frames=max(0, self.frames - start.frames),
            graph_breaks=max(0, self.graph_breaks - start.graph_breaks),
            recompiles=max(0, self.recompiles - start.recompiles),
            compile_s=max(0.0, self.compile_s - start.compile_s),
            failed_guards=guards,
            break_reasons=self.break_reasons if self.graph_breaks > start.graph_breaks else (),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "frames": self.frames,
            "graph_breaks": self.graph_breaks,
            "recompiles": self.recompiles,
            "compile_s": round(self.compile_s, 4),
            "recompile_s": round(self.recompile_s, 4),
            "failed_guards": list(self.failed_guards),
            "break_reasons": list(self.break_reasons),
        }


def compile_counters() -> CompileCounters:
    """Dynamo's tallies now; all zero when ``torch._dynamo`` was never imported (no compile ran)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return CompileCounters()
    counters: Mapping[str, Any] = getattr(utils, "counters", {})
    frames = int(counters.get("frames", {}).get("total", 0))
    breaks = counters.get("graph_break", {})
    failures: Mapping[Any, list[str]] = getattr(utils, "guard_failures", {})
    failed = [reason for reasons in failures.values() for reason in reasons]
    times: Mapping[str, list[float]] = getattr(utils, "compilation_time_metrics", {})
    reasons = sorted(breaks.items(), key=lambda kv: -kv[1])[:_MAX_REASONS]
    return CompileCounters(
        frames=frames,
        graph_breaks=int(sum(breaks.values())),
        recompiles=len(failed),
        compile_s=float(sum(times.get("_compile.compile_inner", ()))),
        failed_guards=tuple(str(r) for r in failed[-_MAX_REASONS:]),
        break_reasons=tuple(f"{str(reason).strip().splitlines()[0]} ({n}x)" for reason, n in reasons),
    )
