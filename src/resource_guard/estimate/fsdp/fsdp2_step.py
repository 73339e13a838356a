"""FSDP2's per-rank buffers inside the trace, and the conversion of the trace to one rank.

:class:`RankBuffers` hooks the unsharded copy of a ``fully_shard``-ed module (made by
:func:`~resource_guard.estimate.fsdp.fsdp2.unsharded_copy`) so that the fake step allocates and frees
what one rank's FSDP2 allocates and frees around each unit, in the order FSDP2 does (checked against
the ``FSDP::`` records of a real 2-rank gloo step; torch 2.13 ``_fsdp_param_group.py``,
``_fsdp_collectives.py``):

- pre-forward: with mixed precision (``param_dtype`` unlike the parameters'), the all-gather input:
  the rank's shards cast to ``param_dtype`` into one flat buffer (``_get_param_all_gather_inputs``'
  foreach copy), alive until the all-gather returns (without a cast the input is a view of the
  output); the all-gather's flat output (the unit's unsharded bytes in ``param_dtype``; gloo
  first gathers into a flat copy of its own, freed at once), the copy-out into the unsharded
  parameters (as many bytes again); the flat output is kept until the next unit's all-gather (the
  end of forward for the last), and the previous unit's is freed (one rank: no flat output, the
  shard is copied out directly);
- post-forward: the unsharded parameters are freed, unless the unit does not reshard after forward
  (the root, by default);
- pre-backward (the first gradient of the unit's output): the unit is gathered again (copied out of
  its prefetched flat output when there is one, which is then freed) and the unit that ran before it
  in forward is prefetched (its flat output allocated);
- post-backward (the gradient of the unit's inputs, or the end of backward): the unsharded
  parameters are freed; the previous unit's reduce-scatter input, held until now, is freed; the
  unit's unsharded gradients are copied into a reduce-scatter input in ``reduce_dtype`` and become
  gradient shards; the reduce-scatter output is allocated and cast.

The unit's gradients count in full (unsharded) until its post-backward, and as shards from then on.
:func:`per_rank` then divides the model state (master parameters, gradients, optimizer state, scaled
from ``param_dtype`` to the master dtype) over the shard group at every moment of the step and takes
the highest; FSDP2's buffers are counted as temporaries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.allocation.allocator import rank_overhead
from resource_guard.estimate.fsdp.sharding import FsdpPrecision, phase_peaks, sharded_rank_peak
from resource_guard.estimate.result import MemoryEstimate
from resource_guard.step.precision import PrecisionSpec
from resource_guard.step.training import iter_tensors, map_tensors

if TYPE_CHECKING:
    from resource_guard.estimate.trace.tracer import StorageTracker

__all__ = ["RankBuffers", "ShardedEstimate", "ShardedLayout", "Unit", "per_rank"]

_BUFFERS = "temporaries"


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` unit: its module path, unsharded bytes in ``param_dtype`` (dim 0 padded to
    the shard world, as FSDP2 gathers), whether it reshards after forward (``False``: gathered from
    its forward to its backward), the bytes of its trainable parameters (what it reduce-scatters), and
    the bytes of its all-gather input when that is a copy (the rank's shards of the floating
    parameters cast to ``param_dtype``; 0 when ``param_dtype`` is theirs: the input is then a view of
    the output)."""

    name: str
    gathered_bytes: int
    reshards: bool
    trainable_bytes: int
    copy_in_bytes: int = 0


@dataclass(frozen=True)
class ShardedLayout:
    """What ``fully_shard`` did to a module, as read from it.

    Attributes:
        shard_world: the ranks each unit is sharded over (the mesh's shard dimension).
        replicas: the replicas of each shard (HSDP's replicate dimension; 1 for a 1-D mesh).
        device_type: the mesh's device type (``"cuda"`` for NCCL, ``"cpu"`` for gloo).
        param_dtype: the gathered parameters' dtype (``MixedPrecisionPolicy.param_dtype``, else the
            parameters' own).
        reduce_dtype: the gradient reduce-scatter's dtype (``reduce_dtype``, else ``param_dtype``).
        output_dtype: ``MixedPrecisionPolicy.output_dtype`` (``None``: outputs left as computed).
        cast_forward_inputs: whether each unit casts its floating inputs to ``param_dtype``.
        master_dtype: the sharded parameters' dtype (what the optimizer steps on).
        units: every unit, the root(s) included.
    """

    shard_world: int
    replicas: int
    device_type: str
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool
    master_dtype: torch.dtype
    units: tuple[Unit, ...]

    @property
    def world_size(self) -> int:
        return self.shard_world * self.replicas

    def describe(self) -> str:
        """``"FSDP2 fully_shard over 2 ranks, param_dtype bf16, reduce_dtype bf16, per-rank"``."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}" + (
            f" ({self.replicas} replicas of {self.shard_world})" if self.replicas > 1 else ""
        )
        out = f", output_dtype {_short(self.output_dtype)}" if self.output_dtype is not None else ""
        return (
            f"FSDP2 fully_shard over {ranks}, param_dtype {_short(self.param_dtype)}, "
            f"reduce_dtype {_short(self.reduce_dtype)}{out}, per-rank"
        )

    def trace_spec(self, spec: PrecisionSpec) -> PrecisionSpec:
        """The precision to trace the unsharded copy under: its parameters are already in
        ``param_dtype``, so no cast; the autocast of ``spec`` (Lightning's ``*-mixed``) on top."""
        if spec.autocast_dtype is None and spec.param_dtype != self.master_dtype:
            raise ConfigurationError(
                f"`estimate_memory(precision={spec.name!r})`: the fully_shard-ed module's parameters are "
                f"{_short(self.master_dtype)}; for FSDP2 the gathered dtype comes from its "
                "MixedPrecisionPolicy, so pass a precision of the parameters' dtype ('32-true' for fp32, "
                "'bf16-true' for bf16) or a '*-mixed' one for autocast on top."
            )
        return dataclasses.replace(spec, param_dtype=torch.float32)

    def policy(self, spec: PrecisionSpec) -> FsdpPrecision:
        """The dtypes as :func:`~resource_guard.estimate.fsdp.sharding.sharded_rank_peak` takes them."""
        return FsdpPrecision(
            f"{spec.name} / fully_shard", spec.name, "fully_shard", self.param_dtype, self.reduce_dtype,
            self.master_dtype, spec.autocast_dtype,
        )  # fmt: skip


@dataclass(frozen=True)
class ShardedEstimate(MemoryEstimate):
    """One rank's step of an FSDP2-sharded module: a :class:`MemoryEstimate` whose figures are per rank.

    Attributes:
        layout: the sharding read from the module
        (:class:`~resource_guard.estimate.fsdp.fsdp2.ShardedLayout`).
        unsharded: the trace the per-rank figures come from (global shapes, parameters in
            ``param_dtype``, FSDP2's buffers of one rank; model state not yet divided). Its timeline
            and allocation events are there.
        allocator_overhead: ``(rounding, fragmentation)`` of the caching allocator over the step's
            forward/backward churn, which :meth:`for_device` adds on a GPU.
    """

    layout: ShardedLayout | None = None
    unsharded: MemoryEstimate | None = dataclasses.field(default=None, repr=False)
    allocator_overhead: tuple[int, int] | None = None

    @property
    def method_line(self) -> str:
        """The method, and that the figures are one rank's of FSDP2's sharding."""
        line = super().method_line
        return f"{line}; {self.layout.describe()}" if self.layout is not None else line

    def to_dict(self) -> dict[str, Any]:
        """:meth:`MemoryEstimate.to_dict`, with ``"sharding"`` (the layout, in one line)."""
        out = super().to_dict()
        out["sharding"] = self.layout.describe() if self.layout is not None else None
        return out


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the unit's backward as done (as FSDP2's
    ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx: Any, buffers: RankBuffers, index: int, *inputs: torch.Tensor) -> Any:
        ctx.buffers, ctx.index = buffers, index
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.buffers.post_backward(ctx.index)
        return (None, None, *grads)


class RankBuffers:
    """Allocates, on the fake tensors of the trace, the buffers one FSDP2 rank holds around each unit.

    Args:
        layout: the sharding of the module.
        units: for each unit of ``layout.units`` (same order), the copy's unit module and the paths
            ``(submodule, parameter name)`` of the parameters it manages.
    """

    def __init__(self, layout: ShardedLayout, units: list[tuple[nn.Module, list[tuple[str, str]]]]) -> None:
        self.layout = layout
        self.sizes = [u.gathered_bytes for u in layout.units]
        self.trainable = [u.trainable_bytes for u in layout.units]
        self.copy_in = [u.copy_in_bytes for u in layout.units]
        self.reshards = [u.reshards for u in layout.units]
        self.managed = [paths for _, paths in units]
        self.tracker: StorageTracker | None = None
        self._gathered: dict[int, torch.Tensor] = {}
        self._prefetched: dict[int, torch.Tensor] = {}
        self._modules: dict[int, nn.Module] = {}
        self._forward_order: list[int] = []
        self._backward_started: set[int] = set()
        self._backward_done: set[int] = set()
        self._held: torch.Tensor | None = None
        self._held_flat: torch.Tensor | None = None
        self._root: int | None = None
        self._in_backward = False
        for i, (module, _) in enumerate(units):
            module.register_forward_pre_hook(self._pre_forward_hook(i), with_kwargs=True)
            module.register_forward_hook(self._post_forward_hook(i))

    def bind(self, tracker: StorageTracker) -> None:
        """Count the buffers with ``tracker`` (the trace's), under their own category."""
        self.tracker = tracker

    # -- buffers --------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(max(int(nbytes), 0), dtype=torch.uint8)
        if self.tracker is not None:
            self.tracker.track(buf, _BUFFERS)
        return buf

    def _all_gather(self, i: int) -> torch.Tensor | None:
        """The all-gather's flat output (none on one rank: the shard is copied out directly)."""
        if self.layout.shard_world == 1:
            return None
        # the shards cast to param_dtype (foreach_all_gather's input), freed when the all-gather returns
        copy_in = self._alloc(self.copy_in[i]) if self.copy_in[i] else None
        flat = self._alloc(self.sizes[i])
        if self.layout.device_type == "cpu":  # gloo gathers into a flat copy of its own first (measured)
            self._alloc(self.sizes[i])
        del copy_in
        return flat

    def _gather(self, i: int, forward: bool) -> None:
        if i in self._gathered:
            return
        flat = self._prefetched.pop(i, None)
        if flat is None:
            flat = self._all_gather(i)
        if forward:  # the previous unit's flat output, kept until now, is freed after this all-gather
            self._held_flat = None
        self._gathered[i] = self._alloc(self.sizes[i])  # copied out into the unsharded parameters
        if forward:  # kept until the next unit's all-gather (FSDP2's implicit forward prefetch)
            self._held_flat = flat
        del flat

    def _params(self, i: int) -> list[nn.Parameter]:
        module = self._modules[i]
        return [module.get_submodule(path)._parameters[name] for path, name in self.managed[i]]  # type: ignore[misc]

    # -- forward --------------------------------------------------------------------------------
    def _pre_forward_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            layout = self.layout
            if layout.cast_forward_inputs and layout.param_dtype != layout.master_dtype:
                to_param = lambda t: t.to(layout.param_dtype) if t.is_floating_point() else t  # noqa: E731
                args, kwargs = map_tensors(to_param, args), map_tensors(to_param, kwargs)
            if self._in_backward:  # recomputed by activation checkpointing: the unit is gathered
                return args, kwargs
            if self._root is None:
                self._root = i  # the first unit to run forward is the root of the iteration
            if i not in self._modules:
                self._modules[i] = module
                # a gradient counts unsharded until its unit's post-backward (runs after the estimate's hook)
                for p in self._params(i):
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(self._unsharded_grad)
            self._gather(i, forward=True)
            needing = [t for t in iter_tensors((args, kwargs)) if t.requires_grad]
            if needing:
                out = iter(_PostBackward.apply(self, i, *needing))
                args, kwargs = map_tensors(lambda t: next(out) if t.requires_grad else t, (args, kwargs))
            return args, kwargs

        return hook

    def _post_forward_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if self.layout.output_dtype is not None:
                dtype = self.layout.output_dtype
                output = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)
            if self._in_backward:
                return output
            if self.reshards[i]:
                self._gathered.pop(i, None)
            if i == self._root:  # the end of forward frees the last all-gather's flat output
                self._held_flat = None
            self._forward_order.append(i)
            for t in iter_tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad: self._pre_backward(i))
            return output

        return hook

    def _unsharded_grad(self, p: torch.Tensor) -> None:
        if self.tracker is not None and p.grad is not None:
            self.tracker.track(p.grad, _BUFFERS)

    # -- backward -------------------------------------------------------------------------------
    def _pre_backward(self, i: int) -> None:
        if i in self._backward_started:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._backward_started.add(i)
        self._gather(i, forward=False)
        order = self._forward_order
        at = order.index(i) if i in order else 0
        before = [j for j in order[:at] if j not in self._backward_started and j not in self._gathered]
        if before and before[-1] not in self._prefetched:
            flat = self._all_gather(before[-1])
            if flat is not None:
                self._prefetched[before[-1]] = flat

    def post_backward(self, i: int) -> None:
        """The unit's backward is done: reshard, reduce-scatter its gradients into shards."""
        if i in self._backward_done:
            return
        self._backward_done.add(i)
        self._gathered.pop(i, None)
        self._held = None  # the previous unit's reduce-scatter input
        layout = self.layout
        unsharded = self.trainable[i]
        if not unsharded:  # nothing to reduce: a frozen unit
            return
        rs_input = self._alloc(unsharded * layout.reduce_dtype.itemsize // layout.param_dtype.itemsize)
        if self.tracker is not None and i in self._modules:
            for p in self._params(i):
                if p.grad is not None:
                    self.tracker.track(p.grad, "gradients")  # a shard from now on
        shard = -(-unsharded // layout.shard_world)
        rs_output = self._alloc(shard * layout.reduce_dtype.itemsize // layout.param_dtype.itemsize)
        del rs_output  # becomes the gradient shard (counted as gradients), cast to the master dtype
        self._held = rs_input

    def _end_of_backward(self) -> None:
        for i in reversed(self._forward_order):
            self.post_backward(i)
        self._held = None
        self._prefetched.clear()
        self._gathered.clear()


def per_rank(estimate: MemoryEstimate, layout: ShardedLayout, spec: PrecisionSpec) -> ShardedEstimate:
    """One rank's estimate from the trace of the unsharded copy with :class:`RankBuffers` in it."""
    peaks, policy = phase_peaks(estimate), layout.policy(spec)
    if estimate.traced:  # FSDP2's buffers are in the trace
        peak = sharded_rank_peak(peaks, policy, (), layout.shard_world, "full")
    else:  # the analytic bound ran no hooks: the gathered units and the unit's gradient added by phase
        gathered = [u.gathered_bytes for u in layout.units if u.reshards]
        resident = [u.gathered_bytes for u in layout.units if not u.reshards]
        peak = sharded_rank_peak(peaks, policy, gathered, layout.shard_world, "full", resident=resident)
    what = layout.describe()
    kept = sum(not u.reshards for u in layout.units)
    note = (
        f"{what}: the step traced from the DTensors' global shapes with one rank's FSDP2 buffers "
        f"({len(layout.units)} units, {kept} kept gathered from forward to backward), model state divided "
        f"over {layout.shard_world}"
    )
    fields = {f.name: getattr(estimate, f.name) for f in dataclasses.fields(MemoryEstimate)}
    fields.update(
        peak_bytes=peak.bytes,
        breakdown=peak.breakdown,
        peak_phase=peak.phase,
        peak_op=estimate.peak_op if peak.phase == estimate.peak_phase else None,
        persistent_bytes=peak.persistent_bytes + estimate.breakdown.get("other", 0),
        phase_peak_bytes=dict(peak.phase_bytes),
        warnings=(note, *estimate.warnings),
        timeline=(),
        allocations=(),
        initial_allocations=(),
        assumed_target=f"{estimate.assumed_target}; {what}",
    )
    return ShardedEstimate(
        **fields, layout=layout, unsharded=estimate, allocator_overhead=rank_overhead(estimate)
    )
