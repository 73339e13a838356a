"""Which device, how many, how long, how much: time-to-train and cost over the device catalog.

:func:`project_training` plans the step (:func:`~resource_guard.planning.planner.plan`, public
arguments only) on every catalog device × GPU count, prices each plan with the step-time model of
:mod:`resource_guard.planning.steptime`, and turns it into hours and dollars for the whole training.
Plans are shared where the planner cannot tell devices apart: one plan per (kind, vendor, compute
capability, bf16, memory) × GPU count, and a plan that needed no compromise (the full per-rank batch,
no checkpointing, no sharding) is reused for the larger-memory devices of the same class.

Cost = hours × price per device-hour × GPUs. Rows whose device has no catalog price have no cost.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    >>> p = project_training(model, torch.optim.AdamW, torch.randn(32, 64), lambda m, b: m(b).square().mean(),
    ...                      train_samples=32_000, devices=["a100-40gb", "t4"], gpus=[1])
    >>> [(r.device, r.gpus, r.fits) for r in p.rows]
    [('t4', 1, True), ('a100-40gb', 1, True)]
    >>> p.rows[0].cost_usd == p.rows[0].hours * 0.526
    True
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from resource_guard.devices import Catalog, DeviceSpec, format_bytes, load_catalog, resolve_device
from resource_guard.errors import ConfigurationError, DoesNotFitError, ResourceGuardWarning
from resource_guard.planning.checkpointing import find_checkpoint_blocks
from resource_guard.planning.gpu_time import GpuOpModel, gpu_step_time
from resource_guard.planning.op_time import OpTimeModel, StepOps
from resource_guard.planning.planner import Plan, choose_precision, plan
from resource_guard.planning.projection_result import (
    Projection,
    ProjectionRow,
    checkpointing_on,
    remaining_run,
    training_samples,
)
from resource_guard.planning.steptime import (
    DEFAULT_EFFICIENCY,
    Calibration,
    Interconnect,
    StepFlops,
    StepTime,
    count_step_flops,
    peak_flops,
    step_time,
    tokens_per_sample,
)
from resource_guard.step.batching import resize_batch
from resource_guard.step.precision import parse_precision
from resource_guard.step.training import LossFn, OptimizerArg, batch_size_of

__all__ = [
    "Projection",
    "ProjectionRow",
    "checkpointing_on",
    "project_training",
    "remaining_run",
    "training_samples",
]


_GPU_KINDS = ("cuda", "rocm")


def project_training(
    model: nn.Module,
    optimizer: OptimizerArg,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    train_samples: int | None = None,
    train_tokens: int | None = None,
    epochs: float | None = None,
    dataset_size: int | None = None,
    target_batch_size: int | None = None,
    devices: Iterable[str | DeviceSpec] | None = None,
    gpus: Sequence[int] = (1, 2, 4, 8),
    max_hours: float | None = None,
    max_cost: float | None = None,
    precision: str = "auto",
    checkpointing: bool | str = "auto",
    headroom: float = 0.1,
    efficiency: float | None = None,
    calibration: Calibration | None = None,
    interconnect: Interconnect | None = None,
    catalog: Catalog | str | os.PathLike[str] | None = None,
) -> Projection:
    """Project time to train and cost on every device × GPU count (see the module docstring).

    Args:
        model, optimizer, batch, loss_fn: as for :func:`~resource_guard.planning.planner.plan`.
        train_samples / train_tokens / epochs + dataset_size: how much to train (exactly one).
        target_batch_size: samples per optimizer step over all GPUs (default: the sample batch's size).
        devices: catalog names or specs (default: every CUDA/ROCm device of the catalog).
        gpus: GPU counts; above ``interconnect.gpus_per_node`` a count must fill whole nodes.
        max_hours / max_cost: limits for the recommendation (USD for the whole training).
        precision, checkpointing, headroom: passed to ``plan``.
        efficiency: share of the peak FLOP/s the whole step reaches; given, it replaces the per-operator
            model on every row (default: the per-operator model on GPUs, :data:`DEFAULT_EFFICIENCY` on
            the devices it cannot model).
        calibration: a monitored run's throughput; replaces the models (rows say ``calibrated``).
        interconnect: the links data parallelism uses (default :class:`Interconnect`).
        catalog: the device catalog or a catalog file merged over the bundled one.

    Raises:
        ConfigurationError: a bad argument.
    """
    started = time.perf_counter()
    cat = catalog if isinstance(catalog, Catalog) else load_catalog(catalog)
    samples = training_samples(
        batch,
        train_samples=train_samples,
        train_tokens=train_tokens,
        epochs=epochs,
        dataset_size=dataset_size,
    )
    target = target_batch_size if target_batch_size is not None else batch_size_of(batch)
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise ConfigurationError(
            f"`project_training(target_batch_size={target_batch_size!r})` must be an int >= 1"
        )
    counts = _check_gpus(gpus)
    for name, limit in (("max_hours", max_hours), ("max_cost", max_cost)):
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0
        ):
            raise ConfigurationError(f"`project_training({name}={limit!r})` must be a number > 0 or None")
    if efficiency is not None and not (isinstance(efficiency, (int, float)) and 0 < efficiency <= 1):
        raise ConfigurationError(f"`project_training(efficiency={efficiency!r})` must be in (0, 1]")
    if precision != "auto":
        precision = parse_precision(precision).name
    link = interconnect or Interconnect()
    specs = (
        [resolve_device(d, cat) for d in devices]
        if devices is not None
        else [s for s in cat.values() if s.kind in _GPU_KINDS]
    )
    flops = count_step_flops(model, optimizer, batch, loss_fn)
    steps = math.ceil(samples / target)
    eff = efficiency or DEFAULT_EFFICIENCY
    calibrated_eff = None if calibration is None else calibration.efficiency(cat)
    if calibrated_eff is not None:
        eff = calibrated_eff

    planner = _Planner(
        model,
        optimizer,
        batch,
        loss_fn,
        target,
        precision,
        checkpointing=checkpointing,
        headroom=headroom,
        catalog=cat,
    )
    ops = (
        None
        if efficiency is not None or calibrated_eff is not None
        else _OpTimes(model, optimizer, batch, loss_fn)
    )
    rows: list[ProjectionRow] = []
    for spec in sorted(specs, key=lambda s: s.memory_bytes):
        for n in counts:
            rows.append(_row(spec, n, planner, flops, steps, eff, calibration, calibrated_eff, link, ops))
    rows = _recommend(rows, max_hours, max_cost)
    return Projection(
        rows=tuple(sorted(rows, key=_sort_key)),
        train_samples=samples,
        target_batch_size=target,
        optimizer_steps=steps,
        tokens_per_sample=tokens_per_sample(batch),
        flops=flops,
        efficiency=eff,
        calibration=calibration,
        interconnect=link,
        plan_calls=planner.calls,
        seconds=time.perf_counter() - started,
        step_model="per-operator" if ops is not None and ops.used else "whole-step",
    )


def _check_gpus(gpus: Sequence[int]) -> list[int]:
    counts = list(gpus) if isinstance(gpus, Iterable) and not isinstance(gpus, (str, bytes)) else None
    if not counts or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in counts):
        raise ConfigurationError(f"`project_training(gpus={gpus!r})` must be a non-empty list of ints >= 1")
    return sorted(set(counts))


class _Planner:
    """Calls ``plan()`` once per class of devices the planner cannot tell apart, and counts the calls.

    Shared: devices equal in everything the planner reads (kind, vendor, compute capability, bf16,
    memory); and a plan that needed no compromise, for any device of the same kind and precision with
    at least twice its predicted per-GPU peak usable (kernel and allocator differences between parts
    are a few percent of the peak, far inside that margin).
    """

    def __init__(self, *args: Any, checkpointing: bool | str, headroom: float, catalog: Catalog) -> None:
        self.model, self.optimizer, self.batch, self.loss_fn, self.target, self.precision = args
        self.checkpointing, self.headroom, self.catalog = checkpointing, headroom, catalog
        self.calls = 0
        self._plans: dict[tuple[Any, ...], Plan | DoesNotFitError] = {}
        self._roomy: dict[tuple[Any, ...], list[Plan]] = {}  # (kind, precision, gpus) -> free plans

    def __call__(self, spec: DeviceSpec, gpus: int) -> Plan | DoesNotFitError:
        key = (
            spec.kind,
            spec.vendor,
            spec.compute_capability,
            spec.bf16,
            spec.unified_memory,
            spec.memory_bytes,
            gpus,
        )
        if key in self._plans:
            return self._plans[key]
        precision = choose_precision(spec)[0] if self.precision == "auto" else self.precision
        usable = spec.memory_bytes * (1 - self.headroom)
        for shared in self._roomy.get((spec.kind, precision, gpus), []):
            peak = getattr(getattr(shared, "fit", None), "device_total_bytes", None)
            if peak is not None and 2 * peak <= usable:
                return shared
        self.calls += 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceGuardWarning)
                result: Plan | DoesNotFitError = plan(
                    self.model,
                    self.optimizer,
                    self.batch,
                    self.loss_fn,
                    device=spec,
                    target_batch_size=self.target,
                    headroom=self.headroom,
                    precision=self.precision,
                    checkpointing=self.checkpointing,
                    world_size=gpus,
                    catalog=self.catalog,
                )
        except DoesNotFitError as exc:
            result = exc
        self._plans[key] = result
        if isinstance(result, Plan) and _needs_no_compromise(result):
            self._roomy.setdefault((spec.kind, result.precision, gpus), []).append(result)
        return result


def _needs_no_compromise(p: Plan) -> bool:
    return (
        p.accumulation_steps == 1
        and not checkpointing_on(p.checkpointing)
        and p.strategy in ("single", "ddp")
    )


def _row(
    spec: DeviceSpec,
    gpus: int,
    planner: _Planner,
    flops: StepFlops,
    steps: int,
    eff: float,
    calibration: Calibration | None,
    calibrated_eff: float | None,
    link: Interconnect,
    ops: _OpTimes | None = None,
) -> ProjectionRow:
    nodes = math.ceil(gpus / link.gpus_per_node)
    base: dict[str, Any] = {
        "device": spec.name,
        "gpus": gpus,
        "nodes": nodes,
        "usd_per_hour": spec.price_per_hour_usd,
    }
    refused = _refuse(spec, gpus, planner.target, link)
    if refused:
        return ProjectionRow(fits=False, reason=refused, **base)
    result = planner(spec, gpus)
    if isinstance(result, DoesNotFitError):
        return ProjectionRow(fits=False, reason=_no_fit_reason(result), **base)
    p = result
    on_device = calibration is not None and calibration.device == spec.name
    achieved = calibration.achieved_flops_per_s if on_device and calibration else None
    if achieved is not None and calibration is not None and calibration.precision != p.precision:
        achieved = None  # measured at another precision: transfer as an efficiency only
    per_rank = p.target_batch_size // p.world_size
    modules = tuple(getattr(p, "checkpointed_modules", ()) or ())
    strategy = str(p.strategy).lower()
    comm_bytes, factor = _communication(p, flops, strategy)
    step_flops = flops.step(per_rank, modules)
    if _sharded(strategy):  # each rank updates its 1/N of the parameters
        step_flops -= flops.optimizer_per_step * (1 - 1 / p.world_size)
    try:
        t = None if achieved is not None or ops is None else ops.step(spec, p, flops, link, step_flops)
        t = t or step_time(
            spec,
            p.precision,
            flops=step_flops,
            bytes_moved=_bytes_moved(p, flops, strategy, bool(modules)),
            efficiency=eff,
            achieved_flops_per_s=achieved,
            comm_bytes=comm_bytes,
            comm_factor=factor,
            gpus=gpus,
            interconnect=link,
            kernels=p.accumulation_steps * flops.kernels_per_micro_step,
        )
    except ConfigurationError as exc:
        return ProjectionRow(fits=True, plan=_plan_dict(p), reason=str(exc), **base)
    hours = steps * t.step_s / 3600
    price = spec.price_per_hour_usd
    return ProjectionRow(
        fits=True,
        plan=_plan_dict(p),
        step_s=t.step_s,
        hours=hours,
        cost_usd=None if price is None else hours * price * gpus,
        calibrated=achieved is not None or calibrated_eff is not None,
        bound=t.bound,
        efficiency=t.efficiency or None,
        time=t,
        reason="" if nodes == 1 else link.describe(spec),
        **base,
    )


class _OpTimes:
    """The planner's per-operator model's step for a plan: on a catalog GPU
    (:class:`~resource_guard.planning.gpu_time.GpuOpModel`), and on this machine's CPU
    (:class:`~resource_guard.planning.op_time.OpTimeModel`, its calibration measured once per process);
    one trace per micro-batch, precision, checkpointing and GPU generation."""

    def __init__(self, model: nn.Module, optimizer: Any, batch: Any, loss_fn: LossFn | None) -> None:
        self.model, self.optimizer, self.batch, self.loss_fn = model, optimizer, batch, loss_fn
        self.units = max(len(find_checkpoint_blocks(model)), 1)
        self.used = False
        self._traces: dict[tuple[Any, ...], StepOps] = {}

    def step(
        self, spec: DeviceSpec, p: Plan, flops: StepFlops, link: Interconnect, step_flops: float
    ) -> StepTime | None:
        """The step on ``spec`` (``None``: not a GPU the model covers, e.g. no bandwidth in the catalog);
        ``step_flops``: the step's model FLOPs on one rank, as the whole-step model counts them."""
        if spec.kind == "cpu":
            return self._cpu_step(p, step_flops)
        if spec.kind not in _GPU_KINDS:
            return None
        try:
            gpu = GpuOpModel(spec)
        except ConfigurationError:
            return None
        every = int(getattr(p, "checkpoint_every", 0) or 0)
        key = (spec.kind, spec.compute_capability, p.precision, p.micro_batch_size, every)
        if key not in self._traces:
            sample = resize_batch(self.batch, p.micro_batch_size)
            self._traces[key] = gpu.trace(
                self.model, self.optimizer, sample, self.loss_fn, p.precision, every
            )
        prediction = gpu.predict_ops(self._traces[key])
        strategy = str(p.strategy).lower()
        payload, factor = _communication(p, flops, strategy)
        sharded = _sharded(strategy)
        buckets = math.ceil(flops.trainable_parameters * 4 / _DDP_BUCKET_BYTES)
        self.used = True
        return gpu_step_time(
            prediction,
            peak_flops=peak_flops(spec, p.precision) or gpu.peak(parse_precision(p.precision).compute_dtype),
            accumulation_steps=p.accumulation_steps,
            optimizer_share=1 / p.world_size if sharded else 1.0,
            comm_s=link.collective_s(spec, p.world_size, payload, factor),
            comm_bytes=payload,
            comm_overlap="fsdp" if sharded else "ddp",
            units=self.units if sharded else max(buckets, 1),
            flops=step_flops,
        )

    def _cpu_step(self, p: Plan, step_flops: float) -> StepTime:
        every = int(getattr(p, "checkpoint_every", 0) or 0)
        sample = resize_batch(self.batch, p.micro_batch_size)
        pred = OpTimeModel().predict(
            self.model, self.optimizer, sample, self.loss_fn, precision=p.precision, checkpoint_every=every
        )
        self.used = True
        k = p.accumulation_steps
        by_class = pred.micro_step_by_class_s
        compute = k * sum(by_class.get(c, 0.0) for c in ("matmul", "conv", "attention"))
        host = k * by_class.get("framework", 0.0)
        step = pred.step_s(k)
        return StepTime(
            step_s=step,
            compute_s=compute,
            memory_s=step - compute - host,
            comm_s=0.0,
            flops=step_flops,
            bytes_moved=float(k * pred.bytes_per_micro_step),
            comm_bytes=0.0,
            efficiency=0.0,  # no catalog peak for a CPU
            launch_s=host,
        )


_DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default


def _refuse(spec: DeviceSpec, gpus: int, target: int, link: Interconnect) -> str:
    if gpus > 1 and spec.kind not in _GPU_KINDS:
        return f"{spec.kind}: one device per machine, no multi-device data parallel"
    if gpus > link.gpus_per_node and gpus % link.gpus_per_node:
        return f"{gpus} GPUs do not fill whole nodes of {link.gpus_per_node}"
    if target % gpus:
        return f"the batch of {target} does not split over {gpus} GPUs"
    return ""


def _no_fit_reason(exc: DoesNotFitError) -> str:
    report = exc.report
    needed, usable = getattr(report, "needed_bytes", None), getattr(report, "usable_bytes", None)
    if needed is not None and usable is not None:
        return f"needs {format_bytes(needed)} per GPU, {format_bytes(usable)} usable"
    return str(exc).splitlines()[0]


def _plan_dict(p: Plan) -> dict[str, Any]:
    return {
        "precision": p.precision,
        "micro_batch_size": p.micro_batch_size,
        "accumulation_steps": p.accumulation_steps,
        "strategy": p.strategy,
        "checkpointing": p.checkpointing,
        "world_size": p.world_size,
    }


def _sharded(strategy: str) -> bool:
    return strategy not in ("single", "ddp")


def _bytes_moved(p: Plan, flops: StepFlops, strategy: str, recompute: bool) -> float:
    """Bytes one rank reads and writes per optimizer step (module docstring of steptime)."""
    bd = p.estimate.breakdown
    compute_size = parse_precision(p.precision).compute_dtype.itemsize
    params = float(bd.get("parameters", 0))
    state = float(bd.get("optimizer_state", 0))
    total = max(p.estimate.parameter_count, 1)
    grads = params * flops.trainable_parameters / total
    accum = p.accumulation_steps
    weights = p.estimate.parameter_count * compute_size * (3 if recompute else 2)
    per_micro = weights + 2 * float(bd.get("activations", 0)) + 2 * grads
    update = 2 * params + grads + 2 * state
    if _sharded(strategy):
        update /= p.world_size
    return accum * per_micro + update


def _communication(p: Plan, flops: StepFlops, strategy: str) -> tuple[float, float]:
    """``(payload bytes, ring factor)`` of one optimizer step's collectives on one rank."""
    if p.world_size <= 1:
        return 0.0, 0.0
    trainable = flops.trainable_parameters
    if strategy == "ddp":
        return trainable * parse_precision(p.precision).param_dtype.itemsize, 2.0
    size = parse_precision(p.precision).compute_dtype.itemsize
    factor = 2.0 if ("grad_op" in strategy or "zero2" in strategy) else 3.0
    return p.accumulation_steps * trainable * size, factor


def _recommend(
    rows: list[ProjectionRow], max_hours: float | None, max_cost: float | None
) -> list[ProjectionRow]:
    def within(r: ProjectionRow) -> bool:
        if not r.fits or r.hours is None:
            return False
        if max_hours is not None and r.hours > max_hours:
            return False
        return max_cost is None or (r.cost_usd is not None and r.cost_usd <= max_cost)

    ok = [r for r in rows if within(r)]
    priced = [r for r in ok if r.cost_usd is not None]
    cheapest = min(priced, key=lambda r: (r.cost_usd, r.hours), default=None)
    fastest = min(
        ok, key=lambda r: (r.hours, r.cost_usd if r.cost_usd is not None else math.inf), default=None
    )
    out = []
    for r in rows:
        marks = tuple(m for m, best in (("cheapest", cheapest), ("fastest", fastest)) if r is best)
        out.append(dataclasses.replace(r, recommended=marks))
    return out


def _sort_key(r: ProjectionRow) -> tuple[Any, ...]:
    if not r.fits or r.hours is None:
        return (2, 0.0, r.device, r.gpus)
    if r.cost_usd is None:
        return (1, r.hours, r.device, r.gpus)
    return (0, r.cost_usd, r.hours, r.gpus)
