"""The batch dimension of a loop's inputs: dim 0, or dim 1 of a sequence-first loop.

pytorch/examples' ``word_language_model`` feeds ``(seq, batch)`` token ids and an ``(layers, batch,
hidden)`` state to a ``batch_first=False`` LSTM, with flat ``(seq * batch,)`` targets. Its batch is dim
1, and nothing in the batch says so: the model does. :func:`infer_batch_dim` reads it from the model's
first recurrent or Transformer layer (``nn.LSTM``/``GRU``/``RNN``, ``nn.Transformer*``, in the order the
model registers them, which is the order most models call them); ``guard(..., batch_dim=1)`` declares it.

The estimate and the planner cut batches along dim 0. A batch whose batch is dim 1 is handed to them as
:func:`to_batch_first` views (tensors of two or more dimensions: ``movedim(1, 0)``; a flat 1-D tensor of
``k * rows`` elements, as flat targets are: ``(rows, k)``), with the model wrapped in
:class:`BatchFirstView`, which moves them back before calling it: the model sees the layout the loop
gives it.

Example:
    >>> lstm = torch.nn.LSTM(8, 8)  # batch_first=False
    >>> infer_batch_dim(lstm)
    (1, 'LSTM (batch_first=False) at the top level: the batch is dim 1 of the inputs')
    >>> batch = (torch.zeros(35, 4, dtype=torch.long), torch.zeros(35 * 4, dtype=torch.long))
    >>> rows_along(batch, 1)
    4
    >>> [tuple(t.shape) for t in to_batch_first(batch, 1)]
    [(4, 35), (4, 35)]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.step.training import batch_size_of, iter_tensors, map_tensors

__all__ = [
    "BatchFirstView",
    "ambiguous_batch_error",
    "check_batch_dim",
    "infer_batch_dim",
    "rows_along",
    "to_batch_first",
]

_SEQUENCE_LAYERS = (
    nn.RNNBase,
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


def check_batch_dim(batch_dim: Any, call: str = "guard") -> int | None:
    """``batch_dim`` as given to ``call``, refused unless ``None`` (inferred), 0 or 1."""
    if batch_dim is None or (type(batch_dim) is int and batch_dim in (0, 1)):
        return batch_dim
    raise ConfigurationError(
        f"`{call}(batch_dim={batch_dim!r})` must be None (inferred from the model), 0 (batch-first "
        "inputs) or 1 (sequence-first inputs, `(seq, batch, ...)`)."
    )


def _batch_first_of(module: nn.Module) -> bool | None:
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)):
        layers = getattr(module, "layers", None)
        return _batch_first_of(layers[0]) if layers else None
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return bool(module.self_attn.batch_first)
    value = getattr(module, "batch_first", None)
    return None if value is None else bool(value)


def infer_batch_dim(model: nn.Module) -> tuple[int, str | None]:
    """The batch dimension the model says its inputs have, and why (``None``: nothing says).

    The model itself when it is a recurrent or Transformer layer, else its first registered one; a
    ``batch_first=False`` one makes the batch dim 1, anything else dim 0.
    """
    for name, module in model.named_modules():
        if isinstance(module, _SEQUENCE_LAYERS):
            first = _batch_first_of(module)
            if first is None:
                continue
            where = "at the top level" if not name else f"(`{name}`, the model's first sequence layer)"
            reason = (
                f"{type(module).__name__} (batch_first={first}) {where}: the batch is dim "
                f"{0 if first else 1} of the inputs"
            )
            return (0 if first else 1), reason
    return 0, None


def rows_along(batch: Any, dim: int) -> int | None:
    """The batch size of ``batch`` along ``dim``, or ``None`` when its tensors disagree.

    Dim 1: the size shared by dim 1 of every tensor of two or more dimensions; 1-D tensors must be flat
    multiples of it (flat targets); 0-d tensors are not counted.
    """
    if dim == 0:
        return batch_size_of(batch)
    tensors = list(iter_tensors(batch))
    sizes = {t.shape[dim] for t in tensors if t.dim() > dim}
    if len(sizes) != 1:
        return None
    rows = sizes.pop()
    if rows == 0 or any(t.dim() == 1 and t.shape[0] % rows for t in tensors):
        return None
    return int(rows)


def to_batch_first(batch: Any, dim: int, rows: int | None = None) -> Any:
    """``batch`` as views whose dim 0 is the batch (see the module docstring); ``batch`` itself for dim 0."""
    if dim == 0:
        return batch
    rows = rows if rows is not None else rows_along(batch, dim)
    if rows is None:
        raise ambiguous_batch_error(batch, dim, None)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > dim:
            return t.movedim(dim, 0)
        if t.dim() == 1:
            return t.view(-1, rows).t()  # flat (seq * batch): seq-major, as the loop flattens it
        return t

    return map_tensors(move, batch)


def _from_batch_first(batch: Any, dim: int, flat: list[bool]) -> Any:
    leaves = iter(flat)

    def back(t: torch.Tensor) -> torch.Tensor:
        was_flat = next(leaves, False)
        if was_flat:
            return t.t().reshape(-1)
        return t.movedim(0, dim) if t.dim() > dim else t

    return map_tensors(back, batch)


class BatchFirstView(nn.Module):
    """``model`` called with batch-first inputs: moves them back to the loop's layout (batch at ``dim``)
    before calling it. Owns ``model`` as its one submodule, so its parameters are the model's.

    Args:
        model: the loop's model.
        dim: the batch dimension of the loop's inputs.
        batch: the loop's inputs (its layout tells which 1-D tensors are flat).
    """

    def __init__(self, model: nn.Module, dim: int, batch: Any) -> None:
        super().__init__()
        self.model, self.dim = model, dim
        self._flat = [t.dim() == 1 for t in iter_tensors(batch)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        (args, kwargs) = _from_batch_first((args, kwargs), self.dim, self._flat)
        return self.model(*args, **kwargs)


def ambiguous_batch_error(
    batch: Any, dim: int | None, reason: str | None, model: nn.Module | None = None
) -> Exception:
    """Why the batch size of the loop's first forward cannot be told, and the remedy (``batch_dim=``)."""
    shapes = ", ".join(str(tuple(t.shape)) for t in iter_tensors(batch)) or "no tensors"
    along = "dim 0" if not dim else f"dim {dim}"
    why = f" ({reason})" if reason else ""
    message = (
        f"cannot tell the batch size of the loop's first forward: its tensors ({shapes}) do not share "
        f"{along}{why}. Declare where the batch is: `guard(model, optimizer, batch_dim=0)` for batch-first "
        "inputs, `batch_dim=1` for sequence-first `(seq, batch, ...)` inputs (flat `(seq * batch,)` "
        "targets are taken as such)."
    )
    if model is not None and any(isinstance(m, nn.EmbeddingBag) for m in model.modules()):
        message += (
            " A 1-D integer tensor of another length may be `nn.EmbeddingBag`'s flat `(indices, offsets)`: "
            "give the bags as a 2-D `(batch, bag_length)` tensor instead."
        )
    return ConfigurationError(message)
