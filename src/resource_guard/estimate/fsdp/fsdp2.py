"""FSDP2 (``fully_shard``): the estimate of a sharded module is one rank's step.

A module that ``torch.distributed.fsdp.fully_shard`` has sharded holds DTensor parameters (global
shape and dtype, a local shard) and, per unit (each module ``fully_shard`` was applied to), a
``MixedPrecisionPolicy``, a mesh and whether it reshards after forward. The estimate reads those
from the module (:func:`sharded_layout`; the user does not repeat them) and traces the step of an
unsharded copy built from the global shapes (:func:`unsharded_copy`: nothing is gathered, nothing
of model size allocated), with the parameters in the gathered ``param_dtype``, buffers in their own
dtype, and hooks on each unit that cast its inputs and outputs as FSDP2 does and allocate one rank's
gathered parameters and reduce-scatter buffers in FSDP2's order
(:class:`~resource_guard.estimate.fsdp.fsdp2_step.RankBuffers`). The trace is then divided into one
rank's share (:func:`~resource_guard.estimate.fsdp.fsdp2_step.per_rank`): master, gradient and
optimizer-state shards (the optimizer's state is per parameter, so a rank holds that of its shards).

Not handled, refused with the remedy: FSDP1 ``FullyShardedDataParallel``, tensor-parallel meshes
(placements other than ``Shard(0)``/``Replicate()``), CPU offload, parameters that ``fully_shard``
ignored, and units with different mixed-precision policies, parameter dtypes or meshes.

Example (one rank of gloo here; on N GPUs the same call on any rank gives that rank's step):
    >>> import tempfile, torch, torch.distributed as dist
    >>> from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    >>> from resource_guard import estimate_memory
    >>> store = tempfile.NamedTemporaryFile(delete=False).name
    >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    >>> model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    >>> _ = fully_shard(model[0], mp_policy=policy), fully_shard(model, mp_policy=policy)
    >>> est = estimate_memory(model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64),
    ...                       lambda m, b: m(b).float().square().mean())
    >>> est.layout.describe()
    'FSDP2 fully_shard over 1 rank, param_dtype bf16, reduce_dtype bf16, per-rank'
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.fsdp.fsdp2_step import RankBuffers, ShardedLayout, Unit
from resource_guard.step.training import OptimizerArg

__all__ = [
    "ShardedLayout",  # defined with the rank's step, in fsdp2_step
    "Unit",
    "is_fsdp1",
    "is_fully_sharded",
    "sharded_layout",
    "unsharded_copy",
]


def _fsdp_module_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_fully_sharded(model: Any) -> bool:
    """Whether ``model`` or one of its submodules was sharded by FSDP2's ``fully_shard``."""
    cls = _fsdp_module_class()
    return (
        cls is not None and isinstance(model, nn.Module) and any(isinstance(m, cls) for m in model.modules())
    )


def is_fsdp1(model: Any) -> bool:
    """Whether ``model`` holds an FSDP1 ``FullyShardedDataParallel`` wrapper."""
    if not (torch.distributed.is_available() and isinstance(model, nn.Module)):
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


@dataclass(frozen=True)
class _Group:
    mp_policy: Any
    reshards: bool
    auto_reshard: bool
    offloads: bool
    params: tuple[Any, ...]


# FSDP2 has no public getter for a unit's MixedPrecisionPolicy, offload policy and reshard_after_forward:
# they are read from its state (`FSDPModule._get_fsdp_state()` and the state's parameter groups), here
# only. tests/estimate/test_fsdp2.py fails loudly if they move.
def _unit_groups(module: nn.Module) -> list[_Group]:
    """The parameter groups of one ``fully_shard`` unit."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.13: at most one group per state
        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
    out = []
    for g in groups:
        after = g.post_forward_mesh_info
        # resharded to a smaller world after forward: counted as kept gathered (an upper bound)
        reshards = after is not None and after.shard_mesh_size == g.mesh_info.shard_mesh_size
        offloads = type(g.offload_policy).__name__ == "CPUOffloadPolicy"
        auto = bool(getattr(state, "_auto_reshard_after_forward", False))
        out.append(
            _Group(g.mp_policy, reshards, auto, offloads, tuple(fp.sharded_param for fp in g.fsdp_params))
        )
    return out


def _mesh_sizes(p: Any) -> tuple[int, int]:
    """``(shard world, replicas)`` of a DTensor parameter's placements on its mesh."""
    from torch.distributed.tensor import Replicate, Shard

    shard = replicas = 1
    for dim, placement in enumerate(p.placements):
        size = p.device_mesh.size(dim)
        if isinstance(placement, Shard) and placement.dim == 0:
            shard *= size
        elif isinstance(placement, Replicate):
            replicas *= size
        else:
            raise ConfigurationError(
                f"`estimate_memory(model=...)`: a parameter of shape {tuple(p.shape)} is placed as "
                f"{p.placements} on its mesh; only FSDP2's Shard(0) (and HSDP's Replicate()) are estimated "
                "per rank. Pass the module before tensor/sequence parallelism and fully_shard, and "
                "plan(strategy='fsdp')."
            )
    return shard, replicas


def _padded_numel(p: Any) -> int:
    """Elements of ``p`` as FSDP2 gathers it: dim 0 padded to a multiple of the shard world."""
    world, _ = _mesh_sizes(p)
    shape = tuple(p.shape) or (1,)
    rest = 1
    for d in shape[1:]:
        rest *= d
    return -(-shape[0] // world) * world * rest


def _units(model: nn.Module, fsdp_cls: type) -> Iterator[tuple[str, nn.Module, bool]]:
    """``(path, module, is a root)`` of every ``fully_shard`` unit: a root has no unit above it."""
    stack: list[tuple[str, nn.Module, bool]] = [("", model, False)]
    while stack:
        name, m, under = stack.pop()
        unit = isinstance(m, fsdp_cls)
        if unit:
            yield name, m, not under
        for child_name, child in reversed(list(m.named_children())):
            stack.append((f"{name}.{child_name}" if name else child_name, child, under or unit))


def sharded_layout(model: nn.Module) -> ShardedLayout:
    """The sharding ``fully_shard`` applied to ``model``, read from its units and DTensor parameters."""
    from torch.distributed.tensor import DTensor

    fsdp_cls = _fsdp_module_class()
    if fsdp_cls is None or not is_fully_sharded(model):
        raise ConfigurationError(f"`sharded_layout`: {type(model).__name__} is not sharded by fully_shard.")
    who = "`estimate_memory(model=...)`"
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise ConfigurationError(
            f"{who}: parameter(s) {', '.join(plain[:3])} are not sharded (fully_shard's `ignored_params`, "
            "or outside every fully_shard unit); shard every parameter, or pass the module before "
            "fully_shard and plan(strategy='fsdp')."
        )
    units: list[Unit] = []
    policies: set[tuple[Any, ...]] = set()
    meshes: set[tuple[int, int]] = set()
    masters: set[torch.dtype] = set()
    for name, module, root in _units(model, fsdp_cls):
        nbytes, trainable, copy_in, reshards = 0, 0, 0, True
        for g in _unit_groups(module):
            if g.offloads:
                raise ConfigurationError(
                    f"{who}: unit {name or '(root)'} offloads to the CPU (CPUOffloadPolicy); the per-rank "
                    "estimate is of device memory without offload. Pass the module before fully_shard."
                )
            master = next((p.dtype for p in g.params if p.is_floating_point()), torch.float32)
            param_dtype = g.mp_policy.param_dtype or master
            reduce_dtype = g.mp_policy.reduce_dtype or param_dtype
            policies.add(
                (param_dtype, reduce_dtype, g.mp_policy.output_dtype, g.mp_policy.cast_forward_inputs)
            )
            masters.update(p.dtype for p in g.params if p.is_floating_point())
            meshes.update(_mesh_sizes(p) for p in g.params)
            for p in g.params:
                size = _padded_numel(p) * (param_dtype if p.is_floating_point() else p.dtype).itemsize
                nbytes += size
                trainable += size if p.requires_grad else 0
                # FSDP2 casts a floating shard to a param_dtype unlike its own into a flat all-gather
                # input (`_get_param_all_gather_inputs`); otherwise the input is a view of the output
                if p.is_floating_point() and param_dtype != p.dtype:
                    copy_in += size // _mesh_sizes(p)[0]
            # FSDP2 keeps a root gathered from forward to backward unless reshard_after_forward was set
            reshards = reshards and g.reshards and not (root and g.auto_reshard)
        units.append(Unit(name, nbytes, reshards, trainable, copy_in))
    if len(policies) != 1 or len(masters) > 1 or len(meshes) != 1:
        raise ConfigurationError(
            f"{who}: the fully_shard units differ in MixedPrecisionPolicy, parameter dtype or mesh "
            f"({len(policies)} policies, {len(masters)} dtypes, {len(meshes)} meshes); the per-rank "
            "estimate takes one of each. Pass the module before fully_shard and plan(strategy='fsdp')."
        )
    param_dtype, reduce_dtype, output_dtype, cast_inputs = policies.pop()
    shard, replicas = meshes.pop()
    first: Any = next(iter(model.parameters()))
    return ShardedLayout(
        shard, replicas, first.device_mesh.device_type, param_dtype, reduce_dtype, output_dtype,
        bool(cast_inputs), masters.pop() if masters else torch.float32, tuple(units),
    )  # fmt: skip


_FSDP_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def _is_fsdp_hook(hook: Any) -> bool:
    fn = getattr(hook, "__func__", None) or getattr(hook, "func", None) or hook
    return str(getattr(fn, "__module__", "")).startswith("torch.distributed.fsdp")


def _plain_class(module: nn.Module, fsdp_cls: type) -> type[nn.Module]:
    cls = type(module)
    if not isinstance(module, fsdp_cls):
        return cls
    return next(c for c in cls.__mro__[1:] if issubclass(c, nn.Module) and not issubclass(c, fsdp_cls))


def unsharded_copy(
    model: nn.Module, layout: ShardedLayout, optimizer: OptimizerArg
) -> tuple[nn.Module, OptimizerArg, RankBuffers]:
    """The unsharded module on the ``meta`` device, the optimizer over its parameters, and the hooks
    that allocate one rank's FSDP2 buffers while it runs.

    Each DTensor parameter becomes a ``meta`` parameter of its global shape in ``param_dtype``;
    buffers are kept (the estimate fakes them); the FSDP classes, state and hooks are left out, and
    each unit gets :class:`~resource_guard.estimate.fsdp.fsdp2_step.RankBuffers`' hooks, which also do
    what FSDP2 does to its inputs (``cast_forward_inputs``) and outputs (``output_dtype``). The
    optimizer keeps its type, hyperparameters and hooks, over the new parameters, without state (the
    estimate creates a steady-state one; it is per parameter, so a rank holds that of its shards).
    ``model`` and ``optimizer`` are not touched.
    """
    fsdp_cls = _fsdp_module_class()
    if fsdp_cls is None:
        raise ConfigurationError("`unsharded_copy`: torch.distributed is not available.")
    params: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        dtype = layout.param_dtype if p.is_floating_point() else p.dtype
        params[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"), p.requires_grad)
    copies: dict[int, nn.Module] = {}

    def plain(module: nn.Module) -> nn.Module:
        if id(module) in copies:
            return copies[id(module)]
        cls = _plain_class(module, fsdp_cls)
        new = object.__new__(cls)  # the module's own class, without FSDP's (no __init__: state copied)
        copies[id(module)] = new
        state: dict[str, Any] = {}
        for key, value in module.__dict__.items():
            if key.startswith("__composable_api_state_key") or key in _FSDP_FLAGS:
                continue
            if key.endswith("hooks") and isinstance(value, dict):
                value = collections.OrderedDict((k, h) for k, h in value.items() if not _is_fsdp_hook(h))
            state[key] = value
        state["_parameters"] = {
            k: None if p is None else params[id(p)] for k, p in module._parameters.items()
        }
        state["_buffers"] = dict(module._buffers)
        state["_modules"] = {k: None if c is None else plain(c) for k, c in module._modules.items()}
        new.__dict__.update(state)
        return new

    copied = plain(model)
    units = []
    for _, unit, _ in _units(model, fsdp_cls):
        managed = {id(p) for g in _unit_groups(unit) for p in g.params}
        paths: list[tuple[str, str]] = []
        for path, sub in unit.named_modules():
            for name, p in sub._parameters.items():
                if p is not None and id(p) in managed:
                    managed.discard(id(p))
                    paths.append((path, name))
        units.append((copies[id(unit)], paths))
    buffers = RankBuffers(layout, units)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return copied, optimizer, buffers  # a factory: called with the fake parameters
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in params]
    if missing:
        raise ConfigurationError(
            f"`estimate_memory(optimizer=...)` holds {len(missing)} parameter(s) that are not the model's; "
            "build it over `model.parameters()` after fully_shard, or pass a factory."
        )
    opt = copy.copy(optimizer)
    opt.__dict__ = dict(optimizer.__dict__)
    opt.param_groups = [{**g, "params": [params[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    opt.state = collections.defaultdict(dict)
    return copied, opt, buffers
