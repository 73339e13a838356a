"""Running a Lightning evaluation loader whose batches do not fit as micro-batches that do.

When the evaluation pre-flight (:mod:`~resource_guard.frontdoors.lightning.eval`) finds that a
validation, test or predict loader's batch does not fit, but a smaller one does (``m`` rows, the
largest that fits), the loader is re-batched into micro-batches of at most ``m`` rows instead of
stopping: each loader batch of ``n`` rows runs as ``ceil(n / m)`` near-equal consecutive pieces, in
order, with the mechanisms of the train side (:mod:`~resource_guard.frontdoors.lightning.rebatch`): a
map-style ``DataLoader`` keeps its sampler, dataset, collate function and workers and its batch
sampler's index lists are cut (:class:`EvalSplitSampler`), so collate and padding run per piece; any
other iterable has each ready batch cut along its leading dimension
(:func:`~resource_guard.step.batching.split_batch`).

Results are those of the unsplit run:

- ``self.log(..., on_epoch=True)``: Lightning weights a step's value by the batch size it infers from
  the batch the loop yielded, here the micro-batch, so an epoch mean of per-row means over the pieces
  equals the one over the loader batches (each row counts once);
- ``trainer.predict``: the pieces' outputs are concatenated back along dim 0 (tensors, and tuples,
  lists and dicts of them), one prediction per loader batch (:func:`regroup`).

Per-step values (``on_step=True``), ``batch_idx`` and a ``BasePredictionWriter`` see the
micro-batches (one with ``write_interval="epoch"`` listed after ``ResourceGuard`` in ``callbacks`` sees
the joined predictions: the callback joins them in ``on_predict_epoch_end``).

The loop's loaders are replaced after it set them up and before it iterates them, through the loops'
private attributes, each read in one function of :mod:`~resource_guard.frontdoors.lightning.internals`
(the loop's combined loader, its batch counts, its iterator, the predictions).

Example:
    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> batches = BatchSampler(SequentialSampler(range(10)), batch_size=4, drop_last=False)
    >>> list(EvalSplitSampler(batches, micro_batch_size=3))
    [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from resource_guard.errors import ConfigurationError, warn_at_user
from resource_guard.frontdoors.lightning.internals import (
    eval_batch_counts,
    eval_combined_loader,
    predict_outputs,
    restart_eval_iterator,
)
from resource_guard.frontdoors.lightning.rebatch import PiecesOf, _remade
from resource_guard.step.batching import even_bounds, split_batch
from resource_guard.step.training import batch_size_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from resource_guard.frontdoors.eval_preflight import EvalCheck

__all__ = [
    "EvalSplitLoader",
    "EvalSplitSampler",
    "apply_splits",
    "regroup",
    "regroup_predictions",
    "split_sizes",
]


def _pieces(rows: int, micro: int) -> list[tuple[int, int]]:
    return even_bounds(rows, max(1, math.ceil(rows / micro)))


class EvalSplitSampler(PiecesOf):
    """Each index list of ``batch_sampler`` as consecutive, near-equal pieces of at most
    ``micro_batch_size``; ``counts`` gets the number of pieces of each batch, in order."""

    def __init__(self, batch_sampler: Iterable[Sequence[int]], micro_batch_size: int) -> None:
        if not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
            raise ConfigurationError(
                f"`EvalSplitSampler(micro_batch_size={micro_batch_size!r})` must be an int >= 1."
            )
        self.batch_sampler, self.micro_batch_size = batch_sampler, micro_batch_size
        self.counts: list[int] = []

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.batch_sampler:
            indices = list(indices)
            bounds = _pieces(len(indices), self.micro_batch_size)
            self.counts.append(len(bounds))
            for lo, hi in bounds:
                yield indices[lo:hi]

    def __len__(self) -> int:
        inner, micro = self.batch_sampler, self.micro_batch_size
        if isinstance(inner, BatchSampler) and hasattr(inner.sampler, "__len__"):  # exact
            full, rest = divmod(len(inner.sampler), inner.batch_size)  # type: ignore[arg-type]
            last = math.ceil(rest / micro) if rest and not inner.drop_last else 0
            return full * math.ceil(inner.batch_size / micro) + last
        with isolate_rng(include_cuda=False):  # count the pieces of each index list
            return sum(len(_pieces(len(list(b)), micro)) for b in inner)


class EvalSplitLoader:
    """The evaluation loader Lightning iterates: the user's loader's batches as micro-batches, in order.

    ``counts`` holds the number of pieces of each loader batch yielded so far in this pass.
    Its length is exact for a map-style loader with a ``BatchSampler``; otherwise it has none (the
    loop then runs until the loader ends).
    """

    def __init__(self, loader: Iterable[Any], micro_batch_size: int) -> None:
        self.original, self.micro_batch_size = loader, micro_batch_size
        sampler = getattr(loader, "batch_sampler", None) if isinstance(loader, DataLoader) else None
        self._sampler: EvalSplitSampler | None = None
        self.loader: Iterable[Any] = loader
        if sampler is not None and not isinstance(loader.dataset, IterableDataset):  # type: ignore[attr-defined]
            self._sampler = EvalSplitSampler(sampler, micro_batch_size)
            self.loader = _remade(loader, self._sampler)  # type: ignore[arg-type]
        self.counts: list[int] = self._sampler.counts if self._sampler is not None else []

    @property
    def sampler(self) -> Any:
        return getattr(self.original, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def dataset(self) -> Any:
        return getattr(self.original, "dataset", None)

    def __len__(self) -> int:
        if self._sampler is None:
            raise TypeError("the number of micro-batches is known only once the loader has run")
        return len(self._sampler)

    def __iter__(self) -> Iterator[Any]:
        self.counts.clear()
        if self._sampler is not None:
            yield from self.loader
            return
        for batch in self.loader:
            rows = batch_size_of(batch)
            if rows is None or rows <= self.micro_batch_size:
                self.counts.append(1)
                yield batch
                continue
            try:
                pieces = split_batch(batch, parts=len(_pieces(rows, self.micro_batch_size)))
            except ConfigurationError as error:
                raise ConfigurationError(
                    f"ResourceGuard cannot run the evaluation loader's batches as micro-batches of "
                    f"{self.micro_batch_size}: {error} Return batches whose tensors share their first "
                    f"dimension, or give the DataLoader `batch_size={self.micro_batch_size}` or less."
                ) from None
            self.counts.append(len(pieces))
            yield from pieces


def _loop(trainer: pl.Trainer, stage: str) -> Any:
    if stage == "predict":
        return trainer.predict_loop
    if stage == "test":
        return trainer.test_loop
    return trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == "fit" else trainer.validate_loop


def split_sizes(splits: Mapping[int, EvalCheck]) -> tuple[dict[int, tuple[int, int]], list[str]]:
    """For the pre-flight's checks of the loaders to split (by index): ``(micro-batch size, the
    loader's batch size)`` by index, and a line for each (the plan's reasons, the report)."""
    sizes = {i: (int(c.largest_fitting_batch_size or 1), int(c.batch_size or 1)) for i, c in splits.items()}
    lines = [
        f"the {c.loop} loader's batches of {c.batch_size} rows do not fit: each runs as micro-batches of "
        f"at most {sizes[i][0]} rows (the largest {c.loop} batch size that fits); epoch metrics and "
        "predictions are those of the whole batches"
        for i, c in splits.items()
    ]
    return sizes, lines


def apply_splits(
    trainer: pl.Trainer, stage: str, splits: Mapping[int, tuple[int, int]], *, reset: bool
) -> list[int]:
    """Replace the loaders of ``stage``'s loop (``"validate"``, ``"test"``, ``"predict"``) named by
    index in ``splits`` (``(micro-batch size, the loader's batch size)``) with their
    :class:`EvalSplitLoader` (once; a loader already split is left), and the loop's batch counts to
    match (an integer ``limit_*_batches`` counts loader batches of the loader's batch size); ``reset``:
    rebuild the loop's iterator (the loop already built it). Returns the indices replaced."""
    loop = _loop(trainer, stage)
    combined = eval_combined_loader(loop)
    if combined is None or not splits:
        return []
    loaders = list(combined.flattened)
    done = []
    for i, (micro, _) in splits.items():
        if i < len(loaders) and not isinstance(loaders[i], EvalSplitLoader):
            loaders[i] = EvalSplitLoader(loaders[i], micro)
            done.append(i)
    if not done:
        return []
    combined.flattened = loaders
    counts = eval_batch_counts(loop, stage)
    limit = getattr(trainer, f"limit_{'val' if stage == 'validate' else stage}_batches")
    for i in done:
        new = loaders[i]
        try:
            length: float = len(new)
        except TypeError:
            length = float("inf")
        if isinstance(limit, int) and not isinstance(limit, bool):  # loader batches → at most micro-batches
            length = min(length, limit * math.ceil(splits[i][1] / new.micro_batch_size))
        elif isinstance(limit, float) and length != float("inf"):
            length = int(length * limit)
        counts[i] = length
    if reset:
        restart_eval_iterator(loop)
    return done


def regroup(pieces: Sequence[Any]) -> Any:
    """The outputs of a batch's micro-batches as one: tensors concatenated along dim 0, tuples, lists
    and dicts of them element by element, lists of other values chained; anything else is left as
    the list of pieces (with a warning).

    Example:
        >>> regroup([torch.zeros(2, 3), torch.ones(1, 3)]).shape
        torch.Size([3, 3])
    """
    first = pieces[0]
    if len(pieces) == 1:
        return first
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return torch.cat(list(pieces), dim=0)
    if isinstance(first, Mapping):
        return type(first)({k: regroup([p[k] for p in pieces]) for k in first})  # type: ignore[call-arg]
    if isinstance(first, tuple):
        items = [regroup([p[j] for p in pieces]) for j in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if isinstance(first, list):
        if first and all(isinstance(x, (torch.Tensor, Mapping, tuple)) for x in first):
            return [regroup([p[j] for p in pieces]) for j in range(len(first))]
        return [x for p in pieces for x in p]
    if first is None:
        return None
    warn_at_user(
        f"ResourceGuard: a prediction of type {type(first).__name__} cannot be joined; the batch's "
        f"{len(pieces)} micro-batch predictions are returned as a list."
    )
    return list(pieces)


def regroup_predictions(trainer: pl.Trainer) -> None:
    """The predict loop's predictions of each split loader, one per loader batch (before it returns
    them)."""
    loop = trainer.predict_loop
    combined, predictions = eval_combined_loader(loop), predict_outputs(loop)
    if combined is None or not predictions:
        return
    for i, loader in enumerate(combined.flattened):
        if not isinstance(loader, EvalSplitLoader) or i >= len(predictions):
            continue
        made, joined, at = predictions[i], [], 0
        for count in loader.counts:
            if at >= len(made):
                break
            joined.append(regroup(made[at : at + count]))
            at += count
        predictions[i] = joined
