"""The Lightning callback's evaluation pre-flight: validation, test and predict, each on its own
dataloader's first batch (its own batch size and shapes), before any of their steps run. A loader whose
batch does not fit, when a smaller one does, is returned for splitting
(:mod:`~resource_guard.frontdoors.lightning.eval_split`); one where not even one row fits stops the run.

When, and beside what (Lightning 2.x, checked by ``tests/frontdoors/test_eval_preflight.py``):

- ``fit``: in ``on_fit_start``, after the training plan and before the sanity check, the validation
  dataloaders are set up (``fit_loop.epoch_loop.val_loop.setup_data()``, the loop's public method; the
  loop keeps them, so validation uses the same loaders) and each one's first batch is traced as the
  validation that follows a training step runs it: the optimizer state exists; the gradients were
  freed, since the training loop calls ``on_validation_model_zero_grad`` (``zero_grad()``, to
  ``None``) before it validates at the end of an optimizer step. They are kept (counted) where
  validation can start mid-accumulation (``accumulate_grad_batches > 1`` and ``val_check_batch`` not
  a multiple of it) or where the module overrides that hook. The sanity check holds less (no state
  yet), so it is covered too.
- ``trainer.validate`` / ``trainer.test`` / ``trainer.predict``: in ``on_validation_start`` /
  ``on_test_start`` / ``on_predict_start``, once the loop has set up its dataloaders, beside what the
  run holds then: the parameters, the gradients the module holds, and the optimizer state when a
  ``fit`` on the same Trainer left one.

Under DDP every rank traces its own first batch and the ranks agree (one collective): if any rank's
step does not fit even at one row, every rank raises the same
:class:`~resource_guard.errors.DoesNotFitError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.seed import isolate_rng

from resource_guard.devices import DeviceSpec, parse_memory_limit, resolve_device
from resource_guard.errors import DoesNotFitError, warn_at_user
from resource_guard.frontdoors.eval_preflight import EvalCheck, EvalPreflights
from resource_guard.frontdoors.lightning import apply as ap
from resource_guard.frontdoors.lightning.hooks import call_eval_step
from resource_guard.frontdoors.lightning.internals import before_batch_transfer
from resource_guard.frontdoors.run import agree
from resource_guard.step.precision import PRECISIONS

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LOOPS", "gradients_kept_in_fit", "preflight_loops", "preflight_stage"]

LOOPS = {
    "validate": ("validation", "validation_step"),
    "test": ("test", "test_step"),
    "predict": ("predict", "predict_step"),
}


def gradients_kept_in_fit(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether fit's validation can run with the gradients allocated (see the module docstring)."""
    if is_overridden("on_validation_model_zero_grad", pl_module):
        return True  # the module decides what is freed: count the gradients
    acc = int(trainer.accumulate_grad_batches)
    check = getattr(trainer, "val_check_batch", None)
    total = getattr(trainer, "num_training_batches", None)
    if acc <= 1 or not isinstance(check, int):
        return False
    return check % acc != 0 and not (isinstance(total, (int, float)) and check >= total)


def _loaders(found: Any) -> list[Any]:
    if found is None:
        return []
    if isinstance(found, Mapping):
        return list(found.values())
    if isinstance(found, (list, tuple)):
        return list(found)
    return [found]


def _first_batches(
    trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str
) -> list[tuple[int, Any, int]]:
    """``(index, first batch, loader count)`` of the stage's dataloaders, the batch moved to the device
    as the loop moves it."""
    if stage == "validate" and trainer.state.fn == "fit":
        trainer.fit_loop.epoch_loop.val_loop.setup_data()
    name = {"validate": "val_dataloaders", "test": "test_dataloaders"}.get(stage, "predict_dataloaders")
    loaders = _loaders(getattr(trainer, name))
    batches = []
    with isolate_rng(include_cuda=False):  # a shuffling sampler draws from the CPU generator
        for i, loader in enumerate(loaders):
            batch = next(iter(loader), None)
            if batch is None:
                continue
            batch = before_batch_transfer(pl_module, batch)
            batches.append((i, trainer.strategy.batch_to_device(batch, dataloader_idx=i)))
    return [(i, b, len(loaders)) for i, b in batches]


def _device(trainer: pl.Trainer, device: str | None, memory_limit: Any) -> DeviceSpec:
    spec = resolve_device(device or str(trainer.strategy.root_device))
    if memory_limit is not None:
        spec = spec.with_memory(parse_memory_limit(memory_limit, "ResourceGuard"))
    return spec


def preflight_loops(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    stage: str,
    checks: EvalPreflights,
    *,
    plan: Any,
    device_name: str | None,
    memory_limit: Any,
    headroom: float,
    precision: str | None,
    fail_fast: bool = True,
) -> tuple[list[EvalCheck], dict[int, EvalCheck]]:
    """Pre-flight every dataloader of ``stage`` (``"validate"``, ``"test"`` or ``"predict"``); a
    collective.

    The device and headroom are the ``plan``'s (its device capped by the memory limit), else the device
    is resolved from ``device_name`` or the Trainer's root device and capped by ``memory_limit``.
    ``precision``: the plan's, else the Trainer's.
    Returns the new checks, and by dataloader index the checks of the loaders whose batch does not fit
    but a smaller one does (to run as micro-batches of at most its largest fitting batch size; also
    when checked before, by a second ``trainer.validate``).

    Raises:
        DoesNotFitError: on every rank, when one rank's step does not fit even at batch size 1 (or its
            batch size cannot be told) (``fail_fast``; else a warning).
    """
    loop, hook = LOOPS[stage]
    found: list[EvalCheck] = []
    splits: dict[int, EvalCheck] = {}
    error: BaseException | None = None
    try:
        if stage == "predict" or is_overridden(hook, pl_module):  # predict_step has a default
            fitting = trainer.state.fn == "fit"
            spec = plan.device if plan is not None else _device(trainer, device_name, memory_limit)
            headroom = plan.headroom if plan is not None else headroom
            own = str(trainer.precision)
            name = precision or (own if own in PRECISIONS else "32-true")
            optimizers = trainer.optimizers
            optimizer = optimizers[0] if len(optimizers) == 1 else None
            if optimizer is not None and not fitting and not optimizer.state:
                optimizer = None  # no step taken: no state resident
            for i, batch, count in _first_batches(trainer, pl_module, stage):

                def loss_fn(module: Any, b: Any, i: int = i, count: int = count) -> Any:
                    return call_eval_step(module, hook, b, 0, i if count > 1 else None)

                before = len(checks.checks)
                with ap.detached_trainer(pl_module):
                    check = checks.check(
                        pl_module,
                        batch,
                        loss_fn,
                        loop=loop if count == 1 else f"{loop} (dataloader {i})",
                        device=spec,
                        optimizer=optimizer,
                        gradients_kept=gradients_kept_in_fit(trainer, pl_module) if fitting else None,
                        precision=name,
                        headroom=headroom,
                        raise_if_not_fits=False,
                        again=True,
                    )
                if check is None:
                    continue
                if len(checks.checks) > before:
                    found.append(check)
                if not check.fits and check.largest_fitting_batch_size:
                    splits[i] = check
                elif not check.fits:
                    raise DoesNotFitError(check.message(), check)
    except Exception as failure:  # every rank must reach the collective below
        error = failure
    # every rank raises the lowest failing rank's error (one agreement for every door: frontdoors/run.py)
    error = agree([], error, ap.StrategyCollective(trainer)).error
    not_fit = lambda e: isinstance(e, DoesNotFitError)  # noqa: E731
    if not_fit(error) and fail_fast:
        raise error  # type: ignore[misc]
    if error is not None:  # our pre-flight's own failure never stops the run
        tail = "\nThe run continues unchanged (fail_fast=False)." if not_fit(error) else ""
        warn_at_user(f"ResourceGuard: {error}{tail}")
    return found, splits


def preflight_stage(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    stage: str,
    checks: EvalPreflights,
    **settings: Any,
) -> tuple[list[str], dict[int, tuple[int, int]]]:
    """The loops of ``stage`` pre-flighted (:func:`preflight_loops`, ``settings`` its keywords) and the
    loaders whose batches do not fit split into micro-batches that do: the lines to report, and the
    split sizes by loader index (fit's loop has not built its iterator yet: they apply when it does)."""
    from resource_guard.frontdoors.lightning.eval_split import apply_splits, split_sizes

    found, splits = preflight_loops(trainer, pl_module, stage, checks, **settings)
    micro, notes = split_sizes(splits)
    fitting = trainer.state.fn == "fit"
    apply_splits(trainer, stage, micro, reset=not fitting)
    return [c.line() for c in found] + notes, micro
