"""The planner's micro-batch search: cached estimate traces and interpolation over divisors.

Used by :mod:`resource_guard.planning.planner` (rule 5 of its docstring). A :class:`Tracer` owns the traces
(one ``estimate_memory`` per distinct ``(checkpointing, micro-batch)``, counted) and evaluates them per
strategy without tracing again; :func:`search_largest` finds the largest divisor that fits; every
evaluated configuration is an :class:`Alternative` (a row of :func:`render_table`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from resource_guard.estimate import MemoryEstimate
from resource_guard.estimate.allocation.allocator import rank_overhead
from resource_guard.estimate.blocks import SAMPLE_BLOCKS, estimate_by_blocks, sampleable
from resource_guard.estimate.fsdp.sharding import FsdpPrecision, trace_spec
from resource_guard.planning.checkpointing import apply_checkpointing
from resource_guard.planning.strategy import (
    GPUS_PER_NODE,
    SHARDED,
    RankMemory,
    overhead_envelope,
    phase_peaks,
    rank_fit,
    rank_memory,
    unit_param_bytes,
)
from resource_guard.step.batching import resize_batch
from resource_guard.step.precision import PrecisionSpec, parse_precision
from resource_guard.step.training import LossFn, OptimizerArg

if TYPE_CHECKING:
    from resource_guard.devices import DeviceSpec
    from resource_guard.estimate import DeviceFit

__all__ = ["Alternative", "Candidate", "Tracer", "render_table", "search_largest", "relative_cost"]

_MiB = 2**20

CHECKPOINT_COST = 1.3
CHECKPOINT_MARGIN = 0.9
FSDP_COST = 1.1
MICRO_STEP_OVERHEAD_SAMPLES = 8


@dataclass(frozen=True)
class Alternative:
    """One configuration the planner considered (a row of the alternatives table)."""

    precision: str
    checkpointing: bool | int
    micro_batch_size: int
    accumulation_steps: int
    strategy: str
    world_size: int
    predicted_peak_bytes: int
    fits: bool
    relative_cost: float
    chosen: bool = False
    predicted_step_ms: float | None = None  # the step-time model's, where the planner used one

    def config(self) -> str:
        every = int(self.checkpointing)
        ckpt = (" +ckpt" if every == 1 else f" +ckpt every {every}") if every else ""
        where = f" {self.strategy}×{self.world_size}" if self.strategy != "single" else ""
        return f"{self.micro_batch_size}×{self.accumulation_steps} {self.precision}{ckpt}{where}"


def render_table(rows: tuple[Alternative, ...]) -> str:
    """The alternatives as a markdown table."""
    timed = any(r.predicted_step_ms is not None for r in rows)
    if timed:
        head = "| config (micro×accum) | predicted peak | fits | predicted ms/step |"
        lines = [head, "|---|---:|:-:|---:|"]
    else:
        lines = ["| config (micro×accum) | predicted peak | fits | relative cost |", "|---|---:|:-:|---:|"]
    for r in rows:
        mark = " **(chosen)**" if r.chosen else ""
        peak = f"{r.predicted_peak_bytes / _MiB:,.1f} MiB"
        if timed:
            cost = "—" if r.predicted_step_ms is None else f"{r.predicted_step_ms:,.1f}"
        else:
            cost = f"{r.relative_cost:.2f}"
        lines.append(f"| {r.config()}{mark} | {peak} | {'yes' if r.fits else 'no'} | {cost} |")
    return "\n".join(lines)


def relative_cost(
    micro: int, per_rank: int, *, checkpointing: bool | int = False, strategy: str = "single"
) -> float:
    """Time per sample relative to the full per-rank batch without checkpointing (see rule 4).

    ``checkpointing``: False/0 none, True/1 every block, ``k`` every k-th block (1/k of the recompute).
    """
    k = MICRO_STEP_OVERHEAD_SAMPLES
    cost = ((micro + k) / micro) / ((per_rank + k) / per_rank)
    recompute = 1.0 + (CHECKPOINT_COST - 1.0) / int(checkpointing) if checkpointing else 1.0
    return cost * recompute * (FSDP_COST if strategy in SHARDED else 1.0)


@dataclass(frozen=True)
class Candidate:
    """One evaluated configuration: a micro-batch under (checkpointing, strategy), and its figures."""

    micro: int
    ckpt: bool | int  # False/0 off, True/1 every block, k every k-th block
    strategy: str
    estimate: MemoryEstimate
    fit: DeviceFit
    rank: RankMemory

    @property
    def total(self) -> int:
        return self.fit.device_total_bytes

    @property
    def fits(self) -> bool:
        return self.fit.fits


class Tracer:
    """Traces the step at a micro-batch size (cached and counted) and fits it to the device per strategy.

    FSDP strategies under a ``policy`` that gathers 16-bit parameters are traced with the parameters
    in that dtype (:func:`~resource_guard.estimate.fsdp.sharding.trace_spec`); the others under
    ``precision``. A model with repeated blocks is traced at two shallow depths and extrapolated
    (:func:`~resource_guard.estimate.blocks.estimate_by_blocks`) unless ``by_blocks`` is False.
    Below ``per_rank`` (gradient accumulation), a single-device or DDP candidate is fitted as its later
    micro-steps run: with every gradient allocated from the start (``for_device(gradients_kept=True)``);
    FSDP's gradients are sharded, and its accumulation is not modelled apart.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerArg,
        batch: Any,
        loss_fn: LossFn | None,
        precision: str,
        device: DeviceSpec,
        headroom: float,
        units: Sequence[int],
        world_size: int,
        blocks: tuple[str, ...],
        *,
        policy: FsdpPrecision | None = None,
        gpus_per_node: int = GPUS_PER_NODE,
        by_blocks: bool = True,
        per_rank: int | None = None,
    ) -> None:
        self.model, self.optimizer, self.batch, self.loss_fn = model, optimizer, batch, loss_fn
        self.precision, self.device, self.headroom = precision, device, headroom
        self.units, self.world_size = tuple(units), world_size
        self.blocks = blocks  # find_checkpoint_blocks(model), found once by the planner
        self.policy, self.gpus_per_node = policy, gpus_per_node
        self.per_rank = per_rank  # the batch per rank: a smaller micro-batch accumulates gradients
        self.sample_blocks = blocks if by_blocks and sampleable(model, blocks) else ()
        self.policy_units = self.units
        if policy is not None and policy.gathers_low_precision:
            self.policy_units = unit_param_bytes(model, policy)
        self.count = 0
        self._traces: dict[tuple[bool | int, int, str], tuple[MemoryEstimate, Any]] = {}
        self.evaluated: dict[tuple[bool | int, str, int], Candidate] = {}

    def _spec(self, strategy: str) -> PrecisionSpec:
        if strategy in SHARDED and self.policy is not None:
            return trace_spec(self.policy)
        return parse_precision(self.precision)

    def trace(self, ckpt: bool | int, micro: int, spec: PrecisionSpec | None = None) -> MemoryEstimate:
        spec = spec if spec is not None else parse_precision(self.precision)
        key = (ckpt, micro, f"{spec.name}/{spec.param_dtype}")
        if key not in self._traces:
            batch = resize_batch(self.batch, micro)
            every = int(ckpt)
            handle = apply_checkpointing(self.model, every=every) if every else None
            try:
                est = estimate_by_blocks(
                    self.model,
                    self.optimizer,
                    batch,
                    self.loss_fn,
                    blocks=self.sample_blocks,
                    precision=spec,
                    device=self.device.kind,
                    samples=(every, 2 * every) if every > 1 else SAMPLE_BLOCKS,  # whole k-block periods
                )
            finally:
                if handle is not None:
                    handle.remove()
            self.count += 1
            self._traces[key] = (est, None)
        return self._traces[key][0]

    def _overhead(self, ckpt: bool | int, micro: int, spec: PrecisionSpec) -> tuple[int, int]:
        """The allocator overhead at ``micro``: the envelope over the traces of this kind up to it."""
        tag = f"{spec.name}/{spec.param_dtype}"
        mine: dict[int, tuple[int, int]] = {}
        for key, (e, cached) in list(self._traces.items()):
            if key[0] == ckpt and key[2] == tag and key[1] <= micro:
                if cached is None:
                    cached = rank_overhead(e)
                    self._traces[key] = (e, cached)
                mine[key[1]] = cached
        return overhead_envelope(mine, micro)

    def evaluate(self, ckpt: bool | int, strategy: str, micro: int) -> Candidate:
        key = (ckpt, strategy, micro)
        if key not in self.evaluated:
            spec = self._spec(strategy)
            est = self.trace(ckpt, micro, spec)
            sharded = strategy in SHARDED
            # accumulation's micro-steps 2..k start with every (unsharded) gradient allocated
            kept = self.per_rank is not None and micro < self.per_rank and not sharded
            fit = est.for_device(self.device, headroom=self.headroom, gradients_kept=kept)
            low = sharded and self.policy is not None and self.policy.gathers_low_precision
            units = self.policy_units if low else self.units
            rank = rank_memory(
                est, strategy, self.world_size, units=units, policy=self.policy if sharded else None,
                gpus_per_node=self.gpus_per_node, peaks=phase_peaks(est) if sharded else None,
            )  # fmt: skip
            if strategy != "single":
                fit = rank_fit(fit, est, rank, overhead=self._overhead(ckpt, micro, spec))
            self.evaluated[key] = Candidate(micro, ckpt, strategy, est, fit, rank)
        return self.evaluated[key]

    def _series(self, ckpt: bool | int, strategy: str) -> list[Candidate]:
        return sorted(
            (c for (k, s, _), c in self.evaluated.items() if k == ckpt and s == strategy),
            key=lambda c: c.micro,
        )

    def smallest_failing(self, ckpt: bool | int, strategy: str, micro: int) -> tuple[int, int] | None:
        """``(micro-batch, bytes)`` of the smallest evaluated micro-batch above ``micro`` not fitting."""
        over = [c for c in self._series(ckpt, strategy) if c.micro > micro and not c.fits]
        return (over[0].micro, over[0].total) if over else None

    def interpolated_limit(self, ckpt: bool | int, strategy: str, micro: int) -> int | None:
        """The largest micro-batch, divisor or not, that the linear model says would fit."""
        series = self._series(ckpt, strategy)
        low = next((c for c in series if c.micro == micro), None)
        high = next((c for c in series if c.micro > micro and not c.fits), None)
        if low is None or high is None or high.total <= low.total:
            return None
        slope = (high.total - low.total) / (high.micro - low.micro)
        return int(low.micro + (low.fit.usable_bytes - low.total) / slope)

    def smallest_points(self) -> list[Candidate]:
        """The evaluated configuration with the smallest micro-batch, per (checkpointing, strategy)."""
        groups = {(c.ckpt, c.strategy) for c in self.evaluated.values()}
        return [self._series(*g)[0] for g in groups]

    def alternatives(self, per_rank: int) -> tuple[Alternative, ...]:
        """Every evaluated configuration as a table row: fitting ones first, cheapest first."""

        rows = [
            Alternative(
                precision=self.precision,
                checkpointing=c.ckpt,
                micro_batch_size=c.micro,
                accumulation_steps=per_rank // c.micro,
                strategy=c.strategy,
                world_size=self.world_size,
                predicted_peak_bytes=c.total,
                fits=c.fits,
                relative_cost=relative_cost(c.micro, per_rank, checkpointing=c.ckpt, strategy=c.strategy),
            )
            for c in self.evaluated.values()
        ]
        return tuple(sorted(rows, key=lambda r: (not r.fits, r.relative_cost, r.predicted_peak_bytes)))


def search_largest(
    tracer: Tracer, divs: Sequence[int], ckpt: bool, strategy: str, start: int = 1
) -> Candidate | None:
    """The largest divisor in ``divs`` whose configuration fits, verified by traces (None: not even 1).

    Traces the largest divisor first (done if it fits), then ``start`` (a size known to fit in a
    cheaper configuration, else 1), then interpolates linearly between the largest fitting and the
    smallest failing size and traces the largest divisor predicted to fit (or the next one up), until
    those two sizes are neighbouring divisors.
    """
    top = tracer.evaluate(ckpt, strategy, divs[-1])
    if top.fits:
        return top
    lo = start if start in divs and start < divs[-1] else divs[0]
    low = tracer.evaluate(ckpt, strategy, lo)
    if not low.fits and lo != divs[0]:
        lo = divs[0]
        low = tracer.evaluate(ckpt, strategy, lo)
    if not low.fits:
        return None
    high = top
    while True:
        between = [d for d in divs if low.micro < d < high.micro]
        if not between:
            return low
        if high.total > low.total:
            guess = low.micro + (low.fit.usable_bytes - low.total) * (high.micro - low.micro) / (
                high.total - low.total
            )
        else:  # not increasing: bisect
            guess = (low.micro + high.micro) / 2
        below = [d for d in between if d <= guess]
        point = tracer.evaluate(ckpt, strategy, below[-1] if below else between[0])
        if point.fits:
            low = point
        else:
            high = point
