"""A step's device total over (rows, length), fitted on traced points: exact, or not trusted.

Used by :class:`~resource_guard.planning.shapes.ShapeModel`; see :class:`Surface`.
"""

from __future__ import annotations

import math

import numpy as np

from resource_guard.estimate import DeviceFit, MemoryEstimate
from resource_guard.estimate.allocation.later_step import later_step

__all__ = ["EXACT_BYTES", "MAX_PROFILE", "Surface", "profile_of"]

EXACT_BYTES = 4096
"""A fit whose points all lie within this many bytes of it is exact (tensor bytes are integers)."""
MAX_PROFILE = 200_000
"""Allocation events kept per traced point for the piecewise fit (more: the timeline's points)."""


class Surface:
    """A step's device total over (rows, length): least squares on traced points, trusted when exact.

    Basis: ``rows^i · length^j`` for ``i ≤ 1``, ``j ≤ 2``, each capped by the distinct values traced
    less one; a fit needs one point more than its coefficients, and is trusted only when every point
    lies on it within :data:`EXACT_BYTES`.

    Piecewise: a step's peak is the highest point of its memory curve, and which operator holds it
    changes with the shape (the vocabulary's log-softmax at short lengths, attention's ``s²`` scores
    at long ones). Given each point's ``profile`` (:func:`profile_of`: the live bytes after every
    allocation event, the same operators in the same order for every shape), every entry gets its own
    polynomial and the peak is their maximum, so a max of polynomials is fitted exactly; the device's
    own addition (total less the profile's peak: allocator, extrapolated blocks) is one polynomial
    more.

    Example:
        >>> s = Surface()
        >>> for r in (2, 4):
        ...     for n in (8, 16, 32):
        ...         s.add(r, n, 1000 + r * (3 * n + n * n))
        >>> s.add(4, 24, 1000 + 4 * (3 * 24 + 24 * 24))
        >>> exact = 1000 + 3 * (3 * 20 + 20 * 20)  # a shape it did not trace
        >>> s.trusted, 0 <= s.predict(3, 20) - exact <= s.margin_bytes + 1  # rounded up
        (True, True)
    """

    def __init__(self) -> None:
        self.points: dict[tuple[int, int], int] = {}
        self.trusted = False
        self.margin_bytes = 0
        self._profiles: dict[tuple[int, int], tuple[int, ...] | None] = {}
        self._terms: list[tuple[int, int]] = []
        self._coef: np.ndarray | None = None
        self._piecewise = False
        self._scale = (1.0, 1.0)

    def add(self, rows: int, length: int, total: int, profile: tuple[int, ...] | None = None) -> None:
        """Add a traced point: its device total and, for a piecewise fit, its ``profile``.

        A point whose profile has another length than the points before it ran other operators (a
        batch of one row skips some broadcasts): it is left out, and its shape stays a traced one.
        """
        lengths = {len(p) if p else 0 for p in self._profiles.values()}
        if lengths and lengths != {len(profile) if profile else 0}:
            return
        self.points[(rows, length)] = int(total)
        self._profiles[(rows, length)] = profile
        self._refit()

    @property
    def box(self) -> tuple[int, int, int, int]:
        """``(rows_min, rows_max, length_min, length_max)`` of the traced points."""
        rs = [r for r, _ in self.points]
        ns = [n for _, n in self.points]
        return min(rs), max(rs), min(ns), max(ns)

    def _refit(self) -> None:
        rows = sorted({r for r, _ in self.points})
        lengths = sorted({n for _, n in self.points})
        i_max, j_max = min(1, len(rows) - 1), min(2, len(lengths) - 1)
        self._terms = [(i, j) for i in range(i_max + 1) for j in range(j_max + 1)]
        self.trusted = False
        if len(self.points) <= len(self._terms):
            return
        self._scale = (float(rows[-1]), float(lengths[-1]))
        keys = list(self.points)
        a = np.array([self._row(r, n) for r, n in keys])
        totals = np.array([float(self.points[k]) for k in keys])
        profiles = [self._profiles[k] for k in keys]
        sizes = {len(p) if p else 0 for p in profiles}
        self._piecewise = len(sizes) == 1 and 0 not in sizes
        if self._piecewise:
            timeline = np.array(profiles, dtype=np.float64)
            y = np.column_stack([timeline, totals - timeline.max(axis=1)])
        else:
            y = totals[:, None]
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        worst = float(np.max(np.abs(a @ coef - y)))
        self._coef = coef
        self.trusted = worst <= EXACT_BYTES
        self.margin_bytes = int(math.ceil(2 * worst)) + 1

    def _row(self, rows: float, length: float) -> np.ndarray:
        r, n = rows / self._scale[0], length / self._scale[1]
        return np.array([r**i * n**j for i, j in self._terms])

    def predict(self, rows: int, length: int) -> int:
        """The fitted total, rounded up, plus the margin (requires :attr:`trusted`)."""
        assert self._coef is not None
        values = self._row(rows, length) @ self._coef
        value = float(values[:-1].max() + values[-1]) if self._piecewise else float(values[0])
        return int(math.ceil(value)) + self.margin_bytes


def profile_of(estimate: MemoryEstimate, fit: DeviceFit) -> tuple[int, ...] | None:
    """The live bytes at each point of an estimate's step, as ``for_device`` counts its peak.

    Points come in the same order for every shape of one model (the same operators run), so each
    entry is one polynomial in the shape and the step's peak is their maximum. Traced whole: the
    running total after each allocation event, rewritten for a micro-step that starts with the
    gradients allocated as :func:`~resource_guard.estimate.allocation.later_step.later_step` does.
    Extrapolated
    from shallow blocks (or more than :data:`MAX_PROFILE` events): the timeline, which stands for the
    whole model, and for such a later micro-step its forward and backward points again with every
    gradient allocated (as :func:`~resource_guard.estimate.allocation.later_step.later_peak_from_timeline`).
    """
    events, initial = list(estimate.allocations), list(estimate.initial_allocations)
    later = "a later step" in " ".join(fit.notes)
    extrapolated = getattr(estimate, "allocator_overhead", None) is not None
    if events and not extrapolated and len(events) <= MAX_PROFILE:
        if later:
            grads = getattr(estimate, "gradient_allocations", ())
            initial, events = later_step(events, initial, grads)
        running = np.cumsum(np.fromiter((b for _, b in events), dtype=np.int64, count=len(events)))
        return tuple((running + sum(b for _, b in initial)).tolist())
    timeline = estimate.timeline
    if not timeline:
        return None
    sums = [sum(sizes) for _, sizes in timeline]
    if not later:
        return tuple(sums)
    from resource_guard.estimate.trace.tracer import CATEGORIES

    g = CATEGORIES.index("gradients")
    grads = max(sizes[g] for _, sizes in timeline)
    again = [sum(sizes) - sizes[g] + grads for phase, sizes in timeline if phase in ("forward", "backward")]
    return tuple(sums + again)
