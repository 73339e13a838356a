"""The run-time shape guard of both front doors: every batch's shape checked against the plan first.

:class:`ShapeGuard` wraps a :class:`~resource_guard.planning.shapes.ShapeModel`. ``guard(...)`` asks
it for each batch's micro-batch size (:meth:`ShapeGuard.micro_batch_size`): the plan's, or a smaller
one that fits for a batch too big to run whole (the batch is then split; :meth:`Guard.backward`
weights each micro-batch by its rows, so the effective batch and the optimizer steps are unchanged).
The Lightning callback cannot split a batch, so it asks :meth:`ShapeGuard.stop_if_too_big`, which
raises :class:`~resource_guard.errors.DoesNotFitError` before the batch runs, with a
:class:`ShapeReport`.

Under ``torch.distributed`` every rank must take the same decision, and a rank cannot know whether
another rank's batch is new without asking: so each batch's decision is agreed with one all-reduce of
a single integer (the smallest micro-batch size, or "any rank stops"), and only when a process group
with more than one rank is initialised. That is the cheapest scheme that is correct whatever the
ranks' loaders yield; ``benchmarks/shape_model.py`` measures it on gloo.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from resource_guard.planning.planner import plan
    >>> from resource_guard.planning.shapes import ShapeModel
    >>> net, loss = nn.Linear(4, 1), (lambda m, b: m(b).sum())
    >>> made = plan(net, torch.optim.SGD, torch.randn(8, 4), loss, device="cpu", precision="32-true")
    >>> sg = ShapeGuard(ShapeModel(net, torch.optim.SGD, torch.randn(8, 4), loss, made))
    >>> sg.micro_batch_size(torch.randn(8, 4)), sg.stats()["shapes_seen"]
    (8, 1)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from resource_guard.errors import ConfigurationError, DoesNotFitError, warn_at_user
from resource_guard.planning.shapes import ShapeFit, ShapeModel
from resource_guard.planning.worst_case import resize_along, sequence_positions, worst_case_length
from resource_guard.step.training import LossFn, iter_tensors

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = [
    "ShapeGuard",
    "ShapeReport",
    "agree_min",
    "check_worst_case_args",
    "start_shape_guard",
    "worst_case",
]

_MiB = 2**20


@dataclass(frozen=True)
class ShapeReport:
    """Why a batch shape cannot run under the plan, and what would make it run.

    Attributes:
        shape: the :class:`~resource_guard.planning.shapes.ShapeFit` of the batch (its shape, predicted
            peak, usable memory, the largest micro-batch of that shape that fits).
        largest_fitting_shape: the largest shape seen so far that fits (by elements), if any.
        token_budget: the most tokens per micro-batch that fit at this batch's length (rows that fit ×
            length), when the batch has a sequence axis and one row fits.
        remedy: what to change, most effective first.
        rank: the rank whose batch it is (0 without distributed training).
    """

    shape: ShapeFit
    largest_fitting_shape: str | None
    token_budget: int | None
    remedy: tuple[str, ...]
    rank: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape.to_dict(),
            "largest_fitting_shape": self.largest_fitting_shape,
            "token_budget": self.token_budget,
            "remedy": list(self.remedy),
            "rank": self.rank,
        }


def _group() -> tuple[int, int] | None:
    """``(rank, world size)`` of an initialised process group of more than one rank, else None."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def agree_min(value: int) -> int:
    """The smallest ``value`` over the ranks (one all-reduce of one int64); ``value`` without a group."""
    if _group() is None:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return int(flag.item())


class ShapeGuard:
    """Each batch's shape checked against the plan before it runs (module docstring).

    Attributes:
        model: the :class:`~resource_guard.planning.shapes.ShapeModel`.
        splits: batches split into smaller micro-batches than the plan's.
        stops: batches refused before they ran (the run stopped).
        batches: batches checked.
    """

    def __init__(self, model: ShapeModel) -> None:
        self.model = model
        self.splits = 0
        self.stops = 0
        self.batches = 0
        self._split_shapes: dict[str, int] = {}
        self._broken = False
        # the process group exists before a run starts (DDP wraps the model in it): asked once here
        self._distributed = _group() is not None

    def micro_batch_size(self, batch: Any) -> int:
        """Rows per micro-batch for ``batch``: the plan's, or the largest that fits its shape.

        Raises:
            DoesNotFitError: not even one row of this shape fits (every rank raises, under DDP).
        """
        self.batches += 1
        fit = self._check(batch)
        if fit is None:  # our check failed: the plan's size, and still the collective every rank calls
            rows = self.model.plan.micro_batch_size
        else:
            rows = fit.micro_batch_size if fit.fits else (fit.fitting_micro_batch_size or 0)
        agreed = agree_min(rows) if self._distributed else rows
        if agreed < 1:
            self.stops += 1
            raise self._error(fit, rows < 1)
        if fit is not None and agreed < fit.micro_batch_size:
            self.splits += 1
            self._split_shapes[fit.shape] = agreed
        return agreed

    def stop_if_too_big(self, batch: Any) -> None:
        """Raise before ``batch`` runs when its micro-batch does not fit on this or any other rank.

        Raises:
            DoesNotFitError: with a :class:`ShapeReport` (this rank's batch, or the other rank's words).
        """
        self.batches += 1
        fit = self._check(batch)
        mine = fit is not None and not fit.fits
        if (agree_min(int(not mine)) if self._distributed else int(not mine)) == 0:
            self.stops += 1
            raise self._error(fit, mine)

    def _check(self, batch: Any) -> ShapeFit | None:
        """The batch's fit; None (with one warning) when checking it failed: never stops the run."""
        if self._broken:
            return None
        try:
            return self.model.check(batch)
        except Exception as error:
            self._broken = True
            warn_at_user(f"resource_guard: the shape check is off for this run: {error!r}")
            return None

    def report(self, fit: ShapeFit) -> ShapeReport:
        """The :class:`ShapeReport` of a shape that does not fit."""
        fitting = [f for f in self.model.seen.values() if f.fits]
        largest = max(fitting, key=lambda f: sum(s.numel() for s, _ in f.signature), default=None)
        budget = None
        length = _length_of(self.model, fit)
        if length is not None and fit.fitting_micro_batch_size:
            budget = fit.fitting_micro_batch_size * length
        p = self.model.plan
        remedy = []
        if fit.fitting_micro_batch_size and fit.fitting_peak_bytes is not None:
            remedy.append(
                f"a smaller batch: at most {fit.fitting_micro_batch_size} rows per micro-batch of this shape "
                f"({fit.fitting_peak_bytes / _MiB:,.1f} MiB), with accumulation for the same effective batch"
            )
        if budget is not None:
            remedy.append(
                f"a token-budget sampler: at most {budget:,} tokens per micro-batch (rows × length) for "
                f"lengths up to {length}"
            )
        if not p.checkpointing:
            remedy.append("activation checkpointing (`checkpointing=True`)")
        remedy.append("cap the sequence length in the data (`max_seq_len=` tells the plan the worst case)")
        largest_shape = largest.shape if largest is not None else None
        return ShapeReport(fit, largest_shape, budget, tuple(remedy), _rank())

    def _error(self, fit: ShapeFit | None, mine: bool) -> DoesNotFitError:
        if not mine or fit is None:
            return DoesNotFitError(
                "a batch on another rank does not fit under the plan; every rank stops before it "
                "(that rank's error names the shape and the remedy).",
                None,
            )
        report = self.report(fit)
        p = self.model.plan
        where = f" on rank {report.rank}" if self._distributed else ""
        ckpt = "on" if p.checkpointing else "off"
        lines = [
            f"batch shape {fit.shape}{where} would need {fit.predicted_peak_bytes / _MiB:,.1f} MiB per "
            f"micro-batch of {fit.micro_batch_size} ({p.precision}, checkpointing {ckpt}), more than the "
            f"{fit.usable_bytes / _MiB:,.1f} MiB usable on {p.device.name}: stopped before it ran "
            f"(figure: {fit.source}).",
            f"largest shape seen that fits: {report.largest_fitting_shape or 'none'}",
            *(f"- {r}" for r in report.remedy),
        ]
        return DoesNotFitError("\n".join(lines), report)

    def stats(self) -> dict[str, Any]:
        """Shapes seen, splits made and stops avoided: JSON-ready, for the report."""
        seen = list(self.model.seen.values())
        return {
            "shapes_seen": len(seen),
            "batches_checked": self.batches,
            "splits": self.splits,
            "stops": self.stops,
            "traces": self.model.traces,
            "shapes": [f.to_dict() for f in seen[:32]],
            "split_shapes": dict(self._split_shapes),
        }


def _length_of(model: ShapeModel, fit: ShapeFit) -> int | None:
    """The sequence length of a checked shape (dim 1 of its first tensor of two dimensions or more)."""
    sample = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in fit.signature]
    positions = sequence_positions(sample)
    if not positions:
        return None
    index, dim = min(positions)
    return int(fit.signature[index][0][dim])


def _rank() -> int:
    group = _group()
    return group[0] if group is not None else 0


def check_worst_case_args(call: str, max_seq_len: Any, check_shapes: Any) -> None:
    """Refuse bad ``max_seq_len`` / ``check_shapes`` arguments, quoting ``call``."""
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1
    ):
        raise ConfigurationError(f"`{call}(max_seq_len={max_seq_len!r})` must be a positive int or None.")
    if not isinstance(check_shapes, bool):
        raise ConfigurationError(f"`{call}(check_shapes={check_shapes!r})` must be True or False.")


def worst_case(
    batch: Any, max_seq_len: int | None, worst_case_batch: Any, loader: Any = None
) -> tuple[Any, str] | None:
    """The largest batch the run can produce, and where that was learnt; None when not knowable.

    ``worst_case_batch`` as given; else ``batch`` made ``max_seq_len`` long along its sequence axis;
    else as long as the loader's declared longest sequence
    (:func:`~resource_guard.planning.worst_case.worst_case_length`). None when that is no longer than
    ``batch``.
    """
    if worst_case_batch is not None:
        return worst_case_batch, "worst_case_batch="
    found = (max_seq_len, f"max_seq_len={max_seq_len}") if max_seq_len is not None else None
    if found is None and loader is not None:
        found = worst_case_length(loader)
    positions = sequence_positions(batch)
    if found is None or not positions:
        return None
    length, source = found
    tensors = iter_tensors(batch)
    index, dim = min(positions)
    if length <= tensors[index].shape[dim]:
        return None
    return resize_along(batch, positions, length), source


def start_shape_guard(
    model: torch.nn.Module,
    optimizer: Any,
    batch: Any,
    loss_fn: LossFn | None,
    plan: Plan,
    max_seq_len: int | None = None,
    worst_case_batch: Any = None,
    *,
    loader: Any = None,
    traced_plan: bool = True,
    trace_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    whole_batches: bool = False,
) -> tuple[ShapeGuard, list[str]]:
    """The shape guard of a run planned on ``batch``, with the worst case checked before any step.

    The plan's checkpointing is taken as already applied to ``model``; ``whole_batches``: the loop runs
    each batch whole (an unchanged loop), so a batch is checked at all its rows. Returns the guard and
    the lines for the plan's reasons (what the worst case needs, and how such a batch is split).

    Raises:
        DoesNotFitError: not even one row of the worst case fits (with a :class:`ShapeReport`).
    """
    model_ = ShapeModel(
        model, optimizer, batch, loss_fn, plan, checkpoint_applied=True, traced_plan=traced_plan,
        trace_context=trace_context, whole_batches=whole_batches,
    )  # fmt: skip
    shapes = ShapeGuard(model_)
    notes: list[str] = []
    worst = worst_case(batch, max_seq_len, worst_case_batch, loader)
    if worst is None:
        return shapes, notes
    big, source = worst
    fit = shapes._check(big)
    if fit is None:  # the check failed (warned): the run goes on with the plan's sizes
        return shapes, notes
    head = f"worst case {fit.shape} ({source}): {fit.predicted_peak_bytes / _MiB:,.1f} MiB"
    if fit.fits:
        notes.append(f"{head} at micro-batch {fit.micro_batch_size}: fits")
    elif fit.fitting_micro_batch_size and fit.fitting_peak_bytes is not None:
        report = shapes.report(fit)
        budget = f"; token budget {report.token_budget:,} per micro-batch" if report.token_budget else ""
        notes.append(
            f"{head} at micro-batch {fit.micro_batch_size}, over {fit.usable_bytes / _MiB:,.1f} MiB usable: "
            f"such batches run as micro-batches of {fit.fitting_micro_batch_size} "
            f"({fit.fitting_peak_bytes / _MiB:,.1f} MiB){budget}"
        )
    else:
        shapes.stops += 1
        raise shapes._error(fit, True)
    return shapes, notes
