"""Predicted gains bounded by construction: the one helper every time rule of the report uses.

A rule measures a part of the step (the data wait, evaluation, the casts) and predicts the step without
it. :func:`bounded_gain` makes that prediction possible whatever was measured:

- the part is clipped to the interval it was measured in (``interval_s``) and to the step, so its share
  of the step is at most 100%;
- the predicted step never falls below ``floor_s``: what the advice does not touch (for a phase rule the
  forward, backward and optimizer, :func:`compute_floor_s`; for the optimizer-step rule the part of the
  optimizer phase it does not remove);
- "about N% faster" and "Nx as fast" are one wording (:func:`faster_text`), computed from the predicted
  step.

Example:
    >>> g = bounded_gain(0.074, 0.117, floor_s=0.05)  # a wait measured longer than the step
    >>> g.share, round(g.predicted_step_s, 3), g.text
    (1.0, 0.05, 'about 48% faster')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "COMPUTE_PHASES",
    "UNMEASURED_FLOOR_SHARE",
    "Gain",
    "bounded_gain",
    "compute_floor_s",
    "faster_text",
]

COMPUTE_PHASES = ("forward", "backward", "optimizer")
"""The phases no schedule, loader or logging advice removes: the step's floor."""
UNMEASURED_FLOOR_SHARE = 0.05
"""Where the floor was not measured (no phases, no op classes), the predicted step keeps this share of the
step: at most 20x as fast, as no advice removes a step's own work entirely."""


@dataclass(frozen=True)
class Gain:
    """What removing a part of the step gains.

    Attributes:
        step_s: the step the share is of.
        part_s: the part, clipped to the interval it was measured in and to the step.
        share: ``part_s / step_s``, in [0, 1].
        removed_s: what the advice removes of the step (``step_s - predicted_step_s``).
        predicted_step_s: the step once the advice is followed, at least the floor.
        floor_s: what the advice does not touch.
        text: ``"about N% faster"`` or ``"N.Nx as fast"``.
    """

    step_s: float
    part_s: float
    share: float
    removed_s: float
    predicted_step_s: float
    floor_s: float
    text: str


def faster_text(step_s: float, predicted_s: float) -> str:
    """The one wording of a speed-up, from the predicted step: below 2× "about N% faster", else "N.N× as
    fast".

    >>> faster_text(0.1, 0.08), faster_text(0.1, 0.04)
    ('about 25% faster', '2.5x as fast')
    """
    ratio = step_s / max(predicted_s, 1e-12)
    return f"{ratio:.1f}x as fast" if ratio >= 2.0 else f"about {ratio - 1.0:.0%} faster"


def compute_floor_s(
    phases: Mapping[str, float] | None, *, without: Mapping[str, float] | None = None
) -> float | None:
    """Forward + backward + optimizer per step (``None`` when the phases were not measured); ``without``
    takes a part off one of them (the optimizer-step rule removes part of the optimizer phase).

    >>> compute_floor_s({"forward": 0.01, "backward": 0.02, "optimizer": 0.01}, without={"optimizer": 0.004})
    0.036
    """
    if not phases:
        return None
    less = without or {}
    return sum(max(0.0, float(phases.get(p) or 0.0) - float(less.get(p) or 0.0)) for p in COMPUTE_PHASES)


def bounded_gain(
    step_s: float,
    part_s: float,
    *,
    interval_s: float | None = None,
    floor_s: float | None = None,
    removable: float = 1.0,
) -> Gain:
    """The gain of removing ``removable`` of ``part_s`` (seconds per step) from a step of ``step_s``.

    Args:
        step_s: the step the share is of (> 0).
        part_s: the measured part; clipped to ``interval_s`` (the interval it was measured in, when not
            the step) and to the step.
        floor_s: the predicted step never falls below it (clipped to the step); ``None`` (not measured):
            :data:`UNMEASURED_FLOOR_SHARE` of the step.
        removable: the fraction of the part the advice removes (a cheaper schedule removes ``1 - 1/k``).

    Example:
        >>> g = bounded_gain(1.17, 1.76)  # casts measured longer than the step: 100%, not 150%
        >>> g.share, g.predicted_step_s > 0
        (1.0, True)
    """
    step = max(float(step_s), 1e-12)
    part = max(0.0, float(part_s))
    if interval_s is not None:
        part = min(part, max(0.0, float(interval_s)))
    part = min(part, step)
    floor = step * UNMEASURED_FLOOR_SHARE if floor_s is None else min(max(0.0, float(floor_s)), step)
    cut = part * min(max(float(removable), 0.0), 1.0)
    predicted = max(step - cut, floor, 1e-9)
    return Gain(
        step_s=step,
        part_s=part,
        share=part / step,
        removed_s=step - predicted,
        predicted_step_s=predicted,
        floor_s=floor,
        text=faster_text(step, predicted),
    )
