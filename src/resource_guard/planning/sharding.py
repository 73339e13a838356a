"""FSDP's own mixed precision, per rank: what a rank holds when parameters are gathered in 16 bits.

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

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.step.precision import PrecisionSpec, parse_precision

__all__ = [
    "POLICIES",
    "SHARDINGS",
    "FsdpPrecision",
    "PhasePeaks",
    "autocast_copy_bytes",
    "fsdp_precision",
    "sharded_rank_bytes",
    "trace_spec",
]

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


def sharded_rank_bytes(
    peaks: PhasePeaks,
    policy: FsdpPrecision,
    units: Sequence[int],
    shard_world: int,
    sharding: str = "full",
) -> tuple[int, str, int, tuple[str, ...]]:
    """``(per-rank peak bytes, phase, model state per rank, notes)`` under an FSDP policy.

    ``units`` are the unsharded unit sizes in ``param_dtype`` bytes, largest first; ``shard_world``
    the ranks a unit is sharded over (the node for ``"hybrid"``).
    """
    if sharding not in SHARDINGS:
        raise ConfigurationError(f"`sharding={sharding!r}` must be one of {', '.join(SHARDINGS)}")
    n = shard_world
    scale = policy.master_dtype.itemsize / peaks.param_itemsize  # traced model state -> master dtype
    state = int((peaks.parameters + peaks.gradients_full + peaks.optimizer_state) * scale / n)
    ranked = sorted(units, reverse=True) or [0]
    largest = ranked[0]
    if n == 1 and not policy.gathers_low_precision:  # one rank, one dtype: nothing is gathered or copied
        gathered_fwd = gathered_bwd = grad_unit = 0
    else:
        two = largest + (ranked[1] if len(ranked) > 1 else 0)
        # SHARD_GRAD_OP / reshard_after_forward=False: every unit stays gathered from its forward on
        gathered_fwd = sum(ranked) if sharding == "grad_op" else two
        gathered_bwd = gathered_fwd
        reduce_copy = largest * policy.reduce_dtype.itemsize // policy.param_dtype.itemsize
        grad_unit = largest + (reduce_copy if policy.reduce_dtype != policy.param_dtype else 0)
    extra = {"forward": gathered_fwd, "backward": gathered_bwd + grad_unit}
    grads_rank = int(peaks.gradients_full * scale / n)
    persistent = state - grads_rank
    if peaks.points:
        candidates = {"forward": 0, "backward": 0, "optimizer": 0}
        for ph, transient, grads in peaks.points:
            if ph == "optimizer":
                value = int(transient * scale / n) + grads_rank
            else:
                value = transient + extra[ph] + min(int(grads * scale / n), grads_rank)
            candidates[ph] = max(candidates[ph], persistent + value)
        candidates = {k: v - state for k, v in candidates.items()}
    else:
        candidates = {
            "forward": peaks.forward + gathered_fwd,
            "backward": peaks.backward + gathered_bwd + grad_unit,
            "optimizer": int(peaks.optimizer * scale / n),
        }
    phase = max(candidates, key=lambda k: candidates[k])
    notes = (
        policy.describe(),
        f"{sharding} shard over {n}: {len(ranked)} units, largest {largest} bytes gathered in "
        f"{str(policy.param_dtype).removeprefix('torch.')}",
    )
    return state + candidates[phase], phase, state, notes
