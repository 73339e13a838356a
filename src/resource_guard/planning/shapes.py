"""The step's memory for every batch shape a run produces: a cache, a fitted model, and traces.

:class:`ShapeModel` answers, for a batch about to run under a :class:`~resource_guard.Plan`, whether
its micro-batch fits the plan's device, and if not, the largest micro-batch of that shape that does.
The figure it decides on is the planner's own (:class:`~resource_guard.planning.search.Tracer`): the
target device's view from ``for_device`` (allocator rounding and segments, context, workspace) at the
plan's precision, checkpointing, strategy and accumulation, with the plan's headroom.

How a signature (:func:`~resource_guard.planning.worst_case.signature_of`) is answered:

1. **Cache**: a signature seen before costs one dict lookup.
2. **Model**: the signature differs from the plan's sample batch in its rows and along one axis of
   dimensions that vary together (a sequence length, an image side). Along that axis every point of
   the step's memory curve is a polynomial, linear in the rows and at most quadratic in the length
   (attention's ``s²`` on the math path, linear elsewhere), and the peak is their maximum:
   piecewise (:class:`~resource_guard.planning.surface.Surface`). Two regimes are fitted apart, as
   the planner fits them: the plan's own micro-batch, and micro-steps that start with the gradients
   allocated (fewer rows, accumulation).
   Each is learnt when its third length is seen (the plan's and two more): traced at those lengths
   (rows ``{m}``, or two row counts in the accumulating regime) and at one point more than the fit
   has coefficients. It is trusted only while every traced point lies on it within
   :data:`~resource_guard.planning.surface.EXACT_BYTES` (exact), and only inside the box of rows and
   lengths it traced; below the box the figure at its lower edge is used (a step's memory does not
   shrink as its batch grows). The figure it gives is the fit rounded up plus twice its largest
   residual (a few bytes).
3. **Trace**: anything else (outside the box, two axes varying apart, a new structure, a regime
   whose fit is not exact: allocator segments on a GPU target, for one): the batch itself is traced,
   exactly; a new length is added to the model, which extends its box when the point agrees with the
   fit (verified by that extra point).

A micro-batch that does not fit is searched down as the planner searches (:func:`search_largest`
over the divisors of its rows), so the largest micro-batch of that shape that fits is a traced fit.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from resource_guard.planning.planner import plan
    >>> emb = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))
    >>> loss = lambda m, b: nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten())
    >>> sample = torch.randint(0, 64, (4, 8))
    >>> p = plan(emb, torch.optim.SGD, sample, loss, device="cpu", precision="32-true")
    >>> shapes = ShapeModel(emb, torch.optim.SGD, sample, loss, p)
    >>> shapes.check(torch.randint(0, 64, (4, 8))).source
    'plan'
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from resource_guard.planning.checkpointing import find_checkpoint_blocks
from resource_guard.planning.planner import Plan
from resource_guard.planning.search import Candidate, Tracer, search_largest
from resource_guard.planning.strategy import SHARDED, unit_param_bytes
from resource_guard.planning.surface import Surface, profile_of
from resource_guard.planning.worst_case import (
    Position,
    Signature,
    describe_signature,
    resize_along,
    signature_of,
)
from resource_guard.step.batching import divisors
from resource_guard.step.training import LossFn, OptimizerArg, batch_size_of

__all__ = ["ShapeFit", "ShapeModel"]


@dataclass(frozen=True)
class ShapeFit:
    """What a batch of one signature needs under the plan.

    Attributes:
        shape: the signature in words (``"8×513 int64, 8×513 int64"``).
        rows: the batch's rows (its leading dimension).
        micro_batch_size: rows per micro-batch under the plan (``min(rows, plan micro-batch)``).
        predicted_peak_bytes: the device total per rank at that micro-batch (an upper bound when
            ``source`` is ``"model"`` or ``"bound"``).
        usable_bytes: the plan's usable memory (capacity less headroom).
        fits: ``predicted_peak_bytes <= usable_bytes``.
        source: ``"plan"`` (the plan's own trace), ``"traced"``, ``"model"`` (the fitted polynomial)
            or ``"bound"`` (the model's figure at the edge of its box, for a smaller shape).
        fitting_micro_batch_size: the largest micro-batch of this shape that fits (traced): equal to
            ``micro_batch_size`` when it fits, smaller when the batch must be split, ``None`` when not
            even one row fits.
        fitting_peak_bytes: the device total at ``fitting_micro_batch_size`` (``None`` with it).
        signature: the ``(shape, dtype)`` key.
    """

    shape: str
    rows: int
    micro_batch_size: int
    predicted_peak_bytes: int
    usable_bytes: int
    fits: bool
    source: str
    fitting_micro_batch_size: int | None
    fitting_peak_bytes: int | None = None
    signature: Signature = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "rows": self.rows,
            "micro_batch_size": self.micro_batch_size,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "source": self.source,
            "fitting_micro_batch_size": self.fitting_micro_batch_size,
            "fitting_peak_bytes": self.fitting_peak_bytes,
        }


class ShapeModel:
    """Fit checks of batch shapes under one plan (module docstring): cache, model, trace.

    Args:
        model, optimizer, loss_fn: as the plan was made with.
        sample_batch: the batch the plan was made on.
        plan: the :class:`~resource_guard.Plan` the run follows.
        checkpoint_applied: the plan's checkpointing is already switched on in ``model`` (the front
            doors apply it); traces then leave the model as it is.
        traced_plan: ``plan.fit`` is the trace of ``sample_batch`` at the plan's micro-batch (False for
            a plan whose figures are another rank's: then that shape is traced too).
        trace_context: entered around every trace (the Lightning callback detaches the Trainer).

    Attributes:
        traces: estimate traces made so far (the plan's own not counted).
        seen: every signature checked, with its :class:`ShapeFit`, in the order first seen.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerArg,
        sample_batch: Any,
        loss_fn: LossFn | None,
        plan: Plan,
        *,
        checkpoint_applied: bool = False,
        traced_plan: bool = True,
        trace_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        whole_batches: bool = False,
    ) -> None:
        self.model, self.optimizer, self.loss_fn, self.plan = model, optimizer, loss_fn, plan
        # an unchanged loop runs each batch whole: its micro-batch is the batch, not the plan's
        self._whole = whole_batches
        self._sample = sample_batch
        self._base = signature_of(sample_batch)
        self._micro = plan.micro_batch_size
        self._per_rank = plan.micro_batch_size * plan.accumulation_steps
        self._ckpt: bool | int = 0 if checkpoint_applied else plan.checkpoint_every
        self._context = trace_context or contextlib.nullcontext
        self._blocks = find_checkpoint_blocks(model)
        self._units = unit_param_bytes(model, plan.precision)
        self._tracers: dict[tuple[frozenset[Position], int], Tracer] = {}
        self.seen: dict[Signature, ShapeFit] = {}
        self._surfaces: dict[tuple[frozenset[Position], bool], Surface] = {}
        self._others: list[Tracer] = []
        self._learned: set[tuple[frozenset[Position], bool]] = set()
        self._plan_traces = 0
        rows = batch_size_of(sample_batch) or self._micro
        micro = rows if whole_batches else min(rows, self._micro)
        if traced_plan and micro == self._micro:  # the plan's traced figure is this signature's
            total = plan.fit.device_total_bytes
            self.seen[self._base] = self._fit_from(self._base, rows, micro, total, "plan")

    @property
    def traces(self) -> int:
        return sum(t.count for t in (*self._tracers.values(), *self._others))

    @property
    def usable_bytes(self) -> int:
        return self.plan.fit.usable_bytes

    # -- the question ------------------------------------------------------------------------------
    def check(self, batch: Any) -> ShapeFit:
        """The :class:`ShapeFit` of ``batch``: cached, predicted, or traced (module docstring)."""
        signature = signature_of(batch)
        found = self.seen.get(signature)
        if found is None:
            found = self.seen[signature] = self._decide(batch, signature)
        return found

    def predict(self, rows: int, length: int, positions: frozenset[Position]) -> int | None:
        """The model's upper bound of the device total at ``rows`` × ``length``; None if it cannot vouch."""
        surface = self._surfaces.get((positions, self._kept(rows)))
        if surface is None or not surface.trusted:
            return None
        r_lo, r_hi, n_lo, n_hi = surface.box
        if rows > r_hi or length > n_hi:
            return None
        return surface.predict(max(rows, r_lo), max(length, n_lo))

    def learn(self, positions: frozenset[Position], lengths: tuple[int, ...], kept: bool = False) -> Surface:
        """Trace the design points along ``positions``: ``lengths`` × two row counts, and one check.

        ``kept``: the regime of micro-steps that start with the gradients allocated (accumulation);
        without accumulation only the plan's micro-batch ``m`` runs in the other regime, so its rows
        are ``{m}``; in the accumulating regime ``{m, m/2}`` (or ``{m/2, m-1}`` below a plan that
        does not accumulate: a batch of one row is only bounded, by the box's edge).
        """
        surface = self._surface(positions, kept)
        m = self._micro
        if not kept:
            row_values = [m]
        elif m < self._per_rank:
            row_values = sorted({m, max(1, m // 2)})
        else:  # below a plan that does not accumulate; a single row runs other operators
            row_values = sorted({max(2, m // 2), m - 1}) if m >= 3 else [1]
        n = sorted(set(lengths))
        for length in n:
            for rows in row_values:
                self._point(positions, length, rows, kept)
        if len(n) >= 2 and not surface.trusted:  # one point more than the coefficients
            self._point(positions, (n[0] + n[1]) // 2 or n[0], row_values[-1], kept)
        return surface

    def _kept(self, rows: int) -> bool:
        """Whether a micro-step of ``rows`` starts with the gradients allocated, as the planner fits it."""
        return rows < self._per_rank and self.plan.strategy not in SHARDED

    # -- internals ---------------------------------------------------------------------------------
    def _axis(self, signature: Signature) -> tuple[int, frozenset[Position], int] | None:
        """``(rows, positions, length)`` of a signature against the sample's; None if not one axis."""
        base = self._base
        if len(signature) != len(base):
            return None
        rows: set[int] = set()
        varying: dict[Position, int] = {}
        length0: set[int] = set()
        for index, ((shape, dtype), (shape0, dtype0)) in enumerate(zip(signature, base, strict=True)):
            if dtype != dtype0 or len(shape) != len(shape0):
                return None
            if shape:
                rows.add(shape[0])
            for d in range(1, len(shape)):
                if shape[d] != shape0[d]:
                    varying[(index, d)] = shape[d]
                    length0.add(shape0[d])
        if len(rows) != 1 or len(set(varying.values())) > 1 or len(length0) > 1:
            return None
        if not varying:
            return rows.pop(), frozenset(), 0
        return rows.pop(), frozenset(varying), next(iter(varying.values()))

    def _decide(self, batch: Any, signature: Signature) -> ShapeFit:
        axis = self._axis(signature)
        rows = batch_size_of(batch) or 1
        micro = rows if self._whole else min(rows, self._micro)
        if axis is not None:
            _, positions, length = axis
            kept = self._kept(micro)
            # only the rows differ: the sample's length along every axis learnt so far
            axes = [(positions, length)] if positions else [
                (p, self._length0(p)) for p, k in self._surfaces if k == kept
            ]  # fmt: skip
            for along, at in axes:
                predicted = self.predict(micro, at, along)
                if predicted is None:
                    continue
                surface = self._surfaces[(along, kept)]
                r_lo, _, n_lo, _ = surface.box
                source = "bound" if micro < r_lo or at < n_lo else "model"
                if predicted <= self.usable_bytes:
                    return self._fit_from(signature, rows, micro, predicted, source)
                if predicted - 2 * surface.margin_bytes > self.usable_bytes:  # surely over: search, traced
                    return self._split(batch, signature, rows, micro, predicted, source, positions, length)
                break
            tracer = self._tracer(positions, length, batch)
            cand = self._evaluate(tracer, micro)
            for along, at in axes:
                self._note(along, at, micro, cand)
            if cand.fits:
                return self._fit_from(signature, rows, micro, cand.total, "traced")
            return self._split(batch, signature, rows, micro, cand.total, "traced", positions, length)
        tracer = self._new_tracer(batch)  # a structure of its own: traced on its own, counted
        self._others.append(tracer)
        cand = self._evaluate(tracer, micro)
        if cand.fits:
            return self._fit_from(signature, rows, micro, cand.total, "traced")
        found = self._search(tracer, micro)
        return self._fit_from(signature, rows, micro, cand.total, "traced", found)

    def _split(
        self,
        batch: Any,
        signature: Signature,
        rows: int,
        micro: int,
        total: int,
        source: str,
        positions: frozenset[Position],
        length: int,
    ) -> ShapeFit:
        found = self._search(self._tracer(positions, length, batch), micro)
        return self._fit_from(signature, rows, micro, total, source, found)

    def _search(self, tracer: Tracer, micro: int) -> Candidate | None:
        with self._context():
            return search_largest(tracer, divisors(micro), self._ckpt, self.plan.strategy)  # type: ignore[arg-type]

    def _note(self, positions: frozenset[Position], length: int, rows: int, cand: Candidate) -> None:
        """Add a traced point; the third length along an axis makes the model learn it (:meth:`learn`)."""
        kept = self._kept(rows)
        surface = self._surface(positions, kept)
        surface.add(rows, length, cand.total, profile_of(cand.estimate, cand.fit))
        lengths = {n for _, n in surface.points}
        key = (positions, kept)
        if len(lengths) >= 3 and not surface.trusted and key not in self._learned:
            self._learned.add(key)  # once: a surface that stays untrusted is not polynomial here
            self.learn(positions, tuple(sorted(lengths)), kept)

    def _length0(self, positions: frozenset[Position]) -> int:
        """The sample batch's size along ``positions``."""
        index, dim = next(iter(positions))
        return int(self._base[index][0][dim])

    def _surface(self, positions: frozenset[Position], kept: bool) -> Surface:
        """The model along ``positions`` in one regime, seeded with the plan's point when it has one."""
        surface = self._surfaces.get((positions, kept))
        if surface is None:
            surface = self._surfaces[(positions, kept)] = Surface()
            if self.seen.get(self._base) is not None and self._kept(self._micro) == kept:
                fit, length = self.plan.fit, self._length0(positions)
                surface.add(self._micro, length, fit.device_total_bytes, profile_of(self.plan.estimate, fit))
        return surface

    def _point(self, positions: frozenset[Position], length: int, rows: int, kept: bool) -> None:
        surface = self._surface(positions, kept)
        if (rows, length) not in surface.points:
            cand = self._evaluate(self._tracer(positions, length), rows)
            surface.add(rows, length, cand.total, profile_of(cand.estimate, cand.fit))

    def _tracer(self, positions: frozenset[Position], length: int, batch: Any = None) -> Tracer:
        key = (positions, length)
        tracer = self._tracers.get(key)
        if tracer is None:
            if batch is None:
                batch = resize_along(self._sample, positions, length) if positions else self._sample
            tracer = self._tracers[key] = self._new_tracer(batch)
        return tracer

    def _new_tracer(self, batch: Any) -> Tracer:
        p = self.plan
        return Tracer(
            self.model, self.optimizer, batch, self.loss_fn, p.precision, p.device, p.headroom, self._units,
            p.world_size, self._blocks, policy=p.fsdp_precision, per_rank=self._per_rank,
        )  # fmt: skip

    def _evaluate(self, tracer: Tracer, rows: int) -> Candidate:
        with self._context():
            return tracer.evaluate(self._ckpt, self.plan.strategy, rows)

    def _fit_from(
        self,
        signature: Signature,
        rows: int,
        micro: int,
        total: int,
        source: str,
        found: Candidate | None | bool = True,
    ) -> ShapeFit:
        usable = self.usable_bytes
        fits = total <= usable
        fitting: int | None
        fitting_bytes: int | None
        if fits:
            fitting, fitting_bytes = micro, total
        elif isinstance(found, Candidate):
            fitting, fitting_bytes = found.micro, found.total
        else:
            fitting = fitting_bytes = None
        return ShapeFit(
            describe_signature(signature), rows, micro, int(total), usable, fits, source, fitting,
            fitting_bytes, signature,
        )  # fmt: skip
