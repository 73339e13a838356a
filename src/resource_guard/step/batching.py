"""Batch arithmetic: slicing a batch into micro-batches, resizing a sample batch, divisors.

A batch is any nesting of tensors in mappings (a Hugging Face ``BatchEncoding`` included), lists,
tuples, namedtuples and dataclasses (as in :func:`resource_guard.step.training.map_tensors`); every
tensor with at least one dimension is cut along dim 0; a list or tuple of non-tensor values as long as
the batch (one string per row, say) is cut too; other leaves (ints, strings, 0-d tensors) are kept as
they are, in every piece.

Example:
    >>> import torch
    >>> batch = {"x": torch.arange(6).reshape(6, 1), "y": torch.arange(6)}
    >>> slice_batch(batch, 2, 4)["y"].tolist()
    [2, 3]
    >>> [piece["y"].tolist() for piece in split_batch(batch, parts=4)]
    [[0, 1], [2, 3], [4], [5]]
    >>> resize_batch(batch, 8)["y"].tolist()
    [0, 1, 2, 3, 4, 5, 0, 1]
    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from resource_guard.errors import ConfigurationError
from resource_guard.step.training import batch_size_of, map_tensors

__all__ = [
    "slice_batch",
    "split_batch",
    "even_bounds",
    "resize_batch",
    "divisors",
    "rows_error",
    "SHADOW_MAX_NUMEL",
]

# Batch-derived values are computed for real up to this many elements per tensor (the estimator's
# shadow values: attention masks, ignored labels); larger tensors of a resized batch are made on the
# ``meta`` device.
SHADOW_MAX_NUMEL = 1 << 22


def _leading_size(batch: Any, who: str) -> int:
    size = batch_size_of(batch)
    if size is None:
        raise rows_error(batch, who)
    return size


def rows_error(batch: Any, who: str, model: Any = None) -> ConfigurationError:
    """Why ``batch`` has no rows to cut (no common leading dimension), the tensors that differ named.

    A 1-D integer tensor of another length is a flat index tensor: ``nn.EmbeddingBag``'s ``(indices,
    offsets)`` form, as DLRM batches give it, when the ``model`` has an EmbeddingBag (or is not known);
    else most likely the flat targets of a sequence-first batch. Its length counts indices, not samples;
    the message says what to do for the one the model can take.

    Example:
        >>> batch = (torch.zeros(4, 3), torch.zeros(32, dtype=torch.long), torch.arange(0, 32, 8))
        >>> "batch[1] has 32" in str(rows_error(batch, "split_batch"))
        True
    """
    rows = _rows_by_leaf(batch)
    if not rows:
        return ConfigurationError(
            f"`{who}`: the batch has no tensor with a leading dimension to cut along (a 0-d tensor or "
            "no tensor at all); give a batch whose tensors share dim 0 (the rows)."
        )
    # the rows are what most tensors share, a flat index or target tensor's length counting only on a tie
    # loss (a sequence-first LM's (tokens, flat targets) is one of each)
    sizes = [n for _, n in rows]
    shaped = [n for path, n in rows if not _is_flat_index(batch, path)] or sizes
    common = max(set(sizes), key=lambda n: (sizes.count(n), shaped.count(n)))
    odd = [(path, n) for path, n in rows if n != common]
    message = (
        f"`{who}`: cannot cut the batch into rows, its tensors' leading dimensions differ: most have "
        f"{common} rows, but {', '.join(f'{path} has {n}' for path, n in odd)} (every tensor with a "
        "dimension must share its first one)."
    )
    flat = [path for path, _ in odd if _is_flat_index(batch, path)]
    bags = model is None or any(type(m).__name__ == "EmbeddingBag" for m in model.modules())
    if flat and not bags:
        message += (
            f" {', '.join(flat)} looks like flat targets (`(seq * batch,)`) of a sequence-first batch, whose "
            "batch is dim 1: leave the loop unchanged under `with guard(model, optimizer, batch_dim=1):`, "
            "or give batch-first tensors."
        )
    elif flat:
        message += (
            f" {', '.join(flat)} looks like a flat index tensor (`nn.EmbeddingBag(indices, offsets)`): its "
            "length counts indices, not samples, so it cannot be cut by rows. Give the bags as a 2-D "
            "`(batch, bag_length)` tensor (padded with the table's `padding_idx` where bags differ in "
            "length): EmbeddingBag takes it without offsets, or a `loss_fn=lambda model, batch: ...` "
            "flattens it into `(indices, offsets)` for the model."
        )
    return ConfigurationError(message)


def _is_flat_index(batch: Any, path: str) -> bool:
    """Whether the leaf at ``path`` (as :func:`_rows_by_leaf` writes it) is a 1-D integer tensor."""
    found = [t for p, t in _leaves(batch) if p == path]
    return (
        bool(found)
        and found[0].dim() == 1
        and not found[0].is_floating_point()
        and found[0].dtype != torch.bool
    )


def _leaves(obj: Any, path: str = "batch") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    found: list[tuple[str, torch.Tensor]] = []
    for key, value in _children(obj):
        found += _leaves(value, f"{path}{key}")
    return found


def _rows_by_leaf(obj: Any, path: str = "batch") -> list[tuple[str, int]]:
    """``(path, rows)`` of every tensor with a dimension in ``obj``, the path written as Python."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj.shape[0])] if obj.dim() > 0 else []
    found: list[tuple[str, int]] = []
    for key, value in _children(obj):
        found += _rows_by_leaf(value, f"{path}{key}")
    return found


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        yield from ((f"[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        yield from ((f"[{i}]", v) for i, v in enumerate(obj))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        yield from ((f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj))


def _is_row_list(obj: Any, size: int) -> bool:
    """A plain list/tuple of per-row values: as long as the batch and holding no tensor."""
    return (
        isinstance(obj, (list, tuple))
        and not hasattr(obj, "_fields")
        and len(obj) == size
        and not any(isinstance(v, torch.Tensor) or _rows_by_leaf(v) for v in obj)
    )


def _cut(obj: Any, start: int, stop: int, size: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[start:stop] if obj.dim() > 0 else obj
    if _is_row_list(obj, size):
        return obj[start:stop]
    if isinstance(obj, Mapping):
        items = {k: _cut(v, start, stop, size) for k, v in obj.items()}
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cut(v, start, stop, size) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cut(v, start, stop, size) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _cut(getattr(obj, f.name), start, stop, size) for f in dataclasses.fields(obj) if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` (dim 0) of every tensor in ``batch`` (views, no copy), and of every per-row
    list; other leaves are kept whole.

    Raises:
        ConfigurationError: the batch has no common leading dimension (the message names the tensors that
            differ), or the range is empty or outside it.
    """
    size = _leading_size(batch, f"slice_batch(batch, {start!r}, {stop!r})")
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= size):
        raise ConfigurationError(
            f"`slice_batch(batch, {start!r}, {stop!r})`: need 0 <= start < stop <= {size} (the batch size)."
        )
    return _cut(batch, start, stop, size)


def even_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``min(parts, size)`` consecutive ``(start, stop)`` ranges covering ``range(size)``, their lengths
    differing by at most one (the longer ones first).

    Example:
        >>> even_bounds(10, 4)
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    count = min(parts, size)
    if count < 1:
        return []
    base, extra = divmod(size, count)
    bounds, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_batch(batch: Any, micro_batch_size: int | None = None, *, parts: int | None = None) -> list[Any]:
    """The batch as consecutive micro-batches, in order: of ``micro_batch_size`` rows (the last one may be
    smaller), or ``parts`` pieces as even as possible (fewer when the batch has fewer rows).

    Raises:
        ConfigurationError: not exactly one of the two sizes given, or not a positive int; the batch has
            no common leading dimension (the message names the tensors that differ).
    """

    def positive(n: Any) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 1

    if (micro_batch_size is None) == (parts is None):
        raise ConfigurationError(
            f"`split_batch(micro_batch_size={micro_batch_size!r}, parts={parts!r})`: give exactly one."
        )
    if micro_batch_size is not None and not positive(micro_batch_size):
        raise ConfigurationError(f"`split_batch(micro_batch_size={micro_batch_size!r})` must be an int >= 1.")
    if parts is not None and not positive(parts):
        raise ConfigurationError(f"`split_batch(parts={parts!r})` must be an int >= 1.")
    size = _leading_size(batch, "split_batch")
    if parts is not None:
        return [_cut(batch, lo, hi, size) for lo, hi in even_bounds(size, parts)]
    assert micro_batch_size is not None
    step = micro_batch_size
    return [_cut(batch, i, min(i + step, size), size) for i in range(0, size, step)]


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
