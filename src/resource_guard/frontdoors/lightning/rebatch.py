"""Re-batching a Lightning run's train loader into the plan's micro-batches.

When the plan's micro-batch is smaller than the train loader's batch and the loader cannot be rebuilt
with a new ``batch_size`` (it was passed to ``trainer.fit(model, loader)``, it uses a ``batch_sampler``
or an ``IterableDataset``, or nothing reads ``self.batch_size``), each loader batch runs as ``k``
micro-batches with ``Trainer.accumulate_grad_batches`` a multiple of ``k``: the same samples in the same
order, the same effective batch, the same number of optimizer steps. Two mechanisms, the more faithful
first:

- a map-style ``DataLoader`` keeps its sampler, dataset, collate function and workers, and its batch
  sampler's index lists are cut into ``k`` pieces (:class:`SplitBatchSampler`), so collate and padding
  run per micro-batch. Lightning's ``DistributedSampler`` injection runs on the user's loader first;
- any other iterable (an ``IterableDataset``, a loader of ready-made batches) has each batch cut along
  its leading dimension (:func:`~resource_guard.step.batching.split_batch`).

Pieces are as even as possible (sizes differ by at most one row). A loader batch that does not divide
evenly (the epoch's last, or a bucketing sampler's smaller ones) is weighted exactly: each piece's loss
counts ``k × rows / batch rows`` (:class:`LossWeights`), so for a loss that is a mean over rows the
gradient equals the full batch's.

Example:
    >>> import torch
    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> batches = BatchSampler(SequentialSampler(range(10)), batch_size=4, drop_last=False)
    >>> list(SplitBatchSampler(batches, parts=2))
    [[0, 1], [2, 3], [4, 5], [6, 7], [8], [9]]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from resource_guard.errors import ConfigurationError
from resource_guard.frontdoors.lightning.internals import (
    drop_train_dataloader,
    process_train_loader,
    skip_inherited_step_hooks,
    transform_train_source,
)
from resource_guard.step.batching import even_bounds, split_batch

if TYPE_CHECKING:
    import lightning.pytorch as pl


class Split(Protocol):
    """What re-batching reads of the callback's decisions (a ``lightning_apply.Decisions``)."""

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def accumulation_steps(self) -> int: ...


__all__ = [
    "LossWeights",
    "PiecesOf",
    "ReBatched",
    "ReBatchedLoader",
    "SplitBatchSampler",
    "parts_for",
    "rebatch",
]


class PiecesOf(Sampler[list[int]]):
    """A batch sampler that yields pieces of another's index lists: the inner sampler's ``sampler``
    stays reachable (Lightning's shuffle detection) and ``set_epoch`` reaches both."""

    batch_sampler: Iterable[Sequence[int]]

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        for target in (self.batch_sampler, self.sampler):
            set_epoch = getattr(target, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)


class SplitBatchSampler(PiecesOf):
    """Each index list of ``batch_sampler`` as ``parts`` consecutive, near-equal pieces.

    Args:
        batch_sampler: the loader's batch sampler (its ``sampler`` stays reachable, for Lightning's
            shuffle detection and ``set_epoch``).
        parts: pieces per batch (fewer for a batch with fewer rows).
    """

    def __init__(self, batch_sampler: Iterable[Sequence[int]], parts: int) -> None:
        if not (isinstance(parts, int) and parts >= 1):
            raise ConfigurationError(f"`SplitBatchSampler(parts={parts!r})` must be an int >= 1.")
        self.batch_sampler, self.parts = batch_sampler, parts
        self.pieces: deque[float] = deque()  # the loss weight of each piece yielded, in order

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.batch_sampler:
            indices = list(indices)
            for lo, hi in even_bounds(len(indices), self.parts):
                self.pieces.append(self.parts * (hi - lo) / len(indices))
                yield indices[lo:hi]

    def __len__(self) -> int:
        inner = self.batch_sampler
        if isinstance(inner, BatchSampler) and hasattr(inner.sampler, "__len__"):  # exact
            full, rest = divmod(len(inner.sampler), inner.batch_size)  # type: ignore[arg-type]
            return full * min(self.parts, inner.batch_size) + (
                0 if inner.drop_last else min(self.parts, rest)
            )
        return len(inner) * self.parts  # type: ignore[arg-type]  # each batch at least `parts` rows


class ReBatchedLoader:
    """The train loader Lightning iterates: micro-batches of the user's loader, in order.

    Not a ``DataLoader`` on purpose: Lightning leaves it as it is (its loader inside was already
    processed, the ``DistributedSampler`` injected), and reads ``sampler`` / ``batch_sampler`` for
    ``set_epoch``.
    """

    def __init__(self, loader: Iterable[Any], parts: int, weights: deque[float], split: bool) -> None:
        self.loader, self.parts, self._weights, self._split = loader, parts, weights, split

    @property
    def sampler(self) -> Any:
        sampler = getattr(self.loader, "batch_sampler", None)
        return getattr(sampler, "sampler", None) if self._split else getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    def __len__(self) -> int:
        return len(self.loader) * (1 if self._split else self.parts)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self._weights.clear()
        if self._split:  # the batch sampler cuts the index lists: one weight per piece, in order
            sampler = self.loader.batch_sampler  # type: ignore[attr-defined]
            sampler.pieces.clear()
            for batch in self.loader:
                self._weights.append(sampler.pieces.popleft())
                yield batch
            return
        for batch in self.loader:
            try:
                pieces = split_batch(batch, parts=self.parts)
            except ConfigurationError as error:
                raise ConfigurationError(
                    f"ResourceGuard cannot run the train loader's batches as {self.parts} micro-batches: "
                    f"{error} Return batches whose tensors share their first dimension, or build the "
                    "DataLoader in `train_dataloader()` with `batch_size=self.batch_size`."
                ) from None
            rows = sum(_rows(p) for p in pieces)
            for piece in pieces:
                self._weights.append(self.parts * _rows(piece) / rows)
                yield piece


def _rows(batch: Any) -> int:
    from resource_guard.step.training import batch_size_of

    return batch_size_of(batch) or 1


class LossWeights(Callback):
    """Weight each micro-batch's loss by ``k × rows / loader batch rows`` before its backward (1 for the
    even pieces of a full batch, so nothing is done), in the order the loader yielded them."""

    def __init__(self, weights: deque[float]) -> None:
        self.weights, self.current = weights, 1.0
        skip_inherited_step_hooks(self)  # Lightning then calls only the two hooks below, per step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.current = self.weights.popleft() if self.weights else 1.0

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        if self.current != 1.0:
            loss.mul_(self.current)  # in place, recorded by autograd: the tensor the backward runs on


def parts_for(pl_module: Any, current: int | None, decisions: Split) -> int:
    """Micro-batches per loader batch, or ``ConfigurationError`` (with the remedy) when a loader batch of
    ``current`` rows cannot run as whole micro-batches of the plan."""
    micro, acc = decisions.micro_batch_size, decisions.accumulation_steps
    stuck = f"the plan needs micro-batch size {micro} (the train loader has {current})"
    if current is None:
        raise ConfigurationError(
            f"{stuck}, and the loader's batch size cannot be told; pass "
            "`ResourceGuard(target_batch_size=...)` or build the DataLoader in `train_dataloader()` with "
            "`batch_size=self.batch_size`."
        )
    if micro > current or current % micro:
        raise ConfigurationError(
            f"{stuck}: a loader batch cannot run as whole micro-batches of {micro}. Build the train "
            "DataLoader in `train_dataloader()` of a LightningDataModule (or the LightningModule) with "
            "`batch_size=self.batch_size`, or pass a `target_batch_size` that is a multiple of the loader's."
        )
    parts = current // micro
    if acc % parts:
        raise ConfigurationError(
            f"{stuck}: each loader batch would run as {parts} micro-batches, but the accumulation is {acc}, "
            "not a multiple of it; pass a `target_batch_size` that is a multiple of the loader's batch."
        )
    if not pl_module.automatic_optimization:
        raise ConfigurationError(
            f"{stuck}, but under manual optimization the module steps its optimizers itself; lower the "
            "loader's batch size (or split the batch in `training_step`)."
        )
    return parts


class ReBatched:
    """What :func:`rebatch` changed, so :meth:`remove` can put it back (idempotent)."""

    def __init__(self, parts: int) -> None:
        self.parts = parts
        self.weights: deque[float] = deque()
        self.callback = LossWeights(self.weights)
        self._undo: list[Any] = []

    def transform(self, trainer: pl.Trainer, loaders: Any) -> ReBatchedLoader:
        """The user's train loader(s), as the fit loop asked for them → the re-batched loader."""
        if isinstance(loaders, (Mapping, list, tuple)) or type(loaders).__name__ == "CombinedLoader":
            raise ConfigurationError(
                "ResourceGuard re-batches one train dataloader, and this run has several; give each the "
                "plan's micro-batch size yourself, or return one DataLoader."
            )
        loader = process_train_loader(trainer, loaders)  # DistributedSampler, worker seeding: as Lightning
        sampler = getattr(loader, "batch_sampler", None) if isinstance(loader, DataLoader) else None
        if sampler is not None and not isinstance(loader.dataset, IterableDataset):
            return ReBatchedLoader(
                _remade(loader, SplitBatchSampler(sampler, self.parts)), self.parts, self.weights, True
            )
        return ReBatchedLoader(loader, self.parts, self.weights, False)

    def remove(self, trainer: pl.Trainer) -> None:
        while self._undo:
            self._undo.pop()()
        callbacks = _callbacks(trainer)
        if self.callback in callbacks:
            callbacks.remove(self.callback)


def rebatch(trainer: pl.Trainer, pl_module: Any, current: int | None, decisions: Split) -> ReBatched:
    """Run each train loader batch of ``current`` rows as micro-batches of the plan; counts the Trainer
    takes in loader batches (``limit_train_batches``, ``val_check_interval`` as ints) are scaled to
    micro-batches. Checks once, before step 0, that the re-batched loader can be made."""
    done = ReBatched(parts_for(pl_module, current, decisions))
    try:
        done._undo.append(transform_train_source(trainer, lambda loaders: done.transform(trainer, loaders)))
        for name in ("limit_train_batches", "val_check_interval"):
            value = getattr(trainer, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(trainer, name, value * done.parts)
                done._undo.append(lambda name=name, value=value: setattr(trainer, name, value))
        _callbacks(trainer).append(done.callback)
        with isolate_rng(include_cuda=False):  # loaders seed from the CPU generator; no CUDA context
            drop_train_dataloader(trainer)
            trainer.fit_loop.setup_data()  # a refusal (several loaders) now, not at step 0
            drop_train_dataloader(trainer)
    except BaseException:
        done.remove(trainer)
        raise
    return done


def _callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The Trainer's callback list, which the Trainer reads at every hook (set in its constructor)."""
    return trainer.callbacks  # type: ignore[attr-defined,no-any-return]


def _remade(loader: DataLoader, batch_sampler: Sampler[list[int]]) -> DataLoader:
    """``loader`` with another batch sampler: the same dataset, collate function, workers and seeding."""
    options: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        options["in_order"] = loader.in_order
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **options)
