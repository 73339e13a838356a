"""``assert_fits``: a test assertion that one training step fits a device, on CPU, with no GPU.

Usable from any test runner (pytest, unittest, a plain script): it raises :class:`AssertionError`
whose message is the planner's no-fit report in short — needed vs usable, the largest category, and
what would make it fit (gradient accumulation, other devices, FSDP over more GPUs, bf16-true).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    >>> fit = assert_fits(model, torch.optim.AdamW, torch.randn(32, 64), lambda m, b: m(b).mean(),
    ...                   device="t4", precision="16-mixed")
    >>> fit.verdict
    'fits'
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from torch import nn

from resource_guard.devices import Catalog, DeviceSpec, format_bytes, load_catalog, resolve_device
from resource_guard.errors import ConfigurationError
from resource_guard.estimate import DeviceFit
from resource_guard.estimate.estimator import _check_inputs
from resource_guard.estimate.fsdp.sharding import fsdp_precision
from resource_guard.planning.checkpointing import find_checkpoint_blocks
from resource_guard.planning.nofit import NoFitReport, no_fit_error
from resource_guard.planning.planner import _check_args, choose_precision
from resource_guard.planning.search import Candidate, Tracer, search_largest
from resource_guard.planning.strategy import unit_param_bytes
from resource_guard.step.batching import divisors
from resource_guard.step.precision import parse_precision
from resource_guard.step.training import LossFn, OptimizerArg, batch_size_of

__all__ = ["assert_fits"]


def assert_fits(
    model: nn.Module,
    optimizer: OptimizerArg,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    device: str | DeviceSpec,
    precision: str = "32-true",
    headroom: float = 0.1,
    world_size: int = 1,
    strategy: str = "auto",
    catalog: Catalog | str | os.PathLike[str] | None = None,
) -> DeviceFit:
    """Assert that one training step on ``batch`` fits ``device`` (per rank when ``world_size > 1``).

    The step is the one given: the whole batch at once, on each rank, without gradient accumulation
    or checkpointing beyond what the model does itself. It fits when the device would show at most
    ``capacity × (1 − headroom)`` (:meth:`~resource_guard.MemoryEstimate.for_device`); a step that only
    fits inside the headroom ("fits tight") fails, saying so.

    Args:
        model, optimizer, batch, loss_fn: as for :func:`~resource_guard.estimate_memory`; a model built
            on the ``meta`` device is estimated without allocating it.
        device: a catalog name (``"t4"``, ``"a100-40gb"``), ``"cpu"``, ``"cuda:N"`` or a ``DeviceSpec``.
        precision: a Lightning precision name, or ``"auto"`` (what :func:`~resource_guard.plan` picks).
        headroom: fraction of the capacity kept free, in [0, 0.9).
        world_size: data-parallel ranks, each running ``batch``.
        strategy: ``"auto"`` (``"single"``; with ``world_size > 1`` DDP or FSDP, whichever fits),
            ``"single"``, ``"ddp"``, ``"fsdp"``, ``"fsdp_grad_op"`` or ``"hsdp"``.
        catalog: the device catalog or a catalog file merged over the bundled one.

    Returns:
        The per-rank :class:`~resource_guard.DeviceFit` of the step that fits.

    Raises:
        AssertionError: the step does not fit; the message is the no-fit report in short.
        ConfigurationError: a bad argument (before anything is traced).
    """
    call = "assert_fits"
    if strategy == "single" and world_size != 1:
        raise ConfigurationError(
            f"`{call}(strategy='single', world_size={world_size!r})`: one device has one rank; use "
            "strategy='ddp', 'fsdp' or 'auto', or world_size=1."
        )
    _check_args(headroom, None, world_size, strategy, False, call=call)
    _check_inputs(model, optimizer, batch, loss_fn, who=call)
    if not isinstance(catalog, Catalog):
        catalog = load_catalog(catalog)
    try:
        spec = resolve_device(device, catalog)
    except ConfigurationError as exc:
        detail = str(exc).partition("`: ")[2] or str(exc)
        raise ConfigurationError(f"`{call}(device={device!r})`: {detail}") from None
    if precision == "auto":
        precision = choose_precision(spec)[0]
    else:
        try:
            precision = parse_precision(precision).name
        except ConfigurationError as exc:
            raise ConfigurationError(f"`{call}(precision={precision!r})`: {exc}") from None
    per_rank = batch_size_of(batch)
    if not per_rank:
        raise ConfigurationError(
            f"`{call}(batch=...)`: cannot tell the batch size (its tensors share no leading dimension, "
            "or it has 0 rows)"
        )
    strategies = [strategy] if strategy != "auto" else ["single"] if world_size == 1 else ["ddp", "fsdp"]
    units = unit_param_bytes(model, precision)
    tracer = Tracer(
        model, optimizer, batch, loss_fn, precision, spec, headroom, units, world_size,
        find_checkpoint_blocks(model), per_rank=per_rank,
        policy=fsdp_precision(precision, "params"),  # FSDP as plan() sizes it: 16-bit parameters gathered
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the verdict is the message; estimate warnings are not the test's
        asked = [tracer.evaluate(False, s, per_rank) for s in strategies]
        fitting = [c for c in asked if c.fits]
        if fitting:
            return min(fitting, key=lambda c: c.total).fit
        best = min(asked, key=lambda c: c.total)
        # the report of the step as asked: only its own configuration(s) are evaluated so far
        error = no_fit_error(tracer, spec, catalog, headroom, tracer.alternatives(per_rank), units)
        smaller = ckpt = None
        if per_rank > 1 and best.fit.verdict != "fits tight":
            smaller = search_largest(tracer, divisors(per_rank)[:-1], False, best.strategy)
        if tracer.blocks:
            ckpt = tracer.evaluate(True, best.strategy, per_rank)
    report: NoFitReport = error.report
    raise AssertionError(_message(best, report, smaller, ckpt, per_rank, world_size, headroom))


def _message(
    best: Candidate,
    report: NoFitReport,
    smaller: Candidate | None,
    ckpt: Candidate | None,
    per_rank: int,
    world_size: int,
    headroom: float,
) -> str:
    """The no-fit report in short: needed vs usable, the largest category, what would make it fit."""
    fit, est = best.fit, best.estimate
    where = f"{best.strategy} × {world_size}, per rank" if world_size > 1 else best.strategy
    verdict = "fits only inside the headroom" if fit.verdict == "fits tight" else "does not fit"
    lines = [
        f"the training step {verdict} on {fit.device.name} ({est.precision}, batch {per_rank}, {where}): "
        f"needs {format_bytes(fit.device_total_bytes)} ({fit.device_total_bytes:,} bytes), "
        f"{format_bytes(fit.usable_bytes)} usable ({fit.usable_bytes:,} bytes; capacity "
        f"{format_bytes(fit.capacity_bytes)}, headroom {headroom:.0%})."
    ]
    if est.breakdown and est.peak_bytes:
        name, size = max(est.breakdown.items(), key=lambda kv: kv[1])
        lines.append(
            f"largest category: {name}, {format_bytes(size)} of the {format_bytes(est.peak_bytes)} peak "
            f"({size / est.peak_bytes:.0%}; at {est.peak_phase or 'the peak'})."
        )
    if not est.traced:  # an upper bound: the step may fit after all, and the reader must know
        lines.append(f"estimate {est.method_line}.")
    tips = []
    if fit.verdict == "fits tight":
        kept = format_bytes(fit.capacity_bytes - fit.usable_bytes)
        tips.append(f"headroom={headroom:g} keeps {kept} free; a smaller headroom accepts this tight fit")
    if smaller is not None:
        tips.append(
            f"micro-batch {smaller.micro} × {per_rank // smaller.micro} gradient accumulation steps fits "
            f"({format_bytes(smaller.total)})"
        )
    if ckpt is not None:
        outcome = (
            f"fits ({format_bytes(ckpt.total)})" if ckpt.fits else f"still needs {format_bytes(ckpt.total)}"
        )
        tips.append(f"activation checkpointing of every block (`apply_checkpointing(model)`) {outcome}")
    # the report's checkpointing line speaks of plan()'s option; the line above measured it instead
    tips += [s for s in report.suggestions if ckpt is None or not s.startswith("activation checkpointing")]
    if tips:
        lines.append("what would make it fit:")
        lines += [f"- {t}" for t in tips]
    return "\n".join(lines)
