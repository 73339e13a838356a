"""Where a step's wall time goes: :class:`PhaseClock`, the framework-free core both front doors drive.

The clock always runs one phase (one of :data:`~resource_guard.report.types.PHASES`); a front door
switches it at its own boundaries (the loader's ``__next__``, the forward, ``backward``, the optimizer
step, evaluation, a checkpoint save, logging). Each switch charges the time since the previous switch
to the phase that was running, so the phases add up to the wall time by construction; a nested phase
(a checkpoint saved inside evaluation) is ``previous = clock.switch("checkpoint")`` …
``clock.switch(previous)``. A switch is one ``time.perf_counter()`` call and a dict update — about a
microsecond — and never touches a device: on CUDA the host-side edges are what is timed (the host
waits on the device only where the user's code itself syncs), which is what the step's wall time is
made of.

Example:
    >>> ticks = iter([0.0, 1.0, 3.0, 3.5, 4.0])
    >>> clock = PhaseClock(now=0.0, clock=lambda: next(ticks))
    >>> clock.switch("data_wait")  # 0 s of "other" so far
    'other'
    >>> _ = clock.switch("forward"); _ = clock.switch("backward"); _ = clock.switch("other")
    >>> totals = clock.take(4.0)
    >>> totals["data_wait"], totals["forward"], totals["backward"], totals["other"]
    (1.0, 2.0, 0.5, 0.5)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from resource_guard.report.types import PHASES

__all__ = ["PhaseClock", "phase_means", "timed"]


class PhaseClock:
    """Charges wall time to the phase that is running; see the module docstring.

    Args:
        now: the start time (``clock()`` by default).
        clock: the time source (``time.perf_counter``).
    """

    __slots__ = ("_clock", "_current", "_mark", "_totals")

    def __init__(self, now: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._mark = clock() if now is None else now
        self._current = "other"
        self._totals = dict.fromkeys(PHASES, 0.0)

    @property
    def current(self) -> str:
        """The phase running now."""
        return self._current

    def switch(self, phase: str) -> str:
        """Charge the time since the last switch to the running phase, run ``phase``; return the old one.

        Raises:
            KeyError: ``phase`` is not one of ``PHASES`` (a front door's bug, not the user's).
        """
        now = self._clock()
        previous = self._current
        self._totals[previous] += now - self._mark
        self._totals[phase] += 0.0  # an unknown phase fails here, before it is running
        self._mark, self._current = now, phase
        return previous

    def switch_at(self, phase: str, when: float) -> str:
        """:meth:`switch` as of ``when`` (a time stamp taken earlier, not before the last switch)."""
        previous = self._current
        self._totals[previous] += when - self._mark
        self._totals[phase] += 0.0
        self._mark, self._current = when, phase
        return previous

    def charge(self, now: float) -> None:
        """Charge the time up to ``now`` to the running phase (it keeps running)."""
        self._totals[self._current] += now - self._mark
        self._mark = now

    def charge_to(self, phase: str, then: str | None = None) -> None:
        """Charge the time since the last switch to ``phase``, not to the running phase: for a span a
        framework announces only at its end (the Trainer's ``on_save``). The running phase keeps running,
        or ``then`` runs from now.

        Raises:
            KeyError: ``phase`` or ``then`` is not one of ``PHASES``.
        """
        now = self._clock()
        self._totals[phase] += now - self._mark
        if then is not None:
            self._totals[then] += 0.0
            self._current = then
        self._mark = now

    def skip(self, now: float) -> None:
        """Leave the time since the last switch out (the monitor's own work at a log boundary)."""
        self._mark = now

    def hold(self) -> dict[str, float]:
        """The totals as of the last switch or charge, for :meth:`drop_since`."""
        return dict(self._totals)

    def drop_since(self, held: dict[str, float], now: float) -> None:
        """Leave the time since ``held`` (a :meth:`hold` since the last ``take``) out of every phase; the
        running phase keeps running."""
        self._totals = dict(held)
        self._mark = now

    def take(self, now: float) -> dict[str, float]:
        """Seconds by phase since the previous ``take`` (the running phase charged up to ``now``)."""
        self._totals[self._current] += now - self._mark
        self._mark = now
        totals, self._totals = self._totals, dict.fromkeys(PHASES, 0.0)
        return totals


@contextmanager
def timed(clock: PhaseClock | None, phase: str) -> Iterator[None]:
    """Run the block as ``phase`` (nothing when ``clock`` is ``None``), then the phase that was running.

    Example:
        >>> clock = PhaseClock()
        >>> with timed(clock, "checkpoint"):
        ...     clock.current
        'checkpoint'
        >>> clock.current
        'other'
    """
    if clock is None:
        yield
        return
    previous = clock.switch(phase)
    try:
        yield
    finally:
        clock.switch(previous)


def phase_means(
    totals: Mapping[str, float], steps: int, step_time_s: float | None
) -> dict[str, float] | None:
    """Mean seconds per step by phase, ``other`` made the remainder so that they add up to ``step_time_s``.

    Returns ``None`` without steps. When the measured phases exceed the step time (clock edges that
    straddle a log boundary), they are scaled down to it.

    Example:
        >>> phase_means({"forward": 2.0, "backward": 4.0}, steps=2, step_time_s=4.0)["other"]
        1.0
    """
    if steps <= 0:
        return None
    means = {p: max(0.0, float(totals.get(p, 0.0))) / steps for p in PHASES}
    known = sum(v for p, v in means.items() if p != "other")
    if step_time_s is None:
        step_time_s = known + means["other"]
    if known > step_time_s > 0:
        scale = step_time_s / known
        means = {p: v * scale for p, v in means.items()}
        known = step_time_s
    means["other"] = max(0.0, step_time_s - known)
    return means
