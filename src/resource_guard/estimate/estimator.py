"""Pre-flight memory estimate of one full training step, without a GPU and without model-sized memory.

:func:`estimate_memory` copies the model and optimizer onto fake tensors (shapes, dtypes and strides,
no data), brings the optimizer to its steady state, then runs forward, loss, backward, optimizer step
and ``zero_grad`` while a :class:`~resource_guard.estimate.trace.tracer.StorageTracker` counts live storage
bytes
by category. The caller's model, optimizer, batch and RNG state are left untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from resource_guard.devices import DeviceSpec, resolve_device
from resource_guard.errors import ConfigurationError, ResourceGuardWarning
from resource_guard.estimate.analytic import analytic_estimate
from resource_guard.estimate.closure_step import (
    closure_state_bytes,
    needs_closure,
    stateless_stand_in,
    with_closure_state,
)
from resource_guard.estimate.emulate.target import Target
from resource_guard.estimate.fsdp.fsdp2 import is_fsdp1, is_fully_sharded, sharded_layout, unsharded_copy
from resource_guard.estimate.fsdp.fsdp2_step import RankBuffers, per_rank
from resource_guard.estimate.host import kernels as _kernels
from resource_guard.estimate.host.cpu_support import CpuStepCheck
from resource_guard.estimate.host.quiet import torch_logs_silenced
from resource_guard.estimate.result import TRACED, TRACED_RECOVERED, MemoryEstimate
from resource_guard.estimate.trace.composite import CompositeOps
from resource_guard.estimate.trace.fake_world import (
    AS_SET,
    FOR_LOOP,
    FOREACH,
    FakeStep,
    isolated_global_state,
    target_forward,
)
from resource_guard.estimate.trace.libraries import as_real_step
from resource_guard.estimate.trace.recovery import fake_mode as _fake_mode
from resource_guard.estimate.trace.recovery import fake_numpy
from resource_guard.estimate.trace.sparse import SPARSE_ROWS, SparseOps
from resource_guard.estimate.trace.tracer import PeakRecord, StorageTracker
from resource_guard.estimate.user_step import (
    UserStep,
    check_optimizers,
    manual_update_stand_in,
    run_user_step,
)
from resource_guard.step.precision import PrecisionSpec, parse_precision
from resource_guard.step.training import LossFn, OptimizerArg, batch_size_of, iter_tensors, training_step

__all__ = ["estimate_memory", "unwrap_model"]

_TIMELINE_POINTS = 2000


# -- input checks -----------------------------------------------------------------------------------
def _check_inputs(
    model: Any, optimizer: Any, batch: Any, loss_fn: Any = None, who: str = "estimate_memory"
) -> None:
    """Refuse bad arguments of ``who`` (``estimate_memory`` or ``plan``) before any tracing."""
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"`{who}(model=...)` must be a torch.nn.Module, got {type(model).__name__}.")
    if who != "estimate_memory" and is_fully_sharded(model):
        raise ConfigurationError(
            f"`{who}(model=...)`: {type(model).__name__} is already sharded by fully_shard, and {who} "
            "chooses the strategy itself: pass the module before fully_shard (estimate_memory takes the "
            "sharded module and gives its per-rank step)."
        )
    params = list(model.parameters())
    if not params:
        raise ConfigurationError(
            f"`{who}(model=...)`: {type(model).__name__} has no parameters, so a training step has nothing "
            "to train; pass the module that owns the weights."
        )
    if not any(p.requires_grad for p in params):
        raise ConfigurationError(
            f"`{who}(model=...)`: none of the {type(model).__name__}'s parameters requires grad, so a "
            "training step has nothing to train; unfreeze some (`p.requires_grad_(True)`)."
        )
    if isinstance(optimizer, (list, tuple)):
        check_optimizers(model, optimizer, loss_fn, who)
    elif isinstance(optimizer, torch.optim.Optimizer):
        own = {id(p) for p in params}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
        if foreign:
            shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
            raise ConfigurationError(
                f"`{who}(optimizer=...)` holds {len(foreign)} parameter(s) that are not the model's "
                f"(shapes {shapes}); build it over `model.parameters()`, or pass a factory "
                "`lambda params: torch.optim.AdamW(params)`."
            )
    elif optimizer is not None and not callable(optimizer):
        raise ConfigurationError(
            f"`{who}(optimizer=...)` must be a torch.optim.Optimizer over the model's parameters, a "
            "factory `params -> Optimizer`, or `optimizer=None` for a loop that updates the parameters "
            f"by hand (`p.data.add_(p.grad, alpha=-lr)`), got {type(optimizer).__name__}."
        )
    if batch is None:
        raise ConfigurationError(
            f"`{who}(batch=None)`: pass one sample batch as the training loop receives it."
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigurationError(
            f"`{who}(loss_fn={loss_fn!r})` must be a callable `(model, batch) -> loss` or None "
            "(then the model's output is the loss)."
        )


def _default_kind(model: nn.Module) -> str:
    for p in model.parameters():
        return "cuda" if p.device.type == "meta" else p.device.type
    return "cpu"


def _phase_of(key: str) -> str:
    return key.split(":")[0]


def _select(tracker: StorageTracker, variant: str) -> tuple[PeakRecord, dict[str, int]]:
    phase_peaks: dict[str, int] = {}
    best: PeakRecord | None = None
    for key, record in tracker.peaks.items():
        if key.startswith("optimizer:") and key != f"optimizer:{variant}":
            phase_peaks[key] = record.bytes
            continue
        phase = _phase_of(key)
        phase_peaks[phase] = max(phase_peaks.get(phase, 0), record.bytes)
        if key.startswith("optimizer:"):
            phase_peaks[key] = record.bytes
        if best is None or record.bytes > best.bytes:
            best = record
    assert best is not None  # the forward phase is always observed
    return best, phase_peaks


def _events_for(
    tracker: StorageTracker, spans: list[tuple[str, int, int]], variant: str
) -> list[tuple[int, int]]:
    skip = [(a, b) for key, a, b in spans if key.startswith("optimizer:") and key != f"optimizer:{variant}"]
    if not skip:
        return list(tracker.events)
    out = []
    for i, ev in enumerate(tracker.events):
        if not any(a <= i < b for a, b in skip):
            out.append(ev)
    return out


def _downsample(timeline: list[Any], phases_keep: Callable[[str], bool]) -> tuple[Any, ...]:
    kept = [pt for pt in timeline if phases_keep(pt[0])]
    if len(kept) <= _TIMELINE_POINTS:
        return tuple(kept)
    stride = len(kept) / _TIMELINE_POINTS
    return tuple(kept[int(i * stride)] for i in range(_TIMELINE_POINTS))


def _trace(
    model: nn.Module,
    optimizer: OptimizerArg,
    batch: Any,
    loss_fn: LossFn | None,
    spec: PrecisionSpec,
    device_kind: str,
    target: Target | None = None,
    rank_buffers: RankBuffers | None = None,
    sparse_rows: str = "bound",
    keep_outputs: bool = True,
) -> MemoryEstimate:
    started = time.perf_counter()
    # the forward runs as on the target: CUDA's autocast policy and attention kernels on a GPU target
    step_spec, step_loss_fn, forward = target_forward(target or Target(device_kind), spec, loss_fn)
    cpu_check = CpuStepCheck() if device_kind == "cpu" else None
    composite = CompositeOps(device_kind, cpu_autocast=step_spec.autocast_dtype)
    sparse = SparseOps(device_kind, rows=sparse_rows)
    tracker = StorageTracker(
        functools.partial(_kernels.kernel_extra, device_kind=device_kind, cpu_check=cpu_check),
        composite=composite,
        sparse=sparse,
    )
    if rank_buffers is not None:  # FSDP2: one rank's gathered units and reduce buffers, in the trace
        rank_buffers.bind(tracker)
    fake_mode = _fake_mode()
    spans: list[tuple[str, int, int]] = []
    with as_real_step(), fake_numpy(tracker.recovery), fake_mode, tracker, forward:
        world = FakeStep(model, optimizer, batch, spec, tracker)
        hooks = cpu_check.watch(world.model) if cpu_check is not None else []
        world.warm_up_optimizer()
        for st in (s for opt in world.optimizers for s in opt.state.values()):
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    tracker.track(v, "optimizer_state")
        for t in iter_tensors(world.batch):
            tracker.track(t, "inputs")
        user = isinstance(loss_fn, UserStep)  # the user's own step: the target's optimizer path only
        variants = world.optimizer_variants() if not user else {}
        scale = 2.0**16 if spec.loss_scaling else None
        current: list[Any] = ["forward", 0]

        def on_phase(phase: str) -> None:
            spans.append((current[0], current[1], len(tracker.events)))
            current[:] = [phase, len(tracker.events)]
            tracker.start_phase(phase)

        def optimizer_step() -> None:
            for name, foreach in variants.items():
                if name != AS_SET:
                    for g in world.optimizer.param_groups:
                        g["foreach"] = foreach
                on_phase(f"optimizer:{name}")
                world.optimizer.step()

        initial = tracker.live_storages()
        tracker.recording = True
        tracker.start_phase("forward")
        if user:
            run_user_step(world, step_loss_fn, step_spec, forward, on_phase, scale, device_kind)  # type: ignore[arg-type]
        else:
            training_step(
                world.model,
                world.optimizer,
                world.batch,
                step_loss_fn,
                step_spec,
                "cpu",
                on_phase=lambda ph: None if ph in ("forward", "optimizer") else on_phase(ph),
                loss_scale=scale,
                optimizer_step=optimizer_step,
                keep_outputs=None if keep_outputs else False,
            )
        spans.append((current[0], current[1], len(tracker.events)))
        tracker.detach()
        for hook in hooks:
            hook.remove()

    variant = AS_SET if AS_SET in variants else (FOREACH if device_kind in ("cuda", "rocm") else FOR_LOOP)
    best, phase_peaks = _select(tracker, variant)
    params = {id(p): p for p in model.parameters()}.values()
    recovered = tracker.recovery.summary()
    notes = [f"recovered {line}" for line in recovered] + composite.notes() + sparse.notes()
    unsupported = cpu_check.unsupported if cpu_check is not None else ()
    unknown = cpu_check.unknown if cpu_check is not None else ()
    notes += cpu_check.notes() if cpu_check is not None else []
    keep = lambda ph: not ph.startswith("optimizer:") or ph == f"optimizer:{variant}"  # noqa: E731
    persistent = sum(best.breakdown[c] for c in ("parameters", "optimizer_state", "other"))
    return MemoryEstimate(
        peak_bytes=best.bytes,
        breakdown=best.breakdown,
        method=TRACED if not recovered else TRACED_RECOVERED,
        precision=spec.name,
        device_kind=device_kind,
        peak_phase=_phase_of(best.phase),
        peak_op=best.op,
        batch_size=batch_size_of(batch),
        parameter_count=sum(p.numel() for p in params),
        trainable_parameter_count=sum(p.numel() for p in params if p.requires_grad),
        persistent_bytes=persistent,
        phase_peak_bytes=phase_peaks,
        warnings=tuple(notes),
        cpu_unsupported=tuple(u.describe() for u in unsupported),
        cpu_unknown=tuple(u.describe() for u in unknown),
        timeline=_downsample(tracker.timeline, keep),
        allocations=tuple(_events_for(tracker, spans, variant)),
        initial_allocations=initial,
        gradient_allocations=tracker.gradient_uids,
        sparse_gradient_allocations=tracker.sparse_gradient_uids,
        trace_seconds=time.perf_counter() - started,
        assumed_target=forward.describe(spec.name),
        recovered_ops=recovered,
    )


def estimate_memory(
    model: nn.Module,
    optimizer: OptimizerArg | None,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    precision: str = "32-true",
    device: str | DeviceSpec | None = None,
    sparse_rows: str = "bound",
    keep_outputs: bool = True,
) -> MemoryEstimate:
    """Estimate the memory of one steady-state training step.

    Args:
        model: the model, on any device including ``meta`` (nothing of its size is allocated); a
            module sharded by FSDP2's ``fully_shard`` gives one rank's step (a
            :class:`~resource_guard.estimate.fsdp.fsdp2_step.ShardedEstimate`; see
            :mod:`~resource_guard.estimate.fsdp.fsdp2`).
        optimizer: an optimizer over ``model``'s parameters, or a factory ``params -> Optimizer``;
            ``None`` for a loop that updates the parameters by hand (in place, no state, gradients
            freed by ``model.zero_grad()``;
            :func:`~resource_guard.estimate.user_step.manual_update_stand_in`).
        batch: one sample batch, as the training loop receives it.
        loss_fn: ``(model, batch) -> loss or output``; default: ``model(**batch)`` for a mapping,
            ``model(*batch)`` for a tuple/list, else ``model(batch)``, and the loss is the output if
            it is a scalar, else ``output.loss`` / ``output["loss"]``.
        precision: a Lightning precision name: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"``, ``"bf16-true"``.
        device: the kind of device the run will use (``"cuda"``, ``"cpu"``, ``"mps"``) or a catalog
            name; where PyTorch's behaviour depends on the device (the optimizer's foreach path), the
            target's behaviour counts. Default: the model's device (``meta`` means ``cuda``; for a
            ``fully_shard``-ed module, its mesh's device).
        sparse_rows: how many distinct rows a sparse gradient keeps once coalesced (``Adagrad``'s and
            ``SparseAdam``'s state updates and temporaries grow with them): ``"bound"`` (default) takes
            the number of indices, never under for any batch of these shapes; ``"batch"`` counts the
            sample batch's own distinct indices (exact for that batch, under for a same-shape batch
            with more distinct indices). ``est.warnings`` says which was used.
        keep_outputs: the model's outputs stay alive through backward and the optimizer step, as in a
            loop that holds them in a variable (``logits, loss = model(x, y)``; ``output = model(x)``
            then ``loss = crit(output, y)``); ``False`` for a step that frees them once the loss is
            computed (``loss = crit(model(x), y)``). A ``loss_fn`` may say so itself with a
            ``keep_outputs = False`` attribute (:class:`~resource_guard.step.training.OutputsDropped`).

    Returns:
        A :class:`MemoryEstimate`.

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        >>> est = estimate_memory(model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64),
        ...                       lambda m, b: m(b).square().mean(), device="cpu")
        >>> est.breakdown["optimizer_state"] >= 2 * est.breakdown["parameters"]
        True
    """
    model, unwrapped = unwrap_model(model)
    _check_inputs(model, optimizer, batch, loss_fn)
    if optimizer is None:  # manual updates: in place, no state, gradients freed by zero_grad
        optimizer = manual_update_stand_in(model)
    if sparse_rows not in SPARSE_ROWS:
        choices = ", ".join(map(repr, SPARSE_ROWS))
        raise ConfigurationError(f"`estimate_memory(sparse_rows={sparse_rows!r})` must be one of {choices}.")
    spec = parse_precision(precision)
    layout = sharded_layout(model) if is_fully_sharded(model) else None
    trace_spec, buffers = spec, None
    if layout is not None:  # FSDP2: trace the unsharded step from the global shapes, then one rank's share
        trace_spec = layout.trace_spec(spec)
        model, optimizer, buffers = unsharded_copy(model, layout, optimizer)
    default = layout.device_type if layout is not None else _default_kind(model)
    kind = _device_kind(device) if device is not None else default
    target = Target.of(device, kind)
    closure = None
    if isinstance(optimizer, torch.optim.Optimizer) and needs_closure(optimizer):
        # LBFGS: the closure's step traced, its vectors added (estimate/closure_step.py)
        closure, optimizer = closure_state_bytes(optimizer), stateless_stand_in(optimizer)
    with isolated_global_state():
        try:
            with torch_logs_silenced():  # a failed fake kernel is reported below, not by torch's log
                est = _trace(
                    model, optimizer, batch, loss_fn, trace_spec, kind, target, buffers, sparse_rows,
                    keep_outputs=keep_outputs,
                )  # fmt: skip
        except ConfigurationError:
            raise
        except Exception as exc:  # the step cannot continue past an operator: fall back, as an upper bound
            reason = f"tracing failed ({type(exc).__name__}: {_first_line(exc)})"
            warnings.warn(f"{reason}; analytic upper bound", ResourceGuardWarning, stacklevel=2)
            with torch_logs_silenced():  # the bound's own fake optimizer step may fail the same way
                est = analytic_estimate(model, optimizer, batch, trace_spec, kind, reason=reason)
            est = dataclasses.replace(est, assumed_target=f"as on {target.describe()}, {spec.name}")
    if closure is not None:  # the bound holds for the analytic fallback too
        est = with_closure_state(est, closure)
    if layout is not None:
        est = per_rank(est, layout, spec)
    return dataclasses.replace(est, warnings=unwrapped + est.warnings) if unwrapped else est


def unwrap_model(model: Any) -> tuple[Any, tuple[str, ...]]:
    """The module whose eager training step is estimated, and a note per wrapper taken off.

    ``torch.compile(model)`` (an ``OptimizedModule``) runs the same tensors as the eager step of the
    module it compiled, less what the compiler fuses away: the eager step is an upper bound, and is
    what is traced. DDP's wrapper adds gradient buckets that belong to the strategy (``plan``'s
    ``strategy="ddp"`` accounts for them per rank); the local module's step is traced. An FSDP2
    (``fully_shard``) module is not a wrapper and is returned as is: :func:`estimate_memory` gives its
    per-rank step (:mod:`resource_guard.estimate.fsdp.fsdp2`). FSDP1's ``FullyShardedDataParallel`` wraps
    flat parameters whose global shapes it hides: refused with what to pass instead.
    """
    notes: list[str] = []
    while True:
        name = type(model).__name__
        if isinstance(model, nn.Module) and name == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod
            notes.append(
                "torch.compile'd model: estimated the eager step of the compiled module (an upper bound)"
            )
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
            notes.append(
                "DDP-wrapped model: estimated the local module's step; DDP's gradient buckets are "
                "accounted by plan(strategy='ddp')"
            )
        else:
            break
    if is_fsdp1(model):
        raise ConfigurationError(
            f"`estimate_memory(model=...)`: {type(model).__name__} is wrapped by FSDP1's "
            "FullyShardedDataParallel, whose flat parameters hide the model's shapes; shard it with FSDP2's "
            "`fully_shard` (estimated per rank), or pass the module before wrapping and "
            "plan(strategy='fsdp', world_size=N) for the per-rank memory."
        )
    return model, tuple(notes)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


def _device_kind(device: Any) -> str:
    if hasattr(device, "kind"):
        return str(device.kind)
    if not isinstance(device, (str, torch.device)):
        raise ConfigurationError(
            f"`estimate_memory(device={device!r})` must be a device kind ('cuda', 'cpu', 'mps'), a catalog "
            "name such as 'a100-40gb', a DeviceSpec or None."
        )
    name = str(device).strip().lower()
    for kind in ("cuda", "cpu", "mps", "rocm"):
        if name == kind or name.startswith(kind + ":"):
            return kind
    try:
        return resolve_device(name).kind
    except ConfigurationError as exc:
        detail = str(exc).partition("`: ")[2] or str(exc)  # drop resolve_device's own call quote
        raise ConfigurationError(f"`estimate_memory(device={device!r})`: {detail}") from None
