"""Helpers of the Lightning callback: what the user fixed, one real batch, the cross-rank agreement,
and applying a plan to a Trainer the way a user would configure it by hand (and undoing it).

What touches a private attribute of Lightning is in
:mod:`~resource_guard.frontdoors.lightning.internals`, one small function per attribute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import DataLoader

from resource_guard.errors import ConfigurationError
from resource_guard.frontdoors.lightning.hooks import call_training_step
from resource_guard.frontdoors.lightning.internals import (
    before_batch_transfer,
    data_from_module,
    drop_train_dataloader,
)
from resource_guard.step.precision import PRECISIONS, parse_precision
from resource_guard.step.training import batch_size_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "Applied",
    "Decisions",
    "Fixed",
    "StrategyCollective",
    "decisions_from_row",
    "decisions_row",
    "most_conservative",
    "apply_decisions",
    "detached_trainer",
    "first_batch",
    "fixed_settings",
    "loader_info",
    "training_step_loss",
]

BATCH_ATTR = "batch_size"
_PRECISION_NAMES = tuple(PRECISIONS)
_LOG_WARNING = r"You are trying to `self\.log\(\)`"


@dataclass(frozen=True)
class Decisions:
    """What the callback configured; stored in the checkpoint so a resumed run keeps it.

    ``micro_batch_size × accumulation_steps × world_size == target_batch_size``.
    """

    micro_batch_size: int
    accumulation_steps: int
    precision: str
    checkpointing: bool
    target_batch_size: int
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decisions:
        """Rebuild from :meth:`to_dict`; a malformed entry raises ``ConfigurationError``."""
        try:
            made = cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})
            ints = (made.micro_batch_size, made.accumulation_steps, made.target_batch_size, made.world_size)
            ok = all(isinstance(v, int) and v >= 1 for v in ints) and isinstance(made.checkpointing, bool)
            parse_precision(made.precision)
        except (KeyError, TypeError, ConfigurationError) as error:
            raise ConfigurationError(
                f"the checkpoint's ResourceGuard state {dict(data)!r} is malformed ({error!r}); resume "
                "without the callback's state (drop `callbacks['ResourceGuard']` from the checkpoint)."
            ) from None
        if not ok:
            raise ConfigurationError(f"the checkpoint's ResourceGuard state {dict(data)!r} is malformed.")
        return made


@dataclass(frozen=True)
class Fixed:
    """Settings the user fixed explicitly, and where (for the messages)."""

    accumulation: int | None = None
    accumulation_source: str = ""
    precision: str | None = None
    precision_source: str = ""


def trainer_precision_is_default(trainer: pl.Trainer) -> bool:
    """True when the Trainer runs Lightning's default 32-true plugin (``Trainer(precision=None)``).

    ``Trainer(precision="32-true")`` cannot be told apart from the default: pin it with
    ``ResourceGuard(precision="32-true")``.
    """
    return type(trainer.precision_plugin) is Precision and trainer.precision == "32-true"


def fixed_settings(trainer: pl.Trainer, precision: str | None, accumulation: int | str) -> Fixed:
    """What the user fixed, from the Trainer and the callback's own arguments; conflicts are refused.

    ``precision=None`` keeps the Trainer's precision whatever it is (Lightning's default included);
    ``"auto"`` leaves it to the planner unless the Trainer names one other than the default.
    """
    acc: int | None = None
    acc_source = ""
    trainer_acc = int(trainer.accumulate_grad_batches)
    if isinstance(accumulation, int):
        if trainer_acc not in (1, accumulation):
            raise ConfigurationError(
                f"`ResourceGuard(accumulation={accumulation})` conflicts with "
                f"`Trainer(accumulate_grad_batches={trainer_acc})`: either remove `accumulate_grad_batches` "
                "from the Trainer or the `accumulation` argument from the callback."
            )
        acc, acc_source = accumulation, f"ResourceGuard(accumulation={accumulation})"
    elif trainer_acc != 1:
        acc, acc_source = trainer_acc, f"Trainer(accumulate_grad_batches={trainer_acc})"
    prec: str | None = None
    prec_source = ""
    trainer_default = trainer_precision_is_default(trainer)
    if precision is not None and precision != "auto":
        if not trainer_default and trainer.precision != precision:
            raise ConfigurationError(
                f"`ResourceGuard(precision={precision!r})` conflicts with the Trainer's precision "
                f"{trainer.precision!r}: set the precision in one place only."
            )
        if parse_precision(precision).param_dtype != torch.float32 and trainer.precision != precision:
            raise ConfigurationError(
                f"`ResourceGuard(precision={precision!r})` would change the parameters' dtype after the "
                f"strategy has set the model up; pass `Trainer(precision={precision!r})` instead."
            )
        prec, prec_source = precision, f"ResourceGuard(precision={precision!r})"
    elif precision is None or not trainer_default:
        name = str(trainer.precision)
        if name not in PRECISIONS:
            raise ConfigurationError(
                f"the Trainer's precision {name!r} is not one resource_guard can estimate "
                f"({', '.join(PRECISIONS)}); remove the ResourceGuard callback or use one of those."
            )
        prec, prec_source = name, f"Trainer(precision={name!r})"
        if trainer_default:
            prec_source = (
                "the Trainer's precision (32-true, Lightning's default; "
                "`ResourceGuard(precision='auto')` lets the planner choose)"
            )
    return Fixed(acc, acc_source, prec, prec_source)


def first_batch(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[Any, int | None] | None:
    """One real batch from the train dataloader, moved to the device the way the training loop moves it,
    and the loader's batch size; ``None`` when there is no train dataloader (``limit_train_batches=0``).

    The global RNG state is left as it was (a shuffling sampler draws its seed from it), and the fit
    loop's own loader is dropped afterwards so training starts on a fresh iterator.
    """
    with isolate_rng(include_cuda=False):  # loaders seed from the CPU generator; no CUDA context
        trainer.fit_loop.setup_data()
        loader = trainer.train_dataloader
        if loader is None:
            return None
        try:
            if isinstance(loader, DataLoader):
                batch = next(iter(loader))
                size = loader.batch_size
            else:  # several train loaders: the batch is what the loop would yield
                from lightning.pytorch.utilities.combined_loader import CombinedLoader

                combined = CombinedLoader(loader, "max_size_cycle")
                batch = next(iter(combined))[0]
                size = None
        except StopIteration:
            raise ConfigurationError(
                "the train dataloader is empty: ResourceGuard needs one batch to plan the run."
            ) from None
        finally:
            drop_train_dataloader(trainer)
        batch = before_batch_transfer(pl_module, batch)
        batch = trainer.strategy.batch_to_device(batch, dataloader_idx=0)
    return batch, batch_size_of(batch) or size


def loader_info(trainer: pl.Trainer) -> dict[str, Any]:
    """num_workers / pin_memory / persistent_workers / prefetch_factor of the train DataLoader."""
    loader = trainer.train_dataloader
    loader = getattr(loader, "loader", loader)  # inside a lightning_rebatch.ReBatchedLoader
    if not isinstance(loader, DataLoader):
        return {}
    keys = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
    return {k: getattr(loader, k, None) for k in keys}


@contextlib.contextmanager
def detached_trainer(pl_module: pl.LightningModule) -> Iterator[None]:
    """Detach the module (and its child LightningModules) from the Trainer while it is estimated.

    The estimator deep-copies the module onto fake tensors; with the Trainer attached the copy would
    take the Trainer along. Detached, ``self.log`` in ``training_step`` only warns, and that warning is
    silenced here.
    """
    trainer = pl_module._trainer
    pl_module.trainer = None  # type: ignore[assignment]  # the public setter, recursing into children
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_LOG_WARNING)
            yield
    finally:
        pl_module.trainer = trainer  # type: ignore[assignment]


class _TrainingStepLoss:
    """The loss function the estimator traces: the module's own ``training_step`` on the batch.

    Lightning keeps only what ``training_step`` returns: the module's outputs are its locals, freed before
    backward, so the traced step does not keep them (``keep_outputs = False``).
    """

    keep_outputs = False

    def __call__(self, module: Any, batch: Any) -> Any:
        out = call_training_step(module, batch)
        if out is None:
            raise ConfigurationError(
                "`training_step` returned None on the first batch (a skipped step): ResourceGuard needs the "
                "loss. Return the loss tensor, or a dict with a 'loss' key."
            )
        return out

    def __repr__(self) -> str:
        return "training_step_loss"


training_step_loss = _TrainingStepLoss()


# ---------------------------------------------------------------------------------------------------
# agreement across ranks (one implementation for every door: frontdoors/run.py)


class StrategyCollective:
    """:class:`~resource_guard.frontdoors.run.Collective` over the Trainer's strategy (its own
    collectives, on its root device: NCCL, gloo or XLA alike)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._strategy = trainer.strategy
        self.rank, self.world_size = trainer.global_rank, trainer.world_size

    def all_gather(self, row: list[int]) -> list[list[int]]:
        tensor = torch.tensor(row, dtype=torch.int64, device=self._strategy.root_device)
        return self._strategy.all_gather(tensor).reshape(-1, len(row)).cpu().tolist()

    def broadcast(self, payload: bytes | None, src: int) -> bytes | None:
        return self._strategy.broadcast(payload, src=src)


ROW = 5  # the decisions as agreed: micro-batch, accumulation, checkpointing, precision index, target


def decisions_row(d: Decisions) -> list[int]:
    """``d`` as this rank's row of the agreement (:func:`resource_guard.frontdoors.run.agree`)."""
    precision = _PRECISION_NAMES.index(d.precision)
    return [d.micro_batch_size, d.accumulation_steps, int(d.checkpointing), precision, d.target_batch_size]


def most_conservative(row: Sequence[int]) -> tuple[int, int]:
    """The agreement's order: the smallest micro-batch wins, then checkpointing on (then the lowest rank)."""
    return row[0], -row[2]


def decisions_from_row(row: Sequence[int], world_size: int) -> Decisions:
    micro, acc, ckpt, prec, target = row
    return Decisions(micro, acc, _PRECISION_NAMES[prec], bool(ckpt), target, world_size)


# ---------------------------------------------------------------------------------------------------
# applying, and undoing


class Applied:
    """What :func:`apply_decisions` changed, so :meth:`restore` can put it back (idempotent)."""

    def __init__(self) -> None:
        self.batch_size: Any = None
        self.batch_size_changed = False
        self.accumulation: int | None = None
        self.precision_plugin: Precision | None = None
        self.checkpoint_handle: Any = None
        self.rebatched: Any = None  # a lightning_rebatch.ReBatched

    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put the Trainer, module and datamodule back as they were before the plan was applied."""
        handle, self.checkpoint_handle = self.checkpoint_handle, None
        if handle is not None:
            handle.remove()
        rebatched, self.rebatched = self.rebatched, None
        if rebatched is not None:
            rebatched.remove(trainer)
        if self.batch_size_changed:
            self.batch_size_changed = False
            lightning_setattr(pl_module, BATCH_ATTR, self.batch_size)
        if self.accumulation is not None:
            trainer.accumulate_grad_batches, self.accumulation = self.accumulation, None
        if self.precision_plugin is not None:
            trainer.strategy.precision_plugin, self.precision_plugin = self.precision_plugin, None


def precision_plugin_for(name: str, device_type: str) -> Precision:
    """Lightning's public precision plugin for a precision name."""
    if name in ("16-mixed", "bf16-mixed"):
        return MixedPrecision(name, device_type)  # type: ignore[arg-type]
    if name in ("16-true", "bf16-true"):
        return HalfPrecision(name)  # type: ignore[arg-type]
    return Precision()


def can_rebuild(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the train loader comes from ``train_dataloader()`` of a module or datamodule with a
    ``batch_size`` attribute to set (the first choice for a new micro-batch size)."""
    return data_from_module(trainer) and bool(lightning_hasattr(pl_module, BATCH_ATTR))


def apply_decisions(
    trainer: pl.Trainer, pl_module: pl.LightningModule, decisions: Decisions, current_batch_size: int | None
) -> Applied:
    """Configure the Trainer as the decisions say: batch size, accumulation, precision, checkpointing.

    A new micro-batch size is set through the module's/datamodule's ``batch_size`` when the train loader is
    rebuilt from it; otherwise each loader batch runs as micro-batches
    (:mod:`~resource_guard.frontdoors.lightning.rebatch`). Refusals come first, before anything is
    changed. On a failure half-way, what was changed is undone.
    """
    from resource_guard.frontdoors.lightning.rebatch import parts_for, rebatch

    micro = decisions.micro_batch_size
    change = current_batch_size != micro
    rebuild = change and can_rebuild(trainer, pl_module)
    if change and not rebuild:
        parts_for(pl_module, current_batch_size, decisions)
    applied = Applied()
    try:
        if rebuild:
            applied.batch_size = lightning_getattr(pl_module, BATCH_ATTR)
            applied.batch_size_changed = True
            lightning_setattr(pl_module, BATCH_ATTR, micro)
            if not _rebuilt_loader_took(trainer, micro):  # `batch_size` exists but the loader ignores it
                applied.batch_size_changed = False
                lightning_setattr(pl_module, BATCH_ATTR, applied.batch_size)
                rebuild = False
        if change and not rebuild:
            applied.rebatched = rebatch(trainer, pl_module, current_batch_size, decisions)
        if trainer.accumulate_grad_batches != decisions.accumulation_steps:
            applied.accumulation = trainer.accumulate_grad_batches
            trainer.accumulate_grad_batches = decisions.accumulation_steps
        if trainer.precision != decisions.precision:
            applied.precision_plugin = trainer.strategy.precision_plugin
            plugin = precision_plugin_for(decisions.precision, trainer.strategy.root_device.type)
            trainer.strategy.precision_plugin = plugin
        if decisions.checkpointing:
            from resource_guard.planning.checkpointing import apply_checkpointing

            applied.checkpoint_handle = apply_checkpointing(pl_module)
    except BaseException:
        applied.restore(trainer, pl_module)
        raise
    return applied


def _rebuilt_loader_took(trainer: pl.Trainer, micro: int) -> bool:
    """Rebuild the train loader with the new ``batch_size``: whether it took; then drop it again so the
    fit loop builds its own after the checkpoint (if any) is restored."""
    with isolate_rng(include_cuda=False):  # loaders seed from the CPU generator; no CUDA context
        drop_train_dataloader(trainer)
        trainer.fit_loop.setup_data()
        loader = trainer.train_dataloader
        drop_train_dataloader(trainer)
    got = loader.batch_size if isinstance(loader, DataLoader) else None
    return got is None or got == micro
