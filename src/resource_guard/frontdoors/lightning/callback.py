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
import math
import os
import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from resource_guard.errors import ConfigurationError, DoesNotFitError, warn_at_user
from resource_guard.frontdoors.eval_preflight import EvalPreflights
from resource_guard.frontdoors.lightning import apply as ap
from resource_guard.frontdoors.lightning import shapes as lightning_shapes
from resource_guard.frontdoors.lightning.internals import skip_inherited_step_hooks
from resource_guard.observe.profiling import ProfileWindow
from resource_guard.step.precision import PRECISIONS

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = ["ResourceGuard"]

_TEXT_TAG = "resource_guard/plan"
_MANUAL = "manual optimization (`automatic_optimization = False`)"


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
    ) -> None:
        from resource_guard.frontdoors.shape_guard import check_worst_case_args
        from resource_guard.frontdoors.vocabulary import check_shared, refused

        def bad(name: str, value: Any, allowed: str) -> ConfigurationError:
            return refused("ResourceGuard", name, value, allowed)

        def positive_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        # the settings every door shares, in the same words (frontdoors/vocabulary.py)
        precision = check_shared(
            "ResourceGuard", memory_limit=memory_limit, precision=precision,
            target_batch_size=target_batch_size, max_seq_len=max_seq_len, log_dir=log_dir,
            profile=profile, monitor=monitor,
        )  # fmt: skip
        if device is not None and not (isinstance(device, str) and device.strip()):
            raise bad("device", device, "a device name ('cpu', 'cuda:0', 'a100-40gb', ...) or None")
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 0.9:
            raise bad("headroom", headroom, "in [0, 0.9)")
        if checkpointing not in (True, False, "auto"):
            raise bad("checkpointing", checkpointing, "True, False or 'auto'")
        if accumulation != "auto" and not positive_int(accumulation):
            raise bad("accumulation", accumulation, "'auto' or a positive int")
        for name, value in (("fail_fast", fail_fast), ("memory_history", memory_history)):
            if not isinstance(value, bool):
                raise bad(name, value, "True or False")
        check_worst_case_args("ResourceGuard", max_seq_len, check_shapes)
        self.max_seq_len, self.worst_case_batch = max_seq_len, worst_case_batch
        self.check_shapes = check_shapes
        self._shapes: Any = None  # the ShapeGuard of this fit
        self._planned_on: Any = None  # the batch the plan was made on (the worst case when known)
        self._worst_source: str | None = None
        self.target_batch_size = target_batch_size
        self.device = device
        self.headroom = float(headroom)
        self.precision = None if precision is None else str(precision)
        self.checkpointing = checkpointing
        self.accumulation = accumulation
        self.memory_limit = memory_limit
        self.fail_fast = fail_fast
        self.profile = profile
        self.monitor = monitor
        self.log_dir = log_dir
        self.memory_history = memory_history
        self.plan: Plan | None = None
        self.decisions: ap.Decisions | None = None
        self._flops_per_sample: float | None = None
        self.report: Any = None
        self._restored: ap.Decisions | None = None
        self._applied: ap.Applied | None = None
        self._monitor: Any = None
        self._global_step = 0  # trainer.global_step at the last batch's end: a change is an optimizer step
        self._phases: Any = None  # the LightningPhases switching the monitor's phase clock, while fitting
        self._fixed = ap.Fixed()
        self._evals = EvalPreflights()  # validation/test/predict pre-flights (frontdoors/lightning/eval.py)
        self._eval_notes: list[str] = []  # their lines, for the monitor's report once it runs
        self._eval_splits: dict[int, tuple[int, int]] = {}  # fit's validation loaders split: index → sizes
        # an inherited no-op hook still costs a profiler context and a call, ~2.5 µs each, ~10 µs per step
        # for the four training hooks this callback does not use (tests/frontdoors/test_hot_path.py)
        skip_inherited_step_hooks(self)

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
            self._fixed = dataclasses.replace(self._fixed, accumulation=1, accumulation_source=_MANUAL)
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
            self._log(
                trainer,
                f"ResourceGuard: re-applied the decisions stored in the checkpoint: "
                f"{_describe(restored)} (no new plan).",
            )
            self._preflight_eval(trainer, pl_module, "validate")
            return
        target = self.target_batch_size or (restored.target_batch_size if restored is not None else None)
        started = time.perf_counter()
        local = ap.Outcome()
        try:
            local.decisions = self._plan_locally(trainer, pl_module, batch, loader_batch_size, target)
        except Exception as failure:  # every rank must reach the collective below, also after an error
            local.error = failure
        decisions, error, source_rank = ap.agree(trainer, local)
        if error is not None:
            if self.fail_fast or not isinstance(error, DoesNotFitError):
                raise error
            warn_at_user(f"ResourceGuard: {error}\nThe run continues unchanged (fail_fast=False).")
            return
        assert decisions is not None
        self._apply(trainer, pl_module, decisions, loader_batch_size)
        notes = lightning_shapes.start_shapes(self, trainer, pl_module, decisions)
        if trainer.world_size > 1:
            notes.append(
                f"agreed across {trainer.world_size} ranks: rank {source_rank}'s plan, the most "
                "conservative, applies to every rank"
            )
        if restored is not None:
            notes.append(f"re-planned: the checkpoint was made with world size {restored.world_size}")
        self._log(trainer, self._render(decisions, time.perf_counter() - started, notes))
        self._preflight_eval(trainer, pl_module, "validate")  # before the sanity check and any step

    # -- evaluation: validation and test, each on its own dataloader's batch ----------------------------
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":  # `trainer.validate`; fit's is checked in on_fit_start
            self._preflight_eval(trainer, pl_module, "validate")
        elif self._eval_splits:  # fit's loaders, split in on_fit_start, again after a reload
            from resource_guard.frontdoors.lightning.eval_split import apply_splits

            apply_splits(trainer, "validate", self._eval_splits, reset=True)
        if self._phases is not None:
            self._phases.evaluation_start()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._phases is not None:
            self._phases.evaluation_end()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._preflight_eval(trainer, pl_module, "test")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._preflight_eval(trainer, pl_module, "predict")

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from resource_guard.frontdoors.lightning.eval_split import regroup_predictions

        regroup_predictions(trainer)  # one prediction per loader batch of a split loader

    def _preflight_eval(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from resource_guard.frontdoors.lightning.eval import preflight_loops
        from resource_guard.frontdoors.lightning.eval_split import apply_splits, split_sizes

        made, fitting = self.plan, trainer.state.fn == "fit"
        checks, splits = preflight_loops(
            trainer,
            pl_module,
            stage,
            self._evals,
            plan=made,
            device_name=self.device,
            memory_limit=self.memory_limit,
            headroom=self.headroom,
            precision=self.decisions.precision if fitting and self.decisions is not None else None,
            fail_fast=self.fail_fast,
        )
        micro, notes = split_sizes(splits)
        lines = [c.line() for c in checks] + notes
        if fitting:
            self._eval_splits = micro
        apply_splits(trainer, stage, micro, reset=not fitting)  # fit's loop has not built its iterator
        for line in lines:
            rank_zero_info(f"ResourceGuard: {line}")
            if self.plan is not None:
                self.plan = dataclasses.replace(self.plan, reasons=(*self.plan.reasons, line))
            self._eval_notes.append(line)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The evaluation pre-flights into the monitor's report (it starts after ``on_fit_start``)."""
        if self._monitor is not None and self._eval_notes:
            for line in self._eval_notes:
                self._monitor.note(line)
            self._eval_notes.clear()

    def _plan_locally(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        loader_batch_size: int | None,
        target: int | None,
    ) -> ap.Decisions:
        from resource_guard.frontdoors.lightning.manual import manual_step, optimizers_of
        from resource_guard.planning.planner import plan

        optimizers = optimizers_of(trainer, pl_module)  # every optimizer, its state estimated
        manual = not pl_module.automatic_optimization
        optimizer: Any = optimizers if manual else optimizers[0]
        step = manual_step(trainer, pl_module) if manual else ap.training_step_loss
        world = trainer.world_size
        fixed = self._fixed
        batch = self._planned_on = lightning_shapes.worst_case_of(self, trainer, batch)
        if target is None:
            if loader_batch_size is None:
                raise ConfigurationError(
                    "cannot tell the train loader's batch size (its tensors do not share dim 0); pass "
                    "`ResourceGuard(target_batch_size=...)`."
                )
            target = loader_batch_size * trainer.accumulate_grad_batches * world
        per_step = target
        if fixed.accumulation is not None:
            if target % (fixed.accumulation * world):
                raise ConfigurationError(
                    f"the target batch {target} is not divisible by the fixed accumulation × world size "
                    f"({fixed.accumulation_source} × {world}); change `target_batch_size` or the "
                    "accumulation."
                )
            per_step = target // fixed.accumulation
        with ap.detached_trainer(pl_module):
            made = plan(
                pl_module,
                optimizer,
                batch,
                step,
                device=self.device or str(trainer.strategy.root_device),
                target_batch_size=per_step,
                headroom=self.headroom,
                precision=fixed.precision or "auto",
                checkpointing=self.checkpointing,
                world_size=world,
                strategy=_strategy_name(trainer),
                memory_limit=self.memory_limit,
                allow_rough=True,  # the run starts either way: plan on the bound, its warning says why
            )
        self.plan = made
        if self.monitor:  # model FLOPs per sample, for MFU (before checkpointing is applied)
            with ap.detached_trainer(pl_module):
                self._flops_per_sample = _flops_per_sample(
                    pl_module, batch, step if manual else None, optimizers
                )
        accumulation = made.accumulation_steps
        if fixed.accumulation is not None:
            if made.accumulation_steps != 1:
                raise DoesNotFitError(
                    f"with {fixed.accumulation_source} fixed, each rank's micro-batch must be "
                    f"{per_step // world} for the target batch {target}, and that does not fit: the largest "
                    f"that fits is {made.micro_batch_size} ({made.precision}, checkpointing "
                    f"{'on' if made.checkpointing else 'off'}). "
                    + (
                        "Lower the batch size (or accumulate in `training_step`)."
                        if manual
                        else "Remove the accumulation setting so ResourceGuard can choose it, or lower the "
                        "target batch."
                    ),
                    made,
                )
            accumulation = fixed.accumulation
        return ap.Decisions(
            made.micro_batch_size, accumulation, made.precision, bool(made.checkpointing), target, world
        )

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
        from resource_guard.observe.monitor import RunMonitor

        log_dir = self.log_dir
        if log_dir is None:  # `trainer.log_dir` is a collective under DDP: every rank reads it
            log_dir = os.path.join(trainer.log_dir or trainer.default_root_dir, "resource_guard")
        writer = None
        if trainer.is_global_zero:
            writer = next(
                (lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None
            )
        made = self.plan
        # on a GPU the plan's capacity (a `memory_limit` cap included) is what the allocator peak is held
        # against; on the CPU the monitor measures the whole process's RSS, held against the machine's RAM
        on_gpu = made is not None and trainer.strategy.root_device.type == "cuda"
        self._monitor = RunMonitor(
            log_dir,
            device=trainer.strategy.root_device,
            log_every_n_steps=max(1, int(getattr(trainer, "log_every_n_steps", 50) or 50)),
            profile=self.profile,
            estimate=made.estimate if made is not None else None,
            capacity_bytes=made.fit.capacity_bytes if on_gpu and made is not None else None,
            planned_capacity_bytes=made.fit.capacity_bytes if made is not None else None,
            device_spec=made.device
            if on_gpu and made is not None and made.device.source == "detected"
            else None,
            writer=writer,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            loader_info=ap.loader_info(trainer),
            precision=str(trainer.precision) if str(trainer.precision) in PRECISIONS else None,
            memory_history=self.memory_history,
            phase_timing=True,  # switched at Lightning's own boundaries (frontdoors/lightning/phases.py)
            flops_per_step=(  # a step is an optimizer step: its micro-batches' FLOPs
                self._flops_per_sample * self.decisions.micro_batch_size * _accumulation(trainer, pl_module)
                if self._flops_per_sample and self.decisions is not None
                else None
            ),
        )
        self._global_step = trainer.global_step
        self._monitor.total_steps = _total_batches(trainer)
        if made is not None:  # the advice quotes the configuration it recommends from the plan's table
            from resource_guard.report.plan_advice import plan_rows

            self._monitor.plan_rows = plan_rows(made)
        self._monitor.shape_stats = self._shapes.stats if self._shapes is not None else None
        self._monitor.optimizers = tuple(trainer.optimizers)
        self._monitor.start()
        if self._monitor.phases is not None:
            from resource_guard.frontdoors.lightning.phases import LightningPhases

            self._phases = LightningPhases(self._monitor.phases, self.state_key)
            self._phases.install(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._shapes is not None:  # before the batch runs: stop, on every rank, if it would not fit
            self._shapes.stop_if_too_big(batch)
        if self._monitor is not None:
            if self._phases is not None:
                self._phases.step_start()
            self._monitor.batch_ready(batch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # one step is an optimizer step, as Lightning's global_step counts (its loggers' x-axis): a batch
        # that only accumulated ends none; a manual-optimization batch is a step
        stepped = trainer.global_step != self._global_step
        self._global_step = trainer.global_step
        if self._monitor is not None and (stepped or not pl_module.automatic_optimization):
            self._monitor.step_end()

    # -- tear-down -----------------------------------------------------------------------------------
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(None)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the monitor and put the Trainer back as the user configured it. Safe to call twice."""
        if stage == "fit":
            self._close(None)
            self._restore(trainer, pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close(exception)
        self._restore(trainer, pl_module)

    def _close(self, exc: BaseException | None) -> None:
        phases, self._phases = self._phases, None
        if phases is not None:
            phases.remove()
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            self.report = monitor.close(exc)

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

    # -- logging -------------------------------------------------------------------------------------
    def _render(self, d: ap.Decisions, seconds: float, notes: list[str]) -> str:
        fixed = self._fixed
        lines = [f"ResourceGuard plan ({seconds:.1f} s): {_describe(d)}", *(f"- {n}" for n in notes)]
        if fixed.accumulation_source == _MANUAL:
            from resource_guard.frontdoors.lightning.manual import WHAT_MANUAL_LEAVES

            lines.append(f"- {WHAT_MANUAL_LEAVES}")
        elif fixed.accumulation is not None:
            lines.append(f"- accumulation fixed by {fixed.accumulation_source}: planned around it")
        if fixed.precision is not None:
            lines.append(f"- precision fixed by {fixed.precision_source}: planned around it")
        made = self.plan
        if made is not None:
            lines.extend(f"- {reason}" for reason in getattr(made, "reasons", ()))
            est, fit = made.estimate, made.fit
            parts = ", ".join(f"{k} {_mib(v)}" for k, v in est.breakdown.items() if v)
            lines.append(
                f"- pre-flight ({est.method}): peak {_mib(est.peak_bytes)} per rank ({parts}); device "
                f"{fit.device.name}: {_mib(fit.device_total_bytes)} of {_mib(fit.capacity_bytes)} "
                f"(usable {_mib(fit.usable_bytes)})"
            )
        return "\n".join(lines)

    def _log(self, trainer: pl.Trainer, text: str) -> None:
        """Console (rank zero), and TensorBoard text with the planner's table of alternatives."""
        rank_zero_info(text)
        if not trainer.is_global_zero:
            return
        head, _, rest = text.partition("\n")
        markdown = f"{head}\n\n{rest}" if rest else head
        alternatives = getattr(self.plan, "alternatives", ())
        if alternatives:
            from resource_guard.planning.search import render_table

            markdown += "\n\n" + render_table(alternatives)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(_TEXT_TAG, markdown, trainer.global_step)


def _describe(d: ap.Decisions) -> str:
    return (
        f"micro-batch {d.micro_batch_size} × accumulation {d.accumulation_steps} × world size "
        f"{d.world_size} = {d.target_batch_size}; precision {d.precision}; activation checkpointing "
        f"{'on' if d.checkpointing else 'off'}"
    )


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _strategy_name(trainer: pl.Trainer) -> str:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    if isinstance(trainer.strategy, FSDPStrategy):
        return "fsdp"
    if trainer.world_size == 1:
        return "single"
    if not isinstance(trainer.strategy, DDPStrategy):
        warn_at_user(
            f"ResourceGuard: {type(trainer.strategy).__name__} is planned as DDP (a full replica per "
            "rank), which is conservative for sharded strategies."
        )
    return "ddp"


def _flops_per_sample(
    pl_module: pl.LightningModule, batch: Any, manual: Any = None, optimizers: Any = ()
) -> float | None:
    """FLOPs of ``training_step`` + backward per sample, counted on fake tensors; None if unknown."""
    from resource_guard.frontdoors.lightning.manual import manual_flops
    from resource_guard.observe.throughput import count_flops
    from resource_guard.step.training import batch_size_of

    size = batch_size_of(batch)
    if not size:
        return None
    if manual is not None:  # the module's own step, its backwards included
        flops = manual_flops(manual, pl_module, optimizers, batch)
    else:
        flops = count_flops(pl_module, batch, ap.training_step_loss)
    return flops / size if flops and size else None


def _accumulation(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    """Batches per optimizer step: ``accumulate_grad_batches`` (automatic optimization), else one."""
    if not getattr(pl_module, "automatic_optimization", True):
        return 1
    return max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))


def _total_batches(trainer: pl.Trainer) -> int | None:
    """Optimizer steps the fit will run (the monitor's steps), for the report's ETA; None if unbounded."""
    try:
        steps = float(trainer.estimated_stepping_batches)
    except Exception:  # no loader length yet (iterable datasets), or Lightning could not tell
        return None
    if not math.isfinite(steps) or steps <= 0:
        return None
    return int(steps)
