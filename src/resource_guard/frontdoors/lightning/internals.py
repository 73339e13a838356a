"""What the Lightning door relies on beyond Lightning's public API, each in one small function.

Re-batching the train loader, rebuilding it with a new ``batch_size``, splitting evaluation loaders
and skipping inherited per-batch hooks need a private attribute or behaviour of Lightning 2.x where no
public hook does the job. Each function below touches exactly one, names it in its docstring and in
:data:`LIGHTNING_INTERNALS`, and ``tests/frontdoors/test_lightning_callback.py::
test_lightning_internals_are_where_we_expect`` fails loudly when a Lightning release moves one. Nothing
else in resource_guard touches Lightning privates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback

from resource_guard.errors import ResourceGuardError

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "LIGHTNING_INTERNALS",
    "STEP_HOOKS",
    "before_batch_transfer",
    "data_from_module",
    "drop_train_dataloader",
    "eval_batch_counts",
    "eval_combined_loader",
    "predict_outputs",
    "process_train_loader",
    "restart_eval_iterator",
    "skip_inherited_step_hooks",
    "transform_train_source",
]

LIGHTNING_INTERNALS = {
    "data_from_module": "Trainer.fit_loop._data_source.is_module()",
    "drop_train_dataloader": "Trainer.fit_loop._combined_loader",
    "before_batch_transfer": "LightningModule._on_before_batch_transfer",
    "transform_train_source": "Trainer.fit_loop._data_source (a data_connector._DataLoaderSource)",
    "process_train_loader": "lightning.pytorch.trainer.connectors.data_connector._process_dataloader",
    "skip_inherited_step_hooks": "trainer.call._call_callback_hooks calls a hook only when callable",
    "eval_combined_loader": "_EvaluationLoop/_PredictionLoop._combined_loader",
    "eval_batch_counts": "_EvaluationLoop._max_batches / _PredictionLoop.max_batches",
    "restart_eval_iterator": "the loops' _data_fetcher and reset() (which builds the iterator)",
    "predict_outputs": "_PredictionLoop._predictions",
}

_STAGES = ("train", "validation", "test", "predict")
_BATCH_HOOKS = tuple(f"on_{stage}_batch_{end}" for stage in _STAGES for end in ("start", "end"))
# the per-batch and per-step hooks Lightning calls on every callback
STEP_HOOKS = (
    *_BATCH_HOOKS,
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)


def data_from_module(trainer: pl.Trainer) -> bool:
    """Whether the train dataloader comes from the LightningModule/DataModule (so it can be rebuilt with
    a new ``batch_size``) rather than being passed to ``fit`` directly. Private: ``fit_loop._data_source``
    (BatchSizeFinder makes the same check)."""
    return bool(trainer.fit_loop._data_source.is_module())


def drop_train_dataloader(trainer: pl.Trainer) -> None:
    """Forget the fit loop's train dataloader so ``fit_loop.setup_data()`` asks the module/datamodule for
    it again. Private: ``fit_loop._combined_loader`` (what the batch-size tuner resets)."""
    loop = trainer.fit_loop
    if not hasattr(loop, "_combined_loader"):
        raise ResourceGuardError(
            "this Lightning version has no `fit_loop._combined_loader`; resource_guard cannot rebuild the "
            "train dataloader. Please report it with your Lightning version."
        )
    loop._combined_loader = None


def before_batch_transfer(pl_module: pl.LightningModule, batch: Any) -> Any:
    """``on_before_batch_transfer`` of the module and datamodule, as the training loop calls it.
    Private: ``LightningModule._on_before_batch_transfer``."""
    return pl_module._on_before_batch_transfer(batch, dataloader_idx=0)


def transform_train_source(trainer: pl.Trainer, transform: Callable[[Any], Any]) -> Callable[[], None]:
    """Have the fit loop pass every train dataloader it requests (from ``fit``'s argument, the module or
    the datamodule) through ``transform`` before it processes it; returns the undo. Private:
    ``fit_loop._data_source`` (a ``_DataLoaderSource``; no public hook sees the loader before the loop
    builds its iterator)."""
    from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource

    loop = trainer.fit_loop
    original = loop._data_source
    if not isinstance(original, _DataLoaderSource):
        raise ResourceGuardError(
            "this Lightning version has no `fit_loop._data_source`; resource_guard cannot re-batch the "
            "train dataloader. Please report it with your Lightning version."
        )

    class _Transformed(_DataLoaderSource):
        def dataloader(self) -> Any:
            return transform(super().dataloader())

    loop._data_source = _Transformed(original.instance, original.name)

    def undo() -> None:
        loop._data_source = original

    return undo


def process_train_loader(trainer: pl.Trainer, loader: Any) -> Any:
    """What the fit loop does to a train dataloader before iterating it: the ``DistributedSampler``
    injection under DDP, the strategy's ``process_dataloader``, the workers' seeding. Private:
    ``trainer.connectors.data_connector._process_dataloader``."""
    from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    return _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.TRAINING, loader)


def skip_inherited_step_hooks(callback: Callback) -> None:
    """Set the per-batch hooks that ``callback``'s class inherits from ``Callback`` unchanged to ``None``
    on the instance, so that Lightning skips them (a hook that is not callable is not called: the
    dispatch in ``trainer.call._call_callback_hooks``); hooks a class defines are left alone."""
    for name in STEP_HOOKS:
        if getattr(type(callback), name, None) is getattr(Callback, name):
            setattr(callback, name, None)


def eval_combined_loader(loop: Any) -> Any:
    """The ``CombinedLoader`` an evaluation or predict loop has set up (``None`` before). Private:
    ``_combined_loader``."""
    return getattr(loop, "_combined_loader", None)


def eval_batch_counts(loop: Any, stage: str) -> list[Any]:
    """The loop's per-loader batch counts, a list to update in place. Private: ``_max_batches`` of the
    evaluation loop (the predict loop's ``max_batches`` is its own list)."""
    return loop.max_batches if stage == "predict" else loop._max_batches  # type: ignore[no-any-return]


def restart_eval_iterator(loop: Any) -> None:
    """Tear down the loop's data fetcher and rebuild its iterator over the loaders it holds now.
    Private: ``_data_fetcher`` and ``reset()``."""
    fetcher = getattr(loop, "_data_fetcher", None)
    if fetcher is not None:
        fetcher.teardown()
    loop.reset()


def predict_outputs(loop: Any) -> list[list[Any]]:
    """The predict loop's predictions, one list per loader (what ``trainer.predict`` returns). Private:
    ``_PredictionLoop._predictions``."""
    return loop._predictions  # type: ignore[no-any-return]
