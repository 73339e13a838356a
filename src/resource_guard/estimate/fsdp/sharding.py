"""FSDP's own mixed precision, per rank: what a rank holds when parameters are gathered in 16 bits.

The per-rank arithmetic over one single-device trace, used by the planner
(:mod:`resource_guard.planning.strategy`) and by the estimate of an FSDP2-sharded module
(:mod:`resource_guard.estimate.fsdp.fsdp2`).

FSDP (FSDP1 ``MixedPrecision``, FSDP2 ``MixedPrecisionPolicy``) does not run autocast over fp32
weights. Each unit's parameters are all-gathered in ``param_dtype`` just before the unit runs and
freed after it (``reshard_after_forward``), so only one or two units are ever unsharded; the fp32
parameters the optimizer steps on stay sharded (FSDP1: the flat parameter's local shard; FSDP2: the
DTensor shard), and so do the optimizer state and the gradients, which are reduce-scattered in
``reduce_dtype`` and kept as sharded fp32 (FSDP1 upcasts them unless ``keep_low_precision_grads``;
FSDP2 stores them in the parameter's dtype). With 16-bit parameters every activation is 16-bit,
residual stream included; an autocast on top (Lightning, Composer) is a no-op for the weights and
still runs its fp32 ops (softmax, norms, losses) in fp32.

What the trace supplies and what is computed: the step is traced once with the parameters *in*
``param_dtype`` and autocast on top (:func:`trace_spec`), which gives the activations and
temporaries exactly; the model state (master shards, gradient shards, optimizer state) is scaled
from the traced 16-bit figures to the master dtype and divided over the shard group; the gathered
units and the unit's unsharded gradient are added by phase.

Policies (:data:`POLICIES`), and who uses which (checked in the installed Lightning 2.6
``fabric/plugins/precision/fsdp.py`` and ``pytorch/plugins/precision/fsdp.py``: ``"bf16-mixed"`` →
``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)`` plus ``torch.autocast``;
``"bf16-true"`` converts the module, so the shards and optimizer state are bf16 too):

- ``"params"``: 16-bit gathered parameters, reduce in 16 bits, fp32 master (Lightning
  ``FSDPStrategy``, Composer ``PURE``).
- ``"params-fp32-reduce"``: as ``"params"`` with gradients reduced in fp32 (Composer ``DEFAULT``):
  the unit's unsharded gradient is also cast to fp32 before the reduce-scatter.
- ``"autocast"``: fp32 parameters gathered and autocast over them (FSDP without ``param_dtype``,
  Composer ``FULL``): autocast's 16-bit weight copies are saved for backward, unsharded, for every
  layer. That is today's single-device trace, kept; :func:`autocast_copy_bytes` says what the
  ``"params"`` policy would save.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.trace.tracer import CATEGORIES
from resource_guard.step.precision import PrecisionSpec, parse_precision

if TYPE_CHECKING:
    from resource_guard.estimate.result import MemoryEstimate

__all__ = [
    "POLICIES",
    "SHARDINGS",
    "FsdpPrecision",
    "PhasePeaks",
    "RankPeak",
    "autocast_copy_bytes",
    "fsdp_precision",
    "full_gradient_bytes",
    "phase_peaks",
    "sharded_rank_bytes",
    "sharded_rank_peak",
    "timeline_points",
    "trace_spec",
]

_INDEX = {c: i for i, c in enumerate(CATEGORIES)}
_TRANSIENT = ("activations", "temporaries", "inputs", "other")

POLICIES = ("params", "params-fp32-reduce", "autocast")
SHARDINGS = ("full", "grad_op", "hybrid")


@dataclass(frozen=True)
class FsdpPrecision:
    """The dtypes FSDP uses for one precision name under one policy.

    Attributes:
        name: ``"<precision> / <policy>"``, as summaries print it.
        precision: the Lightning precision name.
        policy: one of :data:`POLICIES` (``"none"`` for the ``-true`` precisions, which need none).
        param_dtype: dtype of the gathered (unsharded) parameters and of the activations' weights.
        reduce_dtype: dtype of the gradient reduce-scatter.
        master_dtype: dtype of the sharded parameters, gradients and optimizer state.
        autocast_dtype: autocast on top of the forward (``None``: none).
    """

    name: str
    precision: str
    policy: str
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    @property
    def gathers_low_precision(self) -> bool:
        return self.param_dtype != self.master_dtype

    def describe(self) -> str:
        def short(d: torch.dtype) -> str:
            return str(d).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")

        auto = f", autocast {short(self.autocast_dtype)}" if self.autocast_dtype is not None else ""
        return (
            f"FSDP {self.name}: gathered params {short(self.param_dtype)}, "
            f"reduce {short(self.reduce_dtype)}, "
            f"sharded master/grads/optimizer state {short(self.master_dtype)}{auto}"
        )


def fsdp_precision(precision: str, policy: str = "params") -> FsdpPrecision:
    """The dtypes FSDP would use for Lightning ``precision`` under ``policy`` (see the module docstring)."""
    spec = parse_precision(precision)
    if policy not in POLICIES:
        raise ConfigurationError(f"`fsdp_mixed_precision={policy!r}` must be one of {', '.join(POLICIES)}")
    if spec.autocast_dtype is None:  # 32-true, bf16-true, 16-true: everything in the module's dtype
        d = spec.param_dtype
        return FsdpPrecision(f"{spec.name}", spec.name, "none", d, d, d, None)
    low = spec.autocast_dtype
    if policy == "autocast":
        return FsdpPrecision(
            f"{spec.name} / autocast over fp32 params", spec.name, policy, torch.float32, torch.float32,
            torch.float32, low,
        )  # fmt: skip
    reduce = torch.float32 if policy == "params-fp32-reduce" else low
    return FsdpPrecision(f"{spec.name} / {policy}", spec.name, policy, low, reduce, spec.param_dtype, low)


def trace_spec(policy: FsdpPrecision) -> PrecisionSpec:
    """The precision the step is traced under: parameters in ``param_dtype``, autocast on top."""
    base = parse_precision(policy.precision)
    if not policy.gathers_low_precision:
        return base
    return PrecisionSpec(base.name, policy.param_dtype, policy.autocast_dtype, base.loss_scaling)


def autocast_copy_bytes(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of autocast's 16-bit copies of the matmul/conv weights (what a 16-bit param policy saves)."""
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (
            isinstance(m, kinds)
            and isinstance(w, torch.Tensor)
            and w.is_floating_point()
            and id(w) not in seen
        ):
            seen.add(id(w))
            total += w.numel() * dtype.itemsize
    return total


@dataclass(frozen=True)
class PhasePeaks:
    """The traced step's transient bytes (activations, temporaries, inputs, buffers) at its highest, per
    phase, and its model-state bytes, all in the traced (``param_dtype``) precision."""

    forward: int
    backward: int
    optimizer: int
    parameters: int
    gradients_full: int
    optimizer_state: int
    param_itemsize: int = 4
    points: tuple[tuple[str, int, int], ...] = ()
    """``(phase, transient bytes, traced gradient bytes)`` over the step: the gradient shards a rank
    holds at each moment are the traced gradients' share (none in the forward, growing through the
    backward). Empty: every gradient shard is counted from the start of the step."""
    parts: tuple[tuple[int, ...], ...] = ()
    """For each of ``points``, its transient bytes by category (activations, temporaries, inputs,
    other); empty when not known (the per-rank breakdown then books them all as activations)."""


def timeline_points(estimate: MemoryEstimate) -> list[tuple[str, Sequence[int]]]:
    """``(phase, bytes by category)`` at the estimate's peak, then over its timeline."""
    peak = tuple(estimate.breakdown.get(c, 0) for c in CATEGORIES)
    points: list[tuple[str, Sequence[int]]] = [(estimate.peak_phase or "forward", peak)]
    points.extend((phase.split(":")[0], values) for phase, values in estimate.timeline)
    return points


def full_gradient_bytes(estimate: MemoryEstimate) -> int:
    """Bytes of every trainable gradient: the traced parameter bytes scaled by the trainable fraction."""
    if estimate.parameter_count == 0:
        return 0
    share = estimate.trainable_parameter_count / estimate.parameter_count
    return int(estimate.breakdown.get("parameters", 0) * share)


def phase_peaks(estimate: MemoryEstimate) -> PhasePeaks:
    """The step's transient bytes at their highest per phase, and its model state (traced dtypes)."""
    best = {"forward": 0, "backward": 0, "optimizer": 0}
    # an extrapolated estimate keeps only a few moments of its backward: count every gradient there
    extrapolated = getattr(estimate, "blocks_sampled", None) is not None
    full = full_gradient_bytes(estimate)
    points: dict[tuple[str, int], int] = {}
    parts: dict[tuple[str, int], tuple[int, ...]] = {}
    for ph, v in timeline_points(estimate):
        key = "optimizer" if ph in ("optimizer", "zero_grad", "done") else ph
        if key in best:
            split = tuple(v[_INDEX[c]] for c in _TRANSIENT)
            transient = sum(split)
            best[key] = max(best[key], transient)
            grads = full if extrapolated and key == "backward" else v[_INDEX["gradients"]]
            points[(key, transient)] = max(points.get((key, transient), 0), grads)
            parts.setdefault((key, transient), split)
    b = estimate.breakdown
    return PhasePeaks(
        forward=best["forward"],
        backward=best["backward"],
        optimizer=best["optimizer"],
        parameters=b.get("parameters", 0),
        gradients_full=full,
        optimizer_state=b.get("optimizer_state", 0),
        param_itemsize=max(1, round(b.get("parameters", 0) / estimate.parameter_count))
        if estimate.parameter_count
        else 4,
        points=tuple((ph, tr, g) for (ph, tr), g in points.items()),
        parts=tuple(parts[k] for k in points),
    )


@dataclass(frozen=True)
class RankPeak:
    """One rank's peak under an FSDP policy (:func:`sharded_rank_peak`).

    Attributes:
        bytes: the rank's peak of live tensor bytes.
        phase: ``"forward"``, ``"backward"`` or ``"optimizer"``.
        state_bytes: the model state a rank keeps (master parameter, gradient and optimizer-state shards).
        breakdown: ``bytes`` by category (keys: ``CATEGORIES``); gathered units count as parameters,
            the unit's unsharded gradient and its reduce copy as gradients.
        notes: the policy and the sharding, as summaries print them.
        phase_bytes: the rank's peak in each phase.
        persistent_bytes: the parameter and optimizer-state shards (kept between steps).
    """

    bytes: int
    phase: str
    state_bytes: int
    breakdown: dict[str, int]
    notes: tuple[str, ...]
    phase_bytes: dict[str, int]
    persistent_bytes: int


def sharded_rank_bytes(
    peaks: PhasePeaks,
    policy: FsdpPrecision,
    units: Sequence[int],
    shard_world: int,
    sharding: str = "full",
) -> tuple[int, str, int, tuple[str, ...]]:
    """``(per-rank peak bytes, phase, model state per rank, notes)`` under an FSDP policy.

    ``units`` are the unsharded unit sizes in ``param_dtype`` bytes, largest first; ``shard_world``
    the ranks a unit is sharded over (the node for ``"hybrid"``). See :func:`sharded_rank_peak`.
    """
    peak = sharded_rank_peak(peaks, policy, units, shard_world, sharding)
    return peak.bytes, peak.phase, peak.state_bytes, peak.notes


def sharded_rank_peak(
    peaks: PhasePeaks,
    policy: FsdpPrecision,
    units: Sequence[int],
    shard_world: int,
    sharding: str = "full",
    *,
    resident: Sequence[int] = (),
) -> RankPeak:
    """One rank's peak under an FSDP policy, and its breakdown by category.

    Args:
        peaks: :func:`phase_peaks` of a trace with the parameters in ``policy.param_dtype``.
        policy: the FSDP mixed-precision policy.
        units: unsharded sizes in ``param_dtype`` bytes of the units gathered one (two in backward, the
            next one prefetched) at a time.
        shard_world: the ranks a unit is sharded over (the node for ``"hybrid"``).
        sharding: one of :data:`SHARDINGS`.
        resident: unsharded sizes (``param_dtype`` bytes) of the units gathered for the whole
            forward and backward, on top of ``units``: FSDP2 units that do not reshard after forward
            (the root by default).
    """
    if sharding not in SHARDINGS:
        raise ConfigurationError(f"`sharding={sharding!r}` must be one of {', '.join(SHARDINGS)}")
    n = shard_world
    scale = policy.master_dtype.itemsize / peaks.param_itemsize  # traced model state -> master dtype
    params_rank = int(peaks.parameters * scale / n)
    optim_rank = int(peaks.optimizer_state * scale / n)
    grads_rank = int(peaks.gradients_full * scale / n)
    state = params_rank + grads_rank + optim_rank
    ranked = sorted(units, reverse=True) or [0]
    largest = ranked[0]
    kept = sum(resident)
    largest_grad = max([largest, *resident])  # each unit's gradient is unsharded in its own backward
    if n == 1 and not policy.gathers_low_precision:  # one rank, one dtype: nothing is gathered or copied
        gathered_fwd = gathered_bwd = grad_unit = 0
    else:
        two = largest + (ranked[1] if len(ranked) > 1 else 0)
        # SHARD_GRAD_OP / reshard_after_forward=False: every unit stays gathered from its forward on
        gathered_fwd = (sum(ranked) if sharding == "grad_op" else two) + kept
        gathered_bwd = gathered_fwd
        reduce_copy = largest_grad * policy.reduce_dtype.itemsize // policy.param_dtype.itemsize
        grad_unit = largest_grad + (reduce_copy if policy.reduce_dtype != policy.param_dtype else 0)
    gathered = {"forward": gathered_fwd, "backward": gathered_bwd, "optimizer": 0}
    unit_grad = {"forward": 0, "backward": grad_unit, "optimizer": 0}
    # (total, gradient bytes, transient bytes by category) of the highest moment of each phase
    best: dict[str, tuple[int, int, tuple[int, ...]]] = {}
    points = peaks.points or (
        ("forward", peaks.forward, peaks.gradients_full),
        ("backward", peaks.backward, peaks.gradients_full),
        ("optimizer", peaks.optimizer, peaks.gradients_full),
    )
    for i, (ph, transient, grads) in enumerate(points):
        split = peaks.parts[i] if peaks.parts else (transient, 0, 0, 0)
        if ph == "optimizer":  # the update runs on the shards
            split = tuple(int(v * scale / n) for v in split)
            grad_bytes = grads_rank
        elif peaks.points:
            grad_bytes = min(int(grads * scale / n), grads_rank) + unit_grad[ph]
        else:  # no timeline: every gradient shard from the start
            grad_bytes = grads_rank + unit_grad[ph]
        total = params_rank + optim_rank + gathered[ph] + grad_bytes + sum(split)
        if ph not in best or total > best[ph][0]:
            best[ph] = (total, grad_bytes, split)
    phase = max(best, key=lambda k: best[k][0])
    total, grad_bytes, split = best[phase]
    breakdown = dict.fromkeys(CATEGORIES, 0)
    breakdown.update(zip(_TRANSIENT, split))
    breakdown["parameters"] = params_rank + gathered[phase]
    breakdown["gradients"] = grad_bytes
    breakdown["optimizer_state"] = optim_rank
    gathered_note = f", and {len(resident)} kept gathered ({kept} bytes)" if resident else ""
    notes = (
        policy.describe(),
        f"{sharding} shard over {n}: {len(ranked)} units, largest {largest} bytes gathered in "
        f"{str(policy.param_dtype).removeprefix('torch.')}{gathered_note}",
    )
    phase_bytes = {ph: v[0] for ph, v in best.items()}
    return RankPeak(total, phase, state, breakdown, notes, phase_bytes, params_rank + optim_rank)
