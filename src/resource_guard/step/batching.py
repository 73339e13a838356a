"""Batch arithmetic: slicing a batch into micro-batches, resizing a sample batch, divisors.

A batch is any nesting of tensors in mappings, lists, tuples, namedtuples and dataclasses (as in
:func:`resource_guard.step.training.map_tensors`); every tensor with at least one dimension is cut along
dim 0, other leaves (ints, strings, 0-d tensors) are kept as they are.

Example:
    >>> import torch
    >>> batch = {"x": torch.arange(6).reshape(6, 1), "y": torch.arange(6)}
    >>> slice_batch(batch, 2, 4)["y"].tolist()
    [2, 3]
    >>> resize_batch(batch, 8)["y"].tolist()
    [0, 1, 2, 3, 4, 5, 0, 1]
    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
"""

from __future__ import annotations

import math
from typing import Any

import torch

from resource_guard.errors import ConfigurationError
from resource_guard.step.training import batch_size_of, iter_tensors, map_tensors

__all__ = ["slice_batch", "split_batch", "resize_batch", "divisors", "SHADOW_MAX_NUMEL"]

# Batch-derived values are computed for real up to this many elements per tensor (the estimator's
# shadow values: attention masks, ignored labels); larger tensors of a resized batch are made on the
# ``meta`` device.
SHADOW_MAX_NUMEL = 1 << 22


def _leading_size(batch: Any, who: str) -> int:
    size = batch_size_of(batch)
    if size is None:
        sizes = sorted({t.shape[0] for t in iter_tensors(batch) if t.dim() > 0})
        raise ConfigurationError(
            f"`{who}`: cannot tell the batch size: the batch's tensors have leading dimensions {sizes} "
            "(every tensor with a dimension must share its first one)."
        )
    return size


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` (dim 0) of every tensor in ``batch``; views, no copy.

    Raises:
        ConfigurationError: the batch has no common leading dimension, or the range is empty or outside it.
    """
    size = _leading_size(batch, f"slice_batch(batch, {start!r}, {stop!r})")
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= size):
        raise ConfigurationError(
            f"`slice_batch(batch, {start!r}, {stop!r})`: need 0 <= start < stop <= {size} (the batch size)."
        )
    return map_tensors(lambda t: t[start:stop] if t.dim() > 0 else t, batch)


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Consecutive micro-batches of ``micro_batch_size`` rows (the last one may be smaller)."""
    size = _leading_size(batch, "split_batch")
    if not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
        raise ConfigurationError(f"`split_batch(micro_batch_size={micro_batch_size!r})` must be an int >= 1.")
    return [slice_batch(batch, i, min(i + micro_batch_size, size)) for i in range(0, size, micro_batch_size)]


def resize_batch(batch: Any, size: int, *, meta_above: int = SHADOW_MAX_NUMEL) -> Any:
    """A batch of ``size`` rows made from ``batch``: rows are sliced, or repeated cyclically.

    Made for the estimator, which needs shapes and, for small batch-derived tensors, values. A tensor
    whose resized form has more than ``meta_above`` elements is made on the ``meta`` device instead
    (same shape and dtype, no memory), so a large batch costs nothing real.

    Raises:
        ConfigurationError: ``size`` is not a positive int, or the batch has no common leading dimension.
    """
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise ConfigurationError(f"`resize_batch(size={size!r})` must be an int >= 1.")
    have = _leading_size(batch, "resize_batch")

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        shape = (size, *t.shape[1:])
        if t.is_meta or t.numel() // max(have, 1) * size > meta_above:
            return torch.empty(shape, dtype=t.dtype, device="meta")
        if size <= have:
            return t[:size]
        index = torch.arange(size, device=t.device) % have
        return t.index_select(0, index)

    return map_tensors(resize, batch)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order."""
    if not (isinstance(n, int) and n >= 1):
        raise ConfigurationError(f"`divisors({n!r})` needs an int >= 1.")
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
