"""Batch shapes: signatures, the sequence axis, resizing along it, and the run's longest sequence.

A batch's *signature* is the ``(shape, dtype)`` of each of its tensors, in the order
:func:`~resource_guard.step.training.iter_tensors` visits them: two batches with the same signature
take the same memory in a training step. The *sequence axis* of a batch is every dimension past the
first whose size is the sequence length (dim 1 of its first tensor with two dimensions or more):
``input_ids``, ``labels`` and ``attention_mask`` of a causal LM together.

The longest sequence a run can produce is found without a pass over the data
(:func:`worst_case_length`): a bucketing sampler's boundaries, or a dataset's declared length
attribute or its length column (read as one array, and only up to :data:`MAX_LENGTHS_READ` rows).

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.zeros(8, 16, dtype=torch.long), "labels": torch.zeros(8, 16)}
    >>> sorted(sequence_positions(batch))
    [(0, 1), (1, 1)]
    >>> signature_of(resize_along(batch, sequence_positions(batch), 513))[0][0]
    torch.Size([8, 513])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from resource_guard.errors import ConfigurationError
from resource_guard.step.batching import SHADOW_MAX_NUMEL
from resource_guard.step.training import iter_tensors, map_tensors

__all__ = [
    "LENGTH_ATTRIBUTES",
    "LENGTH_COLUMNS",
    "MAX_LENGTHS_READ",
    "Position",
    "Signature",
    "describe_signature",
    "resize_along",
    "sequence_positions",
    "signature_of",
    "worst_case_length",
]

Signature = tuple[tuple[torch.Size, torch.dtype], ...]
Position = tuple[int, int]  # (index of the tensor in iter_tensors order, dimension)

LENGTH_ATTRIBUTES = ("max_seq_len", "max_seq_length", "max_length", "block_size", "seq_len")
LENGTH_COLUMNS = ("length", "lengths", "input_length", "num_tokens")
SAMPLER_BOUNDARIES = ("bucket_boundaries", "boundaries")
MAX_LENGTHS_READ = 10_000_000


def signature_of(batch: Any) -> Signature:
    """``(shape, dtype)`` of every tensor of ``batch``: the key of the shape cache.

    Plain tensors, tuples/lists of tensors and dicts of tensors take a fast path (a few µs); other
    nestings go through :func:`~resource_guard.step.training.iter_tensors`.
    """
    kind = type(batch)
    if kind is torch.Tensor:
        return ((batch.shape, batch.dtype),)
    if kind is dict or kind is tuple or kind is list:  # the hot path: one loop, no generators
        found = []
        for t in batch.values() if kind is dict else batch:
            if type(t) is not torch.Tensor:
                break
            found.append((t.shape, t.dtype))
        else:
            return tuple(found)
    return tuple((t.shape, t.dtype) for t in iter_tensors(batch))


def describe_signature(signature: Signature) -> str:
    """``"8×513 int64, 8×513 int64"``: the shapes of a signature, for messages and reports."""
    return ", ".join(
        ("×".join(str(n) for n in shape) or "scalar") + f" {str(dtype).removeprefix('torch.')}"
        for shape, dtype in signature
    )


def sequence_positions(batch: Any) -> frozenset[Position]:
    """The dimensions past the first whose size is the batch's sequence length (see the module docstring).

    Empty when no tensor has two dimensions.
    """
    tensors = iter_tensors(batch)
    first = next((t for t in tensors if t.dim() >= 2 and not t.is_floating_point()), None)
    first = first if first is not None else next((t for t in tensors if t.dim() >= 2), None)
    if first is None:
        return frozenset()
    length = first.shape[1]
    return frozenset((i, d) for i, t in enumerate(tensors) for d in range(1, t.dim()) if t.shape[d] == length)


def resize_along(
    batch: Any, positions: Iterable[Position], size: int, *, meta_above: int = SHADOW_MAX_NUMEL
) -> Any:
    """``batch`` with the dimensions at ``positions`` made ``size`` long: cut, or repeated cyclically.

    Values stay valid (token ids, masks of ones and zeros, ignored labels repeat as they were); a tensor
    of more than ``meta_above`` elements is made on the ``meta`` device (shape and dtype only), as
    :func:`~resource_guard.step.batching.resize_batch` does.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigurationError(f"`resize_along(size={size!r})` must be an int >= 1.")
    dims: dict[int, list[int]] = {}
    for index, dim in positions:
        dims.setdefault(index, []).append(dim)
    counter = iter(range(1 << 62))

    def resize(t: torch.Tensor) -> torch.Tensor:
        index = next(counter)
        mine = dims.get(index)
        if not mine:
            return t
        shape = list(t.shape)
        for d in mine:
            shape[d] = size
        numel = 1
        for n in shape:
            numel *= n
        if t.is_meta or numel > meta_above:
            return torch.empty(shape, dtype=t.dtype, device="meta")
        for d in mine:
            have = t.shape[d]
            if size <= have:
                t = t.narrow(d, 0, size)
            else:
                t = t.index_select(d, torch.arange(size, device=t.device) % have)
        return t

    return map_tensors(resize, batch)


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value > 0:
        return value
    return None


def _max_of(values: Any) -> int | None:
    """The largest of a sequence of lengths, read as one array (no per-row Python work past a list)."""
    try:
        count = len(values)
    except TypeError:
        return None
    if not count or count > MAX_LENGTHS_READ:
        return None
    try:
        array = values if isinstance(values, torch.Tensor) else torch.as_tensor(values)
        top = array.max().item()
    except (TypeError, ValueError, RuntimeError):
        return None
    return _as_int(int(top)) if isinstance(top, (int, float)) else None


def worst_case_length(loader: Any) -> tuple[int, str] | None:
    """The longest sequence ``loader`` can produce, and where that was read; ``None`` when not knowable.

    Looked at, in order: the batch sampler's (or sampler's) bucket boundaries; the dataset's length
    attribute (:data:`LENGTH_ATTRIBUTES`); the dataset's length column (:data:`LENGTH_COLUMNS`: a
    ``datasets.Dataset`` column, or an attribute holding one length per sample), when it has at most
    :data:`MAX_LENGTHS_READ` rows. Never iterates the loader.

    Example:
        >>> class Data(list):
        ...     max_seq_len = 512
        >>> from torch.utils.data import DataLoader
        >>> worst_case_length(DataLoader(Data([0, 1]), batch_size=2))
        (512, 'dataset.max_seq_len')
    """
    for owner_name in ("batch_sampler", "sampler"):
        owner = getattr(loader, owner_name, None)
        for name in SAMPLER_BOUNDARIES:
            bounds = getattr(owner, name, None)
            if bounds is not None:
                top = _max_of(list(bounds)) if not isinstance(bounds, torch.Tensor) else _max_of(bounds)
                if top is not None:
                    return top, f"{owner_name}.{name}"
    dataset = getattr(loader, "dataset", loader)
    for name in LENGTH_ATTRIBUTES:
        value = _as_int(getattr(dataset, name, None))
        if value is not None:
            return value, f"dataset.{name}"
    columns = getattr(dataset, "column_names", None)
    for name in LENGTH_COLUMNS:
        if isinstance(columns, (list, tuple)) and name in columns:
            top = _max_of(dataset[name])  # a datasets column: one Arrow array
            if top is not None:
                return top, f"dataset[{name!r}]"
        values = getattr(dataset, name, None)
        if values is not None and not callable(values):
            top = _max_of(values)
            if top is not None:
                return top, f"dataset.{name}"
    return None
