"""Auto-configuration: pick device, precision, checkpointing, micro-batch, accumulation and strategy.

:func:`plan` decides from a few memory estimates (traces on fake tensors), never from real steps.
The rules, each covered by a test:

1. **Device** ``"auto"``: the CUDA/ROCm GPU with the most free memory (``CUDA_VISIBLE_DEVICES``
   respected, no CUDA context created), else MPS, else the CPU. ``"cpu"``, ``"cuda:N"``, ``"mps"``
   name a local device; a catalog name (``"a100-40gb"``, ``"t4"``) plans for that device without it
   being present. ``memory_limit`` (bytes or ``"6GiB"``) plans as if the device had only that much.
2. **Precision** ``"auto"``: ``bf16-mixed`` where the device has native bf16 (Ampere+, H100, MI300,
   Apple M2+); ``16-mixed`` (loss scaling) on older CUDA GPUs (T4, V100); ``32-true`` on an MPS
   device without bf16 and on a CPU unless it has native bf16 (``amx_bf16``/``avx512_bf16``, Arm
   ``bf16``), as the CPU profile says (:func:`~resource_guard.devices.cpu.cpu_profile`: a
   ``ONEDNN_MAX_CPU_ISA`` cap below bf16 gets the fp32 plan); the reason names the CPU and the cap.
   An explicit precision is respected, never overridden.
3. **Batch**: ``micro_batch_size × accumulation_steps × world_size == target_batch_size`` exactly, so
   the micro-batch is a divisor of the per-rank batch. The plan says when the target has few
   divisors (prime-ish) and a non-divisor micro-batch would have been larger.
4. **Fastest that fits**: a configuration fits when the device would show at most
   ``capacity × (1 − headroom)`` (:meth:`MemoryEstimate.for_device`: allocator, context, workspace).
   Among those that fit, the lowest relative cost wins (ties: no checkpointing, fewer moving parts).
   Cost model (documented assumptions, not measurements): a micro-step of ``m`` samples costs
   ``m + 8`` sample-units (fixed per-step overhead); activation checkpointing multiplies compute by
   1.3 (one more forward); FSDP by 1.1 against DDP (the extra all-gathers). So the full batch is best,
   then the largest micro-batch with accumulation; checkpointing only when nothing fits without it or
   when its larger micro-batch makes the step at least 10% cheaper by this model (e.g. 4× a
   micro-batch below ~16).
5. **Search**: peak memory is near-linear in the micro-batch. The planner traces the full per-rank
   batch (done if it fits), then micro-batch 1, interpolates to the largest divisor predicted to fit,
   and verifies by tracing it and the next divisor up until the largest fitting divisor has a traced
   fit and its next divisor a traced non-fit. ``Plan.traces`` counts the traces. The batch of size
   ``b`` is the sample batch sliced or repeated along dim 0; tensors above 4M elements are made on the
   ``meta`` device, so no large batch is allocated.
6. **Strategy**: with ``world_size > 1``, DDP (full replica + gradient buckets) and FSDP full-shard
   are both sized per rank (:mod:`resource_guard.planning.strategy`); the cheaper that fits wins.
   ``strategy="fsdp_grad_op"`` (ZeRO-2) and ``"hsdp"`` (sharded within ``gpus_per_node``) are sized
   when asked for. FSDP's precision is its own mixed-precision policy (``fsdp_mixed_precision``,
   :mod:`resource_guard.estimate.fsdp.sharding`): by default 16-bit parameters gathered per unit, fp32
   sharded master and optimizer state, as Lightning's ``FSDPStrategy`` does; ``"autocast"`` models
   fp32 parameters under autocast and says what the 16-bit policy would save.
8. **Verdict**: ``Plan.verdict`` is ``"fits"``, or ``"fits tight"`` when a configuration is only
   found inside the headroom (every configuration that fits with headroom is preferred).
7. **Nothing fits**: :class:`~resource_guard.errors.DoesNotFitError` with a :class:`NoFitReport`:
   needed vs available, the alternatives tried, the catalog devices where it would fit, and how many
   of this device FSDP would need.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    >>> p = plan(model, torch.optim.AdamW, torch.randn(32, 64), lambda m, b: m(b).square().mean(),
    ...          device="a100-40gb")
    >>> p.precision, p.micro_batch_size, p.accumulation_steps, p.strategy
    ('bf16-mixed', 32, 1, 'single')
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from resource_guard.devices import (
    Catalog,
    DeviceSpec,
    cpu_profile,
    load_catalog,
    parse_memory_limit,
    resolve_device,
)
from resource_guard.errors import ConfigurationError, DoesNotFitError, ResourceGuardWarning
from resource_guard.estimate import DeviceFit, MemoryEstimate
from resource_guard.estimate.estimator import _check_inputs
from resource_guard.estimate.fsdp.sharding import FsdpPrecision, autocast_copy_bytes, fsdp_precision
from resource_guard.estimate.result import ANALYTIC
from resource_guard.planning.checkpointing import find_checkpoint_blocks
from resource_guard.planning.nofit import NoFitReport, batch_reasons, no_fit_error
from resource_guard.planning.op_time import StepTimeModel
from resource_guard.planning.search import (
    CHECKPOINT_COST,
    CHECKPOINT_MARGIN,
    FSDP_COST,
    MICRO_STEP_OVERHEAD_SAMPLES,
    Alternative,
    Candidate,
    Tracer,
    relative_cost,
    render_table,
    search_largest,
)
from resource_guard.planning.speed import (
    describe_win,
    mark_times,
    resolve_step_model,
    step_ms,
    time_candidates,
)
from resource_guard.planning.strategy import GPUS_PER_NODE, SHARDED, STRATEGIES, RankMemory, unit_param_bytes
from resource_guard.step.batching import divisors, rows_error
from resource_guard.step.precision import parse_precision
from resource_guard.step.training import LossFn, OptimizerArg, batch_size_of

__all__ = [
    "Alternative",
    "NoFitReport",
    "Plan",
    "plan",
    "choose_precision",
    "relative_cost",
    "CHECKPOINT_COST",
    "CHECKPOINT_MARGIN",
    "FSDP_COST",
    "MICRO_STEP_OVERHEAD_SAMPLES",
]

_MiB = 2**20


@dataclass(frozen=True)
class Plan:
    """A training configuration that fits, with its reasons and the alternatives it beat.

    Attributes:
        device: the device planned for (capacity capped by ``memory_limit``).
        precision: Lightning precision name.
        checkpointing: whether activation checkpointing is on; ``checkpointed_modules`` names the modules.
        checkpoint_every: 0 (off), 1 (every block) or k (every k-th block: selective, tried at the
            chosen micro-batch when checkpointing every block was needed).
        micro_batch_size / accumulation_steps / world_size: ``micro × accumulation × world == target``.
        strategy: ``"single"``, ``"ddp"`` or ``"fsdp"``.
        target_batch_size: the effective batch size per optimizer step.
        estimate: the traced estimate of the chosen micro-batch (single-device figures).
        fit: what the device would show per rank for the chosen configuration.
        rank_memory: per-rank breakdown under DDP/FSDP (None for ``"single"``).
        reasons: one human-readable line per decision.
        alternatives: the configurations considered, best first.
        traces: number of estimate traces the plan used.
        headroom: the fraction of capacity kept free.
        fsdp_precision: the FSDP mixed-precision policy assumed (None unless the strategy is FSDP).

    :attr:`verdict` is the fit's: ``"fits"`` or ``"fits tight"`` (inside the headroom).
    """

    device: DeviceSpec
    precision: str
    checkpointing: bool
    checkpointed_modules: tuple[str, ...]
    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    strategy: str
    target_batch_size: int
    estimate: MemoryEstimate = field(repr=False)
    fit: DeviceFit = field(repr=False)
    reasons: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = field(default=(), repr=False)
    traces: int = 0
    headroom: float = 0.1
    rank_memory: RankMemory | None = field(default=None, repr=False)
    fsdp_precision: FsdpPrecision | None = field(default=None, repr=False)
    checkpoint_every: int = 0

    @property
    def verdict(self) -> str:
        return self.fit.verdict

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "device": self.device.name,
            "capacity_bytes": self.fit.capacity_bytes,
            "usable_bytes": self.fit.usable_bytes,
            "predicted_peak_bytes": self.fit.device_total_bytes,
            "verdict": self.verdict,
            "fsdp_precision": self.fsdp_precision.name if self.fsdp_precision is not None else None,
            "precision": self.precision,
            "checkpointing": self.checkpointing,
            "checkpointed_modules": list(self.checkpointed_modules),
            "checkpoint_every": self.checkpoint_every,
            "micro_batch_size": self.micro_batch_size,
            "accumulation_steps": self.accumulation_steps,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "target_batch_size": self.target_batch_size,
            "headroom": self.headroom,
            "traces": self.traces,
            "reasons": list(self.reasons),
            "alternatives": [dict(a.__dict__, config=a.config()) for a in self.alternatives],
            "estimate": self.estimate.to_dict(),
        }

    def summary(self) -> str:
        """Markdown: the decision, its reasons and the alternatives table."""
        f = self.fit
        head = (
            f"**Plan**: {self.micro_batch_size} × {self.accumulation_steps} accumulation"
            f" × {self.world_size} ({self.strategy}) = {self.target_batch_size} on {self.device.name},"
            f" {self.precision}, checkpointing {_ckpt_words(self.checkpoint_every)};"
            f" predicted {f.device_total_bytes / _MiB:,.1f} of {f.usable_bytes / _MiB:,.1f} MiB usable"
            f" ({self.traces} traces)"
        )
        if self.verdict != "fits":
            head += f"; **{self.verdict}**: " + "; ".join(f.tight_risks)
        return "\n".join([head, "", *(f"- {r}" for r in self.reasons), "", render_table(self.alternatives)])

    def __str__(self) -> str:
        return self.summary()


def _ckpt_words(every: int) -> str:
    return "off" if not every else "on" if every == 1 else f"every {every} blocks"


# -- rules ------------------------------------------------------------------------------------------
def choose_precision(device: DeviceSpec) -> tuple[str, str]:
    """The ``"auto"`` precision for ``device`` and the reason (rule 2)."""
    if device.kind in ("cuda", "rocm"):
        if device.bf16:
            return (
                "bf16-mixed",
                f"{device.name} supports bf16 (compute capability {device.compute_capability})",
            )
        return (
            "16-mixed",
            f"{device.name} has no bf16 (compute capability {device.compute_capability}): "
            "fp16 with loss scaling",
        )
    if device.kind == "mps":
        if device.bf16:
            return "bf16-mixed", f"{device.name} supports bf16"
        return "32-true", f"{device.name} has no bf16 (Apple M1): fp32"
    cpu = cpu_profile()  # the oneDNN cap included: a cap below bf16 plays a CPU without it
    return ("bf16-mixed" if cpu.native_bf16 else "32-true"), cpu.native_bf16_reason()


def _check_args(
    headroom: Any,
    target: Any,
    world_size: Any,
    strategy: Any,
    checkpointing: Any,
    call: str = "plan",
) -> None:
    """Refuse bad planning arguments, quoting ``call`` (``guard`` checks its own the same way)."""
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 0.9:
        raise ConfigurationError(f"`{call}(headroom={headroom!r})` must be a number in [0, 0.9)")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 1):
        raise ConfigurationError(f"`{call}(target_batch_size={target!r})` must be a positive int or None")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigurationError(f"`{call}(world_size={world_size!r})` must be an int >= 1")
    if strategy not in ("auto", *STRATEGIES):
        allowed = ", ".join(repr(s) for s in ("auto", *STRATEGIES))
        raise ConfigurationError(f"`{call}(strategy={strategy!r})` must be one of {allowed}")
    if strategy == "single" and world_size > 1:
        raise ConfigurationError(
            f"`plan(strategy='single', world_size={world_size})`: one device cannot have {world_size} ranks; "
            "use strategy='ddp', 'fsdp' or 'auto', or world_size=1."
        )
    if not (checkpointing == "auto" or isinstance(checkpointing, bool)):  # 1 and 0 are not flags
        raise ConfigurationError(f"`{call}(checkpointing={checkpointing!r})` must be 'auto', True or False")


@contextlib.contextmanager
def _collect_warnings(seen: dict[str, None]) -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceGuardWarning)
        yield
    for w in caught:
        if issubclass(w.category, ResourceGuardWarning):
            seen.setdefault(str(w.message), None)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


# -- the planner ------------------------------------------------------------------------------------
def plan(
    model: nn.Module,
    optimizer: OptimizerArg,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    device: str | DeviceSpec = "auto",
    target_batch_size: int | None = None,
    headroom: float = 0.1,
    precision: str = "auto",
    checkpointing: bool | str = "auto",
    world_size: int = 1,
    strategy: str = "auto",
    memory_limit: int | str | None = None,
    catalog: Catalog | str | os.PathLike[str] | None = None,
    fsdp_mixed_precision: str = "params",
    gpus_per_node: int = GPUS_PER_NODE,
    allow_rough: bool = False,
    step_time: str | StepTimeModel = "rule",
) -> Plan:
    """Choose the fastest training configuration that fits (rules in the module docstring).

    Args:
        model, optimizer, batch, loss_fn: as for :func:`~resource_guard.estimate.estimator.estimate_memory`;
            ``batch`` is one sample batch (any size: it is sliced or repeated to the sizes tried).
        device: ``"auto"``, ``"cpu"``, ``"cuda:N"``, ``"mps"``, a catalog name or a ``DeviceSpec``.
        target_batch_size: samples per optimizer step over all ranks; default: the sample batch's
            size per rank × ``world_size``.
        headroom: fraction of the capacity kept free, in [0, 0.9).
        precision: ``"auto"`` or a Lightning precision name.
        checkpointing: ``"auto"``, True (required) or False (never).
        world_size: number of data-parallel ranks.
        strategy: ``"auto"``, ``"single"``, ``"ddp"`` or ``"fsdp"``.
        memory_limit: plan as if the device had only this much memory (bytes or ``"6GiB"``).
        catalog: the device catalog, or the path of a catalog file merged over the bundled one
            (default: the bundled catalog).
        fsdp_mixed_precision: FSDP's policy for ``*-mixed``: ``"params"`` (16-bit parameters
            gathered, Lightning's ``FSDPStrategy``), ``"params-fp32-reduce"`` or ``"autocast"``
            (fp32 parameters under autocast).
        gpus_per_node: the shard group of ``strategy="hsdp"``.
        allow_rough: plan on an analytic estimate (a bound from shapes, when the step cannot be
            traced); by default such a plan is refused, with the reason.
        step_time: how configurations that fit are ranked: ``"rule"`` (default: the relative-cost
            rule), ``"auto"`` (the per-operator step-time model,
            :class:`~resource_guard.planning.op_time.OpTimeModel`, on this machine's CPU, with
            ``precision="auto"`` choosing between 32-true and bf16-mixed by it;
            :class:`~resource_guard.planning.gpu_time.GpuOpModel` on one catalog GPU; the rule elsewhere) or
            a model with a ``predict`` method. Opt-in: ``plan_quality.py --speed`` finds its choice the
            fastest measured for 8/8 models, its step times within a median 8-16% on a shared CPU, and
            its planning 2-9× the rule's (a trace per configuration, a ~2 s calibration per process).

    Returns:
        A :class:`Plan`.

    Raises:
        ConfigurationError: a bad argument or an unknown device or precision name.
        DoesNotFitError: no configuration fits; ``err.report`` is a :class:`NoFitReport`.
    """
    _check_args(headroom, target_batch_size, world_size, strategy, checkpointing)
    _check_inputs(model, optimizer, batch, loss_fn, who="plan")
    catalog = _catalog_arg(catalog)
    spec, reasons = _target_device(device, memory_limit, catalog)
    step_model = resolve_step_model(step_time, spec, world_size)
    if precision == "auto" and step_model is not None and spec.kind == "cpu" and cpu_profile().native_bf16:
        args = dict(
            device=spec, target_batch_size=target_batch_size, headroom=headroom, checkpointing=checkpointing,
            world_size=world_size, strategy=strategy, catalog=catalog,
            fsdp_mixed_precision=fsdp_mixed_precision,
            gpus_per_node=gpus_per_node, allow_rough=allow_rough, step_time=step_model,
        )  # fmt: skip
        return _fastest_precision(model, optimizer, batch, loss_fn, args, reasons)
    precision, why = (
        choose_precision(spec) if precision == "auto" else (parse_precision(precision).name, "as asked")
    )
    reasons.append(f"precision {precision}: {why}")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ConfigurationError(f"`plan(gpus_per_node={gpus_per_node!r})` must be an int >= 1")
    try:
        policy = fsdp_precision(precision, fsdp_mixed_precision)
    except ConfigurationError as exc:
        raise ConfigurationError(f"`plan(fsdp_mixed_precision={fsdp_mixed_precision!r})`: {exc}") from None
    target, per_rank = _batch_per_rank(batch, target_batch_size, world_size, model)
    blocks = find_checkpoint_blocks(model)
    ckpt_options, strategies = _options(model, blocks, checkpointing, world_size, strategy)
    strategies, skipped = _replicas_that_cannot_fit(model, precision, spec, strategies)
    reasons += skipped

    units = unit_param_bytes(model, precision)
    tracer = Tracer(
        model, optimizer, batch, loss_fn, precision, spec, headroom, units, world_size, blocks,
        policy=policy, gpus_per_node=gpus_per_node, per_rank=per_rank,
    )  # fmt: skip
    noted: dict[str, None] = {}
    with _collect_warnings(noted):
        found = _search(tracer, divisors(per_rank), ckpt_options, strategies)
    for message in noted:
        warnings.warn(message, ResourceGuardWarning, stacklevel=2)
    rows = tracer.alternatives(per_rank)
    if not found:  # nothing fits with the headroom: the configurations tried that fit inside it
        found = [c for c in tracer.evaluated.values() if c.fit.verdict == "fits tight"]
    if not found:
        raise no_fit_error(tracer, spec, catalog, headroom, rows, units)
    timed = None
    if step_model is not None:  # rank everything that fits by predicted step time (rule 4)
        fitting = [c for c in tracer.evaluated.values() if c.fits] or found
        timed = time_candidates(fitting, step_model, model, optimizer, batch, loss_fn, precision)
        best = min(fitting, key=lambda c: (round(step_ms(timed, c, per_rank), 6), bool(c.ckpt), -c.micro))
        reasons.append(describe_win(best, fitting, timed, per_rank, precision))
    else:
        best = _cheapest(found, per_rank)
    if best.estimate.method == ANALYTIC and not allow_rough:
        why = best.estimate.warnings[0] if best.estimate.warnings else "the step could not be traced"
        raise ConfigurationError(
            f"`plan(...)` will not choose a configuration from an analytic estimate ({why}): it is an upper "
            "bound from shapes, not a trace. Pass `allow_rough=True` to plan on it anyway, or make the step "
            "traceable (see the reason)."
        )
    if timed is None and best.ckpt and checkpointing == "auto" and tracer.blocks and len(tracer.blocks) >= 6:
        best = _least_checkpointing(tracer, best, reasons)
        rows = tracer.alternatives(per_rank)

    reasons += batch_reasons(best, found, per_rank, target, world_size, tracer)
    if best.strategy in SHARDED:
        reasons.append(f"precision under {best.strategy}: {policy.describe()}")
        if policy.policy == "autocast":
            saved = autocast_copy_bytes(model, policy.autocast_dtype or policy.param_dtype)
            reasons.append(
                "autocast over fp32 parameters keeps a 16-bit copy of every matmul weight, unsharded, for "
                f"backward (≈{saved / _MiB:,.0f} MiB per rank); a 16-bit parameter policy "
                "(`MixedPrecision(param_dtype=torch.bfloat16)` / `MixedPrecisionPolicy`, "
                "fsdp_mixed_precision='params') saves it"
            )
    if best.fit.verdict != "fits":
        reasons.append(f"{best.fit.verdict}: " + "; ".join(best.fit.tight_risks))
    reasons += [f"{m} (estimate warning)" for m in noted]
    reasons.append(f"{tracer.count} estimate traces, no real step; estimate {best.estimate.method_line}")
    return Plan(
        device=spec,
        precision=precision,
        checkpointing=bool(best.ckpt),
        checkpointed_modules=blocks[:: int(best.ckpt)] if best.ckpt else (),
        checkpoint_every=int(best.ckpt),
        micro_batch_size=best.micro,
        accumulation_steps=per_rank // best.micro,
        world_size=world_size,
        strategy=best.strategy,
        target_batch_size=target,
        estimate=best.estimate,
        fit=best.fit,
        reasons=tuple(reasons),
        alternatives=_mark_chosen(mark_times(rows, timed) if timed is not None else rows, best),
        traces=tracer.count,
        headroom=float(headroom),
        rank_memory=best.rank if best.strategy != "single" else None,
        fsdp_precision=policy if best.strategy in SHARDED else None,
    )


def _fastest_precision(
    model: nn.Module,
    optimizer: OptimizerArg,
    batch: Any,
    loss_fn: LossFn | None,
    args: dict[str, Any],
    reasons: list[str],
) -> Plan:
    """``precision="auto"`` on a CPU with native bf16 and a step-time model: plan 32-true and bf16-mixed,
    keep the one with the faster predicted step (bf16 halves a large matmul's time, its casts can
    cost a small model more than they save)."""
    plans: list[Plan] = []
    refused: DoesNotFitError | None = None
    for precision in ("bf16-mixed", "32-true"):
        try:
            plans.append(plan(model, optimizer, batch, loss_fn, precision=precision, **args))
        except DoesNotFitError as exc:
            refused = refused or exc
    if not plans:
        assert refused is not None
        raise refused
    timed = {p.precision: _chosen_ms(p) for p in plans}
    best = min(plans, key=lambda p: timed[p.precision])
    cpu = cpu_profile()
    if len(plans) == 2:
        other = next(p for p in plans if p is not best)
        why = (
            f"predicted {timed[best.precision]:,.1f} ms/step against {timed[other.precision]:,.1f} for "
            f"{other.precision} ({cpu.native_bf16_reason()})"
        )
    else:
        why = f"the only precision that fits ({cpu.native_bf16_reason()})"
    kept = [r for r in best.reasons if not r.startswith("precision ") and not r.startswith("device ")]
    rows = tuple(
        a if p is best else dataclasses.replace(a, chosen=False) for p in plans for a in p.alternatives
    )
    rows = tuple(sorted(rows, key=lambda r: (not r.fits, r.predicted_step_ms or float("inf"))))
    return dataclasses.replace(
        best, reasons=(*reasons, f"precision {best.precision}: {why}", *kept), alternatives=rows,
        traces=sum(p.traces for p in plans),
    )  # fmt: skip


def _chosen_ms(p: Plan) -> float:
    chosen = (a.predicted_step_ms for a in p.alternatives if a.chosen and a.predicted_step_ms is not None)
    return next(chosen, float("inf"))


# -- the steps of plan() ----------------------------------------------------------------------------
def _catalog_arg(catalog: Catalog | str | os.PathLike[str] | None) -> Catalog:
    if catalog is None or isinstance(catalog, (str, os.PathLike)):
        return load_catalog(catalog)
    if not isinstance(catalog, Catalog):
        raise ConfigurationError(
            f"`plan(catalog={catalog!r})` must be a Catalog (`load_catalog(path)`), a catalog file path "
            "or None"
        )
    return catalog


def _target_device(
    device: str | DeviceSpec, memory_limit: int | str | None, catalog: Catalog
) -> tuple[DeviceSpec, list[str]]:
    """The device planned for (capped by ``memory_limit``) and the reason that says so."""
    try:
        spec = resolve_device(device, catalog)
    except ConfigurationError as exc:
        detail = str(exc).partition("`: ")[2] or str(exc)  # drop resolve_device's own call quote
        raise ConfigurationError(f"`plan(device={device!r})`: {detail}") from None
    reason = f"device {spec.name} ({spec.kind}): " + ("asked for" if device != "auto" else "auto-detected")
    if memory_limit is not None:
        limit = parse_memory_limit(memory_limit, "plan")
        spec = spec.with_memory(limit)
        reason += f", memory capped at {limit / _MiB:,.1f} MiB"
    return spec, [reason]


def _batch_per_rank(
    batch: Any, target_batch_size: int | None, world_size: int, model: nn.Module | None = None
) -> tuple[int, int]:
    """The effective batch over all ranks and its share per rank (``model``: for what the error names)."""
    sample = batch_size_of(batch)
    if sample is None:
        raise rows_error(batch, "plan(batch=...)", model)
    if sample == 0:
        raise ConfigurationError("`plan(batch=...)`: the sample batch has 0 rows; pass at least one sample.")
    target = target_batch_size if target_batch_size is not None else sample * world_size
    if target % world_size:
        raise ConfigurationError(
            f"`plan(target_batch_size={target}, world_size={world_size})`: the target must be a multiple of "
            "world_size so that micro × accumulation × world_size == target exactly."
        )
    return target, target // world_size


def _options(
    model: nn.Module, blocks: tuple[str, ...], checkpointing: bool | str, world_size: int, strategy: str
) -> tuple[list[bool], list[str]]:
    """The checkpointing settings and strategies to search."""
    if checkpointing is True and not blocks:
        raise ConfigurationError(
            f"`plan(checkpointing=True)`: {type(model).__name__} has no repeated blocks to checkpoint; "
            "use checkpointing='auto' or False."
        )
    if checkpointing is False or not blocks:
        ckpt_options = [False]
    else:
        ckpt_options = [True] if checkpointing is True else [False, True]
    if strategy != "auto":
        return ckpt_options, [strategy]
    return ckpt_options, ["single"] if world_size == 1 else ["ddp", "fsdp"]


def _replicas_that_cannot_fit(
    model: nn.Module, precision: str, device: DeviceSpec, strategies: list[str]
) -> tuple[list[str], list[str]]:
    """Drop DDP without tracing when a full replica's parameters and gradients, plus DDP's gradient
    buckets, exceed the device's capacity (its optimizer state can only add to that); FSDP remains."""
    if "ddp" not in strategies or len(strategies) == 1:
        return strategies, []
    spec = parse_precision(precision)
    params = {id(p): p for p in model.parameters()}.values()
    floor = sum(
        p.numel()
        * (max(p.element_size(), spec.param_dtype.itemsize) if p.is_floating_point() else p.element_size())
        * (3 if p.requires_grad else 1)
        for p in params
    )
    if floor <= device.memory_bytes:
        return strategies, []
    return [s for s in strategies if s != "ddp"], [
        f"ddp not traced: a replica's parameters, gradients and gradient buckets alone take "
        f"{floor / _MiB:,.0f} MiB, more than {device.name}'s {device.memory_bytes / _MiB:,.0f} MiB"
    ]


def _search(
    tracer: Tracer, divs: list[int], ckpt_options: list[bool], strategies: list[str]
) -> list[Candidate]:
    """The largest fitting micro-batch per (checkpointing, strategy); checkpointing only if needed."""
    found: list[Candidate] = []
    for ckpt in ckpt_options:
        if ckpt and found and found[0].micro == divs[-1]:
            break  # the full batch fits without checkpointing
        for strat in strategies:
            start = max((c.micro for c in found if c.strategy == strat), default=1)
            cand = search_largest(tracer, divs, ckpt, strat, start)
            if cand is not None:
                found.append(cand)
    return found


def _cheapest(found: list[Candidate], per_rank: int) -> Candidate:
    """The cheapest candidate; checkpointing only when it beats the best plain one by the margin."""

    def cost(c: Candidate) -> float:
        return relative_cost(c.micro, per_rank, checkpointing=c.ckpt, strategy=c.strategy)

    plain = [c for c in found if not c.ckpt]
    best = min(plain or found, key=lambda c: (round(cost(c), 6), c.strategy == "fsdp"))
    ckpt_best = min((c for c in found if c.ckpt), key=cost, default=None)
    if plain and ckpt_best is not None and cost(ckpt_best) < CHECKPOINT_MARGIN * cost(best):
        return ckpt_best
    return best


def _least_checkpointing(tracer: Tracer, best: Candidate, reasons: list[str]) -> Candidate:
    """At the chosen micro-batch, checkpoint every second block only, if that fits too (one trace)."""
    half = tracer.evaluate(2, best.strategy, best.micro)
    if not half.fits:
        return best
    reasons.append(
        f"selective checkpointing: every 2nd block suffices at micro-batch {best.micro} "
        f"({half.fit.device_total_bytes / _MiB:,.1f} MiB; half the recompute of checkpointing every block)"
    )
    return half


def _mark_chosen(rows: tuple[Alternative, ...], best: Candidate) -> tuple[Alternative, ...]:
    chosen = (best.micro, best.ckpt, best.strategy, True)
    return tuple(
        dataclasses.replace(r, chosen=(r.micro_batch_size, r.checkpointing, r.strategy, r.fits) == chosen)
        for r in rows
    )
