"""The Lightning front door: the :class:`ResourceGuard` callback.

Before the first training step it takes one real batch from the train dataloader, estimates one
``training_step`` + backward + optimizer step of the LightningModule on fake tensors, and plans
precision, activation checkpointing, micro-batch size and gradient accumulation. It then configures
the Trainer the way a user would by hand (``accumulate_grad_batches``, the ``batch_size`` attribute of
the module or datamodule with the train dataloader rebuilt, or else each loader batch run as
micro-batches (:mod:`~resource_guard.frontdoors.lightning.rebatch`), Lightning's precision plugin,
checkpointing on the module), or stops with the full report before any step when nothing fits. While
training, it monitors where the time goes (:class:`~resource_guard.RunMonitor`).

``training_step`` is traced on a copy of the module detached from the Trainer: ``self.log`` is fine
(silently skipped); code that reads ``self.trainer`` makes the estimate fall back to the conservative
analytic count (with a warning). Under manual optimization (``automatic_optimization = False``) that
``training_step`` is the whole step, traced with every optimizer and each one's state
(:mod:`~resource_guard.frontdoors.lightning.manual`); the plan then applies precision, checkpointing and
the batch size, and leaves accumulation to the module.

Under DDP every rank plans on its own batch, the ranks agree on the most conservative plan through a
collective, and only rank zero logs and writes. When ``fit`` ends (or fails) the Trainer, module and
datamodule are put back as the user configured them; the decisions stay in
:attr:`ResourceGuard.decisions` and in checkpoints.

Example:
    >>> import lightning.pytorch as L
    >>> from resource_guard.frontdoors.lightning.callback import ResourceGuard
    >>> trainer = L.Trainer(callbacks=[ResourceGuard(target_batch_size=256)], logger=False)
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from resource_guard.errors import ConfigurationError, DoesNotFitError, warn_at_user
from resource_guard.frontdoors.eval_preflight import EvalPreflights
from resource_guard.frontdoors.lightning import apply as ap
from resource_guard.frontdoors.lightning import shapes as lightning_shapes
from resource_guard.frontdoors.lightning.internals import skip_inherited_step_hooks
from resource_guard.frontdoors.lightning.plan import (
    MANUAL,
    check_settings,
    describe,
    log_plan,
    plan_locally,
    render_plan,
    total_batches,
    trainer_monitor,
)
from resource_guard.frontdoors.run import Run
from resource_guard.observe.profiling import ProfileWindow

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = ["ResourceGuard"]


class ResourceGuard(Callback):
    """Plan a Lightning run before its first step, apply the plan, and monitor the run.

    Args:
        target_batch_size: the effective (global) batch size, ``micro × accumulation × world size``.
            Default: the train loader's batch size × ``accumulate_grad_batches`` × world size (the
            effective batch the run already has).
        device: the device to plan for: default the Trainer's root device; a catalog name (for example
            ``"a100-40gb"``) plans as if training there.
        headroom: share of the device memory kept free, in [0, 0.9).
        precision: ``None`` (the default) keeps the Trainer's precision, explicit or Lightning's
            default 32-true: the callback never changes a run's numerics unasked. ``"auto"`` lets the
            planner choose (bf16-mixed where the device computes bf16 natively, else 16-mixed on a GPU
            or 32-true); with ``"auto"`` an explicit Trainer precision other than 32-true stays fixed. A
            Lightning precision name fixes it.
        checkpointing: ``"auto"``, ``True`` or ``False`` (activation checkpointing of repeated blocks).
        accumulation: ``"auto"`` or a fixed number of micro-batches per optimizer step (the planner
            then picks the rest around it). A ``Trainer(accumulate_grad_batches=k)`` with k > 1 is
            respected as fixed too.
        memory_limit: plan as if the device (each rank's) had only this much memory (bytes, or a
            string such as ``"6GiB"``).
        fail_fast: raise :class:`~resource_guard.errors.DoesNotFitError` before any step when nothing
            fits; ``False``: warn and let the run continue unchanged.
        profile: ``True`` (default window), ``False``, or a
            :class:`~resource_guard.observe.profiling.ProfileWindow`.
        monitor: run-time monitoring (time per step, data waits, memory, the report); ``False`` for none.
        log_dir: where the monitor writes its report; default ``<trainer.log_dir>/resource_guard``.
        memory_history: on a CUDA run, record the allocator's history and, when the run ends with an
            out-of-memory error, dump it into ``memory_snapshot.pickle`` for https://pytorch.org/memory_viz
            (the OOM's figures go into ``oom.json`` and the report either way).
        max_seq_len / worst_case_batch: the run's largest batch (a length along the sample's sequence
            axis, or a batch): the plan is made for it. Default: read from the train loader when it
            declares it (:func:`~resource_guard.planning.worst_case.worst_case_length`).
        check_shapes: check each batch's shape before it runs and stop with ``DoesNotFitError`` before
            one that would not fit (:mod:`~resource_guard.frontdoors.shape_guard`); ``False``: off.
        log_every_n_steps / log_interval_s: how often the monitor logs (on the ``global_step`` axis): by
            default every optimizer step for the first 20, then about every ``log_interval_s`` seconds
            (2); an int ``n``: after step 1 and every ``n``-th step.

    Attributes:
        plan: the :class:`~resource_guard.Plan` this rank made (``None`` before ``fit`` and on a
            resumed run, which re-applies the stored decisions without planning).
        decisions: what was applied (agreed across ranks), stored in checkpoints.
        report: the monitor's report once the run ended.

    Example:
        >>> guard = ResourceGuard(target_batch_size=64, memory_limit="2GiB", monitor=False)
        >>> guard.plan is None
        True
    """

    def __init__(
        self,
        target_batch_size: int | None = None,
        device: str | None = None,
        headroom: float = 0.1,
        precision: str | None = None,
        checkpointing: bool | str = "auto",
        accumulation: int | str = "auto",
        memory_limit: int | str | None = None,
        fail_fast: bool = True,
        profile: bool | ProfileWindow = True,
        monitor: bool = True,
        log_dir: str | os.PathLike[str] | None = None,
        memory_history: bool = False,
        max_seq_len: int | None = None,
        worst_case_batch: Any = None,
        check_shapes: bool = True,
        log_every_n_steps: int | None = None,
        log_interval_s: float = 2.0,
    ) -> None:
        self.precision = check_settings(
            device=device, headroom=headroom, checkpointing=checkpointing, accumulation=accumulation,
            fail_fast=fail_fast, memory_history=memory_history, max_seq_len=max_seq_len,
            check_shapes=check_shapes, memory_limit=memory_limit, precision=precision,
            target_batch_size=target_batch_size, log_dir=log_dir, profile=profile, monitor=monitor,
            log_every_n_steps=log_every_n_steps, log_interval_s=log_interval_s,
        )  # fmt: skip
        self.log_every_n_steps, self.log_interval_s = log_every_n_steps, log_interval_s
        self.target_batch_size, self.device, self.headroom = target_batch_size, device, float(headroom)
        self.checkpointing, self.accumulation, self.memory_limit = checkpointing, accumulation, memory_limit
        self.fail_fast, self.profile, self.monitor, self.log_dir = fail_fast, profile, monitor, log_dir
        self.memory_history, self.check_shapes = memory_history, check_shapes
        self.max_seq_len, self.worst_case_batch = max_seq_len, worst_case_batch
        self.plan: Plan | None = None
        self.decisions: ap.Decisions | None = None
        self._shapes: Any = None  # the ShapeGuard of this fit
        self._planned_on: Any = None  # the batch the plan was made on (the worst case when known)
        self._worst_source: str | None = None
        self._flops_per_sample: float | None = None
        self._restored: ap.Decisions | None = None
        self._applied: ap.Applied | None = None
        self._run = Run("ResourceGuard")
        self._global_step = 0  # trainer.global_step at the last batch's end: a change is an optimizer step
        self._fixed = ap.Fixed()
        self._evals = EvalPreflights()  # validation/test/predict pre-flights (frontdoors/lightning/eval.py)
        self._eval_notes: list[str] = []  # their lines (also in the plan's reasons and the report)
        self._eval_splits: dict[int, tuple[int, int]] = {}  # fit's validation loaders split: index → sizes
        # an inherited no-op hook still costs a profiler context and a call, ~2.5 µs each, ~10 µs per step
        # for the four training hooks this callback does not use (tests/frontdoors/test_hot_path.py)
        skip_inherited_step_hooks(self)

    @property
    def report(self) -> Any:
        """The monitor's report once the run ended."""
        return self._run.report

    # -- set-up --------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the environment: settings fixed by the user (manual optimization fixes accumulation), the
        device name."""
        if stage != "fit":
            return
        self._fixed = ap.fixed_settings(trainer, self.precision, self.accumulation)
        if not pl_module.automatic_optimization:  # the step is the module's: it alone accumulates
            if self.accumulation not in ("auto", 1):
                raise ConfigurationError(
                    f"`ResourceGuard(accumulation={self.accumulation!r})` does not apply to manual "
                    "optimization (`automatic_optimization = False`): accumulation is the module's own "
                    "code in `training_step`. Remove the `accumulation` argument."
                )
            self._fixed = dataclasses.replace(self._fixed, accumulation=1, accumulation_source=MANUAL)
        if self.log_dir is not None and self.monitor and trainer.is_global_zero:
            from resource_guard.frontdoors.vocabulary import check_log_dir

            check_log_dir(self.log_dir, "ResourceGuard")  # now, not after seconds of planning
        if self.device is not None:
            from resource_guard.devices import resolve_device

            resolve_device(self.device)  # an unknown name fails here, before any work

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Plan (or re-apply the decisions of a resumed run) and configure the Trainer."""
        self.plan = None
        restored, self._restored = self._restored, None
        peek = ap.first_batch(trainer, pl_module)
        if peek is None:
            warn_at_user("ResourceGuard: no train dataloader (limit_train_batches=0?); nothing to plan.")
            return
        batch, loader_batch_size = peek
        if restored is not None and restored.world_size == trainer.world_size:
            self._apply(trainer, pl_module, restored, loader_batch_size)
            again = f"re-applied the decisions stored in the checkpoint: {describe(restored)} (no new plan)."
            log_plan(trainer, self.plan, f"ResourceGuard: {again}")
            self._preflight_eval(trainer, pl_module, "validate")
            return
        target = self.target_batch_size or (restored.target_batch_size if restored is not None else None)
        started = time.perf_counter()

        def preflight() -> list[int]:
            return ap.decisions_row(plan_locally(self, trainer, pl_module, batch, loader_batch_size, target))

        # every rank reaches the agreement, also after its own pre-flight failed
        agreed = self._run.preflight(
            preflight, ap.ROW, ap.StrategyCollective(trainer), key=ap.most_conservative
        )
        if agreed.error is not None:
            if self.fail_fast or not isinstance(agreed.error, DoesNotFitError):
                raise agreed.error
            warn_at_user(f"ResourceGuard: {agreed.error}\nThe run continues unchanged (fail_fast=False).")
            return
        assert agreed.row is not None
        decisions, source_rank = ap.decisions_from_row(agreed.row, trainer.world_size), agreed.source_rank
        self._apply(trainer, pl_module, decisions, loader_batch_size)
        notes = lightning_shapes.start_shapes(self, trainer, pl_module, decisions)
        if trainer.world_size > 1:
            notes.append(
                f"agreed across {trainer.world_size} ranks: rank {source_rank}'s plan, the most "
                "conservative, applies to every rank"
            )
        if restored is not None:
            notes.append(f"re-planned: the checkpoint was made with world size {restored.world_size}")
        seconds = time.perf_counter() - started
        log_plan(trainer, self.plan, render_plan(decisions, self._fixed, self.plan, seconds, notes))
        self._preflight_eval(trainer, pl_module, "validate")  # before the sanity check and any step

    # -- evaluation: validation and test, each on its own dataloader's batch ----------------------------
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":  # `trainer.validate`; fit's is checked in on_fit_start
            self._preflight_eval(trainer, pl_module, "validate")
        elif self._eval_splits:  # fit's loaders, split in on_fit_start, again after a reload
            from resource_guard.frontdoors.lightning.eval_split import apply_splits

            apply_splits(trainer, "validate", self._eval_splits, reset=True)
        self._run.phase("evaluation_start")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run.phase("evaluation_end")

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._preflight_eval(trainer, pl_module, "test")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._preflight_eval(trainer, pl_module, "predict")

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from resource_guard.frontdoors.lightning.eval_split import regroup_predictions

        regroup_predictions(trainer)  # one prediction per loader batch of a split loader

    def _preflight_eval(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from resource_guard.frontdoors.lightning.eval import preflight_stage

        fitting = trainer.state.fn == "fit"
        lines, splits = preflight_stage(
            trainer, pl_module, stage, self._evals, plan=self.plan, device_name=self.device,
            memory_limit=self.memory_limit, headroom=self.headroom, fail_fast=self.fail_fast,
            precision=self.decisions.precision if fitting and self.decisions is not None else None,
        )  # fmt: skip
        if fitting:
            self._eval_splits = splits
        for line in lines:
            rank_zero_info(f"ResourceGuard: {line}")
            if self.plan is not None:
                self.plan = dataclasses.replace(self.plan, reasons=(*self.plan.reasons, line))
            self._eval_notes.append(line)
            self._run.note(line)  # into the report (the monitor starts after on_fit_start)

    def _apply(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        decisions: ap.Decisions,
        loader_batch_size: int | None,
    ) -> None:
        self._restore(trainer, pl_module)
        self._applied = ap.apply_decisions(trainer, pl_module, decisions, loader_batch_size)
        self.decisions = decisions

    # -- monitoring ----------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the run monitor (every rank; only rank zero writes)."""
        if not self.monitor:
            return
        self._global_step = trainer.global_step
        monitor = self._run.start(
            lambda: trainer_monitor(self, trainer, pl_module), self.plan, shapes=self._shapes,
            optimizers=trainer.optimizers, total_steps=total_batches(trainer),
        )  # fmt: skip
        if monitor is not None and monitor.phases is not None:  # Lightning's boundaries (lightning/phases.py)
            from resource_guard.frontdoors.lightning.phases import LightningPhases

            self._run.phases = LightningPhases(monitor.phases, self.state_key)
            self._run.phases.install(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._shapes is not None:  # before the batch runs: stop, on every rank, if it would not fit
            self._shapes.stop_if_too_big(batch)
        if self._run.monitor is not None:
            self._run.phase("step_start")
            self._run.call("batch_ready", batch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # one step is an optimizer step, as Lightning's global_step counts (its loggers' x-axis): a batch
        # that only accumulated ends none; a manual-optimization batch is a step
        stepped = trainer.global_step != self._global_step
        self._global_step = trainer.global_step
        if stepped or not pl_module.automatic_optimization:
            self._run.call("step_end")

    # -- tear-down -----------------------------------------------------------------------------------
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run.close(None)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the monitor and put the Trainer back as the user configured it. Safe to call twice."""
        if stage == "fit":
            self._run.close(None)
            self._restore(trainer, pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._run.close(exception)
        self._restore(trainer, pl_module)

    def _restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        applied, self._applied = self._applied, None
        if applied is not None:
            applied.restore(trainer, pl_module)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The applied decisions, so a resumed run keeps the same configuration."""
        return {"decisions": self.decisions.to_dict()} if self.decisions is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        found = state_dict.get("decisions")
        self._restored = ap.Decisions.from_dict(found) if found else None
