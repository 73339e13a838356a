"""Memory budgets: a committed JSON file of estimated step peaks, and the check that guards them.

A budget is to a training step's memory what a snapshot is to a function's output: the estimate of
one step (:func:`~resource_guard.estimate_memory`) is recorded under a key, committed, and later
estimates of the same key must not grow beyond a tolerance. The file is plain JSON, keys sorted,
two-space indented, one line per figure, so a change reads well in a diff::

    {
      "gpt2-small/t4": {
        "breakdown_bytes": {"activations": 2370070212, ...},
        "device": "cuda",
        "peak_bytes": 4686791964,
        "precision": "16-mixed",
        "target": "as on cuda sm75 (t4), 16-mixed, autocast policy: cuda, attention: efficient×12"
      }
    }

``precision`` and ``device`` (the device kind the step was traced for) identify the estimate: a
budget recorded for another precision or device is refused, not compared. ``target`` records the
target behaviour the trace followed, for the reader of the diff.

The pytest plugin (:mod:`resource_guard.testing.pytest_plugin`) and ``resource-guard preflight
--budget FILE`` both use :func:`check_budget`, :func:`load_budgets` and :func:`save_budgets`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from resource_guard import estimate_memory
    >>> est = estimate_memory(nn.Linear(64, 64), torch.optim.SGD, torch.randn(8, 64),
    ...                       lambda m, b: m(b).sum(), device="cpu")
    >>> budget = Budget.of(est)
    >>> check_budget("linear", est, budget).status
    'ok'
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resource_guard.devices import format_bytes
from resource_guard.errors import ConfigurationError
from resource_guard.estimate import CATEGORIES, MemoryEstimate

__all__ = [
    "DEFAULT_TOLERANCE",
    "STATUSES",
    "Budget",
    "BudgetCheck",
    "check_budget",
    "check_budget_file",
    "check_tolerance",
    "load_budgets",
    "save_budgets",
]

DEFAULT_TOLERANCE = 0.02
"""Growth allowed before a budget fails: 2% of the recorded peak."""

STATUSES = ("ok", "new", "over", "shrank", "mismatch")
"""``ok``: within the tolerance; ``new``: no budget recorded; ``over``: grew beyond the tolerance;
``shrank``: fell by more than the tolerance (passes; an update records the lower figure);
``mismatch``: recorded for another precision or device kind."""


@dataclass(frozen=True)
class Budget:
    """One recorded budget: the step's peak, its breakdown at the peak, and what identifies it.

    Attributes:
        peak_bytes: :attr:`MemoryEstimate.peak_bytes` when the budget was recorded.
        breakdown_bytes: bytes by category at the peak (:data:`~resource_guard.CATEGORIES`).
        precision: the Lightning precision name the step was estimated under.
        device: the device kind the step was traced for (``"cuda"``, ``"cpu"``, ...).
        target: the target behaviour the trace followed (:attr:`MemoryEstimate.assumed_target`).
    """

    peak_bytes: int
    breakdown_bytes: Mapping[str, int]
    precision: str
    device: str
    target: str = ""

    @classmethod
    def of(cls, estimate: MemoryEstimate) -> Budget:
        """The budget an estimate would record."""
        return cls(
            peak_bytes=int(estimate.peak_bytes),
            breakdown_bytes={k: int(v) for k, v in estimate.breakdown.items()},
            precision=estimate.precision,
            device=estimate.device_kind,
            target=estimate.assumed_target,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry (keys sorted when written)."""
        return {
            "breakdown_bytes": dict(sorted(self.breakdown_bytes.items())),
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "precision": self.precision,
            "target": self.target,
        }

    @classmethod
    def from_dict(cls, key: str, entry: Any, path: str | os.PathLike[str]) -> Budget:
        """Read one entry of a budget file, refusing a malformed one with the key and file named."""
        try:
            peak = entry["peak_bytes"]
            breakdown = entry["breakdown_bytes"]
            ok = (
                isinstance(peak, int)
                and isinstance(breakdown, dict)
                and all(isinstance(v, int) for v in breakdown.values())
                and isinstance(entry["precision"], str)
                and isinstance(entry["device"], str)
            )
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise ConfigurationError(
                f"budget file {str(path)!r}: the entry {key!r} must hold integer `peak_bytes`, a "
                "`breakdown_bytes` mapping of integers, and `precision` and `device` strings; "
                "fix it or delete it and record it again with the update option"
            )
        return cls(peak, dict(breakdown), entry["precision"], entry["device"], str(entry.get("target", "")))


@dataclass(frozen=True)
class BudgetCheck:
    """The outcome of comparing an estimate with its budget.

    Attributes:
        key: the budget's key.
        status: one of :data:`STATUSES`; :attr:`passed` is False only for ``over`` and ``mismatch``
            (and ``new`` when a budget was required).
        old_peak_bytes / new_peak_bytes: the recorded and the estimated peak (old is None when new).
        change: ``new / old - 1`` (None when new).
        tolerance: the growth allowed, as a fraction of the recorded peak.
        grew: the category whose bytes grew most, ``(name, old bytes, new bytes)``; None if none grew.
        message: one paragraph for a test failure or the command line.
        budget: the budget this estimate would record.
    """

    key: str
    status: str
    old_peak_bytes: int | None
    new_peak_bytes: int
    change: float | None
    tolerance: float
    grew: tuple[str, int, int] | None
    message: str
    budget: Budget = field(repr=False)

    @property
    def passed(self) -> bool:
        return self.status in ("ok", "shrank")


def check_tolerance(tolerance: Any, call: str) -> float:
    """``tolerance`` as a float in [0, 1), else a :class:`ConfigurationError` quoting ``call``."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ConfigurationError(
            f"`{call}(tolerance={tolerance!r})` must be a fraction of the recorded peak in [0, 1), e.g. 0.02"
        )
    if not math.isfinite(tolerance):
        raise ConfigurationError(f"`{call}(tolerance={tolerance!r})` must be finite")
    return float(tolerance)


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({format_bytes(n)})"


def _pct(old: int, new: int) -> str:
    return f"{(new / old - 1):+.1%}" if old else "+inf%"


def check_budget(
    key: str,
    estimate: MemoryEstimate,
    recorded: Budget | None,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    where: str = "the budget file",
    update_hint: str = "record it with the update option",
) -> BudgetCheck:
    """Compare ``estimate`` with the budget ``recorded`` under ``key``.

    It fails (``over``) when the peak grew by more than ``tolerance`` of the recorded peak, or when one
    category grew by more than that (a shift the peak hides: more activations, fewer temporaries).
    The message names the key, old → new bytes, the change in percent and the category that grew most.

    Args:
        key: the budget's key, quoted in the message.
        estimate: the step's estimate now.
        recorded: the committed budget, or None when there is none.
        tolerance: growth allowed, as a fraction of the recorded peak.
        where: the budget file, named in the message.
        update_hint: how to record the new figures, ending the message.
    """
    tolerance = check_tolerance(tolerance, "check_budget")
    now = Budget.of(estimate)
    new = now.peak_bytes
    if recorded is None:
        msg = f"memory budget {key!r}: no budget recorded in {where} (peak now {_bytes(new)}); {update_hint}."
        return BudgetCheck(key, "new", None, new, None, tolerance, None, msg, now)
    old = recorded.peak_bytes
    change = new / old - 1 if old else (0.0 if new == 0 else math.inf)
    if (recorded.precision, recorded.device) != (now.precision, now.device):
        msg = (
            f"memory budget {key!r} in {where} was recorded for {recorded.precision} on {recorded.device}; "
            f"this estimate is {now.precision} on {now.device}. Use another key for another configuration, "
            f"or {update_hint}."
        )
        return BudgetCheck(key, "mismatch", old, new, change, tolerance, None, msg, now)
    deltas = {
        c: now.breakdown_bytes.get(c, 0) - recorded.breakdown_bytes.get(c, 0)
        for c in sorted({*CATEGORIES, *now.breakdown_bytes, *recorded.breakdown_bytes})
    }
    top = max(deltas, key=lambda c: (deltas[c], c in CATEGORIES))
    grew = (
        (top, recorded.breakdown_bytes.get(top, 0), now.breakdown_bytes.get(top, 0))
        if deltas[top] > 0
        else None
    )
    allowed = tolerance * old
    head = (
        f"memory budget {key!r}: peak {old:,} → {new:,} bytes "
        f"({format_bytes(old)} → {format_bytes(new)}, {_pct(old, new)}"
    )
    if new - old > allowed or (grew is not None and deltas[top] > allowed):
        which = "no category grew (the recorded breakdown does not add up to its peak)"
        if grew is not None:
            name, was, now_bytes = grew
            which = (
                f"{name} grew most: {was:,} → {now_bytes:,} bytes "
                f"({_pct(was, now_bytes)}, {format_bytes(now_bytes - was)} more)"
            )
        msg = (
            f"{head}, tolerance {tolerance:.0%}); {which}. Budget: {where}; "
            f"if the growth is intended, {update_hint}."
        )
        if recorded.target and recorded.target != now.target:
            msg += f" The trace's target changed: {recorded.target!r} → {now.target!r}."
        return BudgetCheck(key, "over", old, new, change, tolerance, grew, msg, now)
    if old - new > allowed:
        msg = f"{head}): below the budget by more than {tolerance:.0%}; {update_hint} to lock in the saving."
        return BudgetCheck(key, "shrank", old, new, change, tolerance, grew, msg, now)
    msg = f"{head}): within the {tolerance:.0%} tolerance."
    return BudgetCheck(key, "ok", old, new, change, tolerance, grew, msg, now)


def load_budgets(path: str | os.PathLike[str]) -> dict[str, Budget]:
    """The budgets in ``path`` (empty when the file does not exist).

    Raises:
        ConfigurationError: the file is not a JSON object of budget entries.
    """
    file = Path(path)
    if not file.exists():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigurationError(f"budget file {str(file)!r} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigurationError(
            f"budget file {str(file)!r} must hold a JSON object of key -> budget, not {type(data).__name__}"
        )
    return {str(k): Budget.from_dict(str(k), v, file) for k, v in data.items()}


def save_budgets(path: str | os.PathLike[str], budgets: Mapping[str, Budget]) -> None:
    """Write ``budgets`` to ``path``: sorted keys, two-space indent, a final newline.

    The file is replaced whole (written beside it, then renamed), so a reader never sees half of it.
    """
    file = Path(path)
    text = json.dumps({k: budgets[k].to_dict() for k in sorted(budgets)}, indent=2, ensure_ascii=False)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, file)


def check_budget_file(
    path: str | os.PathLike[str],
    key: str,
    estimate: MemoryEstimate,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    update: bool = False,
    update_hint: str = "record it with the update option",
) -> BudgetCheck:
    """Check ``estimate`` against the budget under ``key`` in the file ``path``; with ``update``, record it.

    With ``update`` the file is written (created if missing; other keys kept) and the returned check
    still compares with the figures it replaced, so a caller can say what changed.
    """
    budgets = load_budgets(path)
    result = check_budget(
        key, estimate, budgets.get(key), tolerance=tolerance, where=str(path), update_hint=update_hint
    )
    if update:
        save_budgets(path, {**budgets, key: result.budget})
    return result
