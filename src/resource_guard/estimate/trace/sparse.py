"""Sparse (COO) tensors in the trace: their parts, and the kernels that make them, as the target runs them.

A sparse COO tensor has no storage of its own: its bytes are those of its ``indices`` (int64,
``sparse_dim × nnz``) and ``values`` (``nnz × dense shape``) tensors, each a dense tensor with a
storage. Fake tensors get the shapes of sparse results wrong: their kernels make an empty (``nnz = 0``)
tensor for ``clone``, ``_embedding_bag_backward``, ``_coalesce``, ``sparse_mask`` and ``add``. So the
operators that make sparse tensors in a training step are run here the way the real kernels run them,
with dense operators whose outputs and temporaries the
:class:`~resource_guard.estimate.trace.tracer.StorageTracker` counts one by one (its mode is
re-entered), and the sparse result is assembled from those parts
(``_sparse_coo_tensor_with_dims_and_tensors``, which aliases them). The rules and their sources
(PyTorch ``aten/src/ATen/native``):

- ``_embedding_bag_backward(..., sparse=True)`` (``EmbeddingBag.cpp``, CPU and CUDA alike): the bag of
  every index is rebuilt when the forward did not keep it (``make_offset2bag``: ``n + 1`` int64 zeros,
  ``cumsum``), then ``_embedding_bag_sparse_backward``, a composite traced as it is:
  ``grad.index_select(0, offset2bag)`` gives the values (``n × dim``; ``mean`` divides them by the bag
  sizes), and the indices are the batch's own, reshaped (a view when they are int64, else an int64
  copy). ``nnz`` is the number of indices, not of distinct rows: it is known from shapes alone.
  ``mode="max"`` has no sparse gradient (``F.embedding_bag`` refuses it).
- ``_embedding_bag`` on CUDA (``EmbeddingBag.cu``, ``_embedding_bag_cuda``) keeps ``offset2bag`` (``n``
  int64, saved for backward) in every mode, where the CPU kernel leaves it empty for ``sum`` and the
  backward rebuilds it: a CUDA target's trace makes it in the forward (dense and sparse tables alike).
- ``Embedding(sparse=True)``'s backward is a composite (``embedding_sparse_backward``) traced as it is.
- Autograd's ``AccumulateGrad`` (``torch/csrc/autograd/functions/accumulate_grad.h``) keeps the sparse
  gradient without copying when its indices and values are contiguous (a shallow copy), else clones
  both; under a dispatch mode it always calls ``clone``, so a backward ``clone`` of a sparse tensor
  with contiguous parts is taken as the shallow copy.
- ``_coalesce`` (``SparseTensor.cpp``, CPU): new indices and values of the full ``nnz`` rows (narrowed
  to the distinct ones, the storage kept), a contiguous copy of the values if they are not, the
  flattened indices when ``sparse_dim > 1``, and three ``nnz`` int64 temporaries of the sort. On CUDA
  (``sparse/cuda/SparseCUDATensor.cu``): the flattened indices are cloned (``nnz`` int64, kept as the
  new indices when ``sparse_dim == 1``), two ``nnz`` int64 buffers (``origIndices``,
  ``uniqueOffsets``) and Thrust's ``sort_by_key`` scratch (taken as one double buffer of keys and
  values, ``2 × nnz`` int64), and values of the distinct rows only.
- ``dense.sparse_mask(coalesced)`` (``sparse/SparseTensor.cpp``, CPU, as measured): values and int64
  indices of the mask's rows, a temporary of the values' size and a scalar; taken alike on CUDA.
- ``sparse + sparse`` (``SparseTensorMath.cpp``, ``sparse/cuda/SparseCUDATensorMath.cu``): the indices
  and values of both, concatenated (``n1 + n2`` rows); CUDA never merges, the CPU merges two coalesced
  operands into storage of the same ``n1 + n2`` rows.
- ``dense.add_(sparse, alpha=a)`` (an optimizer's update): nothing on the CPU; on CUDA, with a dense
  dimension and ``a != 1``, ``values.mul(a)`` (``nnz × dim``, "purposely not inplace") and, when
  ``sparse_dim > 1``, the flattened indices.

The number of distinct rows (``coalesce``) depends on the data, not on the shapes, while everything
that reuses an estimate (the planner's search, the shape guard's cache) keys it on shapes. So by
default (``rows="bound"``) it is bounded by ``nnz``, the number of indices: never under for any batch
of these shapes. With ``rows="batch"`` (``estimate_memory(..., sparse_rows="batch")``), where the
sparse tensor's indices derive from the batch (the tracker's small real "shadows" of batch-derived
tensors), the count is the sample batch's own: exact for that batch, under for one of the same shapes
with more distinct indices. Either way :meth:`SparseOps.notes` says which, for the estimate's warnings.

Example:
    >>> ops = SparseOps("cpu")
    >>> ops.handles(torch.ops.aten._coalesce.default), ops.handles(torch.ops.aten.mm.default)
    (True, False)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["SPARSE_ROWS", "SparseOps", "is_sparse", "sparse_parts"]

_aten = torch.ops.aten
_LONG = torch.int64
#: how the distinct rows of a coalesced sparse gradient are counted: bounded by the indices, or the batch's
SPARSE_ROWS = ("bound", "batch")
_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def is_sparse(t: Any) -> bool:
    """Whether ``t`` is a sparse tensor (COO, CSR, CSC, BSR or BSC)."""
    return isinstance(t, torch.Tensor) and t.layout in _SPARSE_LAYOUTS


def sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors that hold ``t``'s bytes: COO indices and values; compressed (CSR, CSC, BSR,
    BSC) row or column pointers, plain indices and values."""
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


def _coo(like: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, coalesced: bool) -> torch.Tensor:
    return _aten._sparse_coo_tensor_with_dims_and_tensors.default(
        like.sparse_dim(),
        like.dense_dim(),
        list(like.shape),
        indices,
        values,
        dtype=values.dtype,
        layout=torch.sparse_coo,
        device=values.device,
        is_coalesced=coalesced,
    )


def _empty(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype)


class SparseOps:
    """Runs the operators that make sparse tensors as the target's kernels do (see the module notes).

    Args:
        device_kind: the target's kind (``"cpu"``, ``"cuda"``, ...): where the CUDA kernels allocate
            otherwise, a ``"cuda"``/``"rocm"`` target follows them.
        rows: ``"bound"``: a coalesced tensor keeps as many rows as it has indices (never under for
            any batch of these shapes); ``"batch"``: the sample batch's own distinct indices, where
            known (see the module notes).
    """

    _FUNCS = frozenset(
        {
            _aten._embedding_bag.default,
            _aten._embedding_bag_backward.default,
            _aten.embedding_sparse_backward.default,
            _aten.clone.default,
            _aten._coalesce.default,
            _aten.sparse_mask.default,
            _aten.add.Tensor,
            _aten.add_.Tensor,
            _aten._sparse_coo_tensor_with_dims_and_tensors.default,
        }
    )

    def __init__(self, device_kind: str, rows: str = "bound") -> None:
        self.cuda = device_kind in ("cuda", "rocm")
        self.rows = rows
        self.indices_of: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # sparse -> real indices
        self.distinct: Counter[str] = Counter()  # coalesce whose row count is the batch's own
        self.bounded: Counter[str] = Counter()  # coalesce bounded by nnz: the batch's count not asked for
        self.unknown: Counter[str] = Counter()  # coalesce bounded by nnz: the indices' values not known
        self.made: Counter[str] = Counter()  # sparse results made here, by operator
        self.grown = 0  # in-place sparse + sparse: the tensor grows by the rows added, every call

    def handles(self, func: Any) -> bool:
        """Whether ``func`` is one of the operators this class may run (with sparse operands)."""
        return func in self._FUNCS

    def run(self, func: Any, mode: Any, args: tuple, kwargs: dict, *, phase: str) -> tuple[bool, Any]:
        """``(True, output)`` of ``func`` run as the target's kernel does, its parts tracked by ``mode``
        (re-entered); ``(False, None)`` where the operator makes no sparse tensor (the caller runs it)."""
        if func not in self._FUNCS:
            return False, None
        if func is _aten._embedding_bag.default:
            if not self.cuda:
                return False, None
            out = func(*args, **kwargs)
            indices = args[1]
            if out[1].numel() == 0 and indices.numel() != 0:  # CUDA keeps every index's bag
                with mode:
                    out = (out[0], torch.empty(indices.shape[:1], dtype=indices.dtype), *out[2:])
            return True, out
        if func is _aten.embedding_sparse_backward.default:
            # reached whole from inside ``_embedding_bag_sparse_backward``: its operators are traced
            # (``padding_idx`` drops that index's rows: a mask and an index, from the batch's values)
            with mode:
                out = func.decompose(*args, **kwargs)
            self.made["embedding_sparse_backward"] += 1
            return True, out
        if func is _aten._embedding_bag_backward.default:
            if not _flag(args, kwargs, 9, "sparse"):
                return False, None
            with mode:
                out = self._embedding_bag_backward(*args, **kwargs)
            real = getattr(mode, "shadows", {}).get(args[1])
            padding = int(args[11] if len(args) > 11 else kwargs.get("padding_idx", -1))
            if real is not None:
                with _disable_current_modes():  # the gradient's indices are the batch's, as a row
                    kept = real.reshape(-1).long()
                    self.indices_of[out] = (kept[kept != padding] if padding != -1 else kept).reshape(1, -1)
        elif func is _aten._sparse_coo_tensor_with_dims_and_tensors.default:
            out = func(*args, **kwargs)
            real = getattr(mode, "shadows", {}).get(args[3]) if len(args) > 3 else None
            if real is not None:
                self.indices_of[out] = real
            return True, out
        elif func is _aten.add_.Tensor and not is_sparse(args[0]) and is_sparse(args[1]):
            with mode:
                self._add_dense_sparse_scratch(args[1], kwargs.get("alpha", 1))
            self.made["add_"] += 1
            return True, args[0]  # the update writes into the dense tensor: no bytes of its own
        else:
            sparse = [a for a in args[:2] if is_sparse(a)]
            if not sparse or any(a.layout != torch.sparse_coo for a in sparse):
                return False, None
            with mode:
                made = self._coo_op(func, args, kwargs, phase)
            if made is None:
                return False, None
            out = made
        self.made[func._schema.name.split("::")[-1]] += 1
        return True, out

    # -- the kernels ---------------------------------------------------------------------------------
    def _embedding_bag_backward(
        self,
        grad: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        offset2bag: torch.Tensor,
        bag_size: torch.Tensor,
        maximum_indices: torch.Tensor,
        num_weights: int,
        scale_grad_by_freq: bool,
        mode: int,
        sparse: bool,
        per_sample_weights: torch.Tensor | None = None,
        padding_idx: int = -1,
    ) -> torch.Tensor:
        indices, offsets = indices.contiguous(), offsets.contiguous()
        n = indices.shape[0]
        if n != 0 and offset2bag.numel() == 0:  # make_offset2bag: the forward kept no bags (sum)
            bags = offsets.new_zeros(n + 1)
            bags.index_add_(0, offsets, torch.ones_like(offsets))
            bags[0] -= 1
            offset2bag = bags.cumsum(0).narrow(0, 0, n)
            del bags
        return _aten._embedding_bag_sparse_backward.default.decompose(
            grad, indices, offsets, offset2bag, bag_size, num_weights, scale_grad_by_freq, mode,
            per_sample_weights, padding_idx,
        )  # fmt: skip

    def _coo_op(self, func: Any, args: tuple, kwargs: dict, phase: str) -> torch.Tensor | None:
        if func is _aten.clone.default:
            return self._clone(args[0], shallow=phase.startswith("backward"))
        if func is _aten._coalesce.default:
            return self._coalesce(args[0])
        if func is _aten.sparse_mask.default:
            return (
                self._sparse_mask(args[0], args[1]) if is_sparse(args[1]) and not is_sparse(args[0]) else None
            )
        if func in (_aten.add.Tensor, _aten.add_.Tensor):
            a, b = args[0], args[1]
            if is_sparse(a) and is_sparse(b) and func is _aten.add.Tensor:
                return self._concat(a, b)
            if is_sparse(a) and is_sparse(b):  # in place (SGD's momentum over a sparse gradient)
                self.grown += 1
        return None

    def _clone(self, x: torch.Tensor, *, shallow: bool) -> torch.Tensor:
        indices, values = x._indices(), x._values()
        if not (shallow and indices.is_contiguous() and values.is_contiguous()):
            indices = indices.clone(memory_format=torch.contiguous_format)
            values = values.clone(memory_format=torch.contiguous_format)
        out = _coo(x, indices, values, x.is_coalesced() and not shallow)
        self._inherit(out, x)
        return out

    def _rows(self, x: torch.Tensor) -> int:
        """The distinct index columns of ``x``: ``nnz``, or the batch's own where asked for and known."""
        nnz = int(x._nnz())
        real = self.indices_of.get(x)
        if self.rows == "bound" or real is None:
            (self.bounded if self.rows == "bound" else self.unknown)["coalesce"] += 1
            return nnz
        self.distinct["coalesce"] += 1
        with _disable_current_modes():  # a real, small tensor: the batch's indices
            return int(torch.unique(real, dim=1).shape[1]) if real.numel() else 0

    def _coalesce(self, x: torch.Tensor) -> torch.Tensor:
        nnz, sd = int(x._nnz()), x.sparse_dim()
        values = x._values()
        dense = tuple(values.shape[1:])
        if nnz < 2:  # both kernels: a clone, marked coalesced
            out = self._clone(x, shallow=False)
            return _coo(x, out._indices(), out._values(), True)
        rows = self._rows(x)
        real = self.indices_of.get(x)
        temps: list[torch.Tensor] = []
        if not values.is_contiguous():
            temps.append(values.contiguous())
        if self.cuda:
            flat = _empty((nnz,), _LONG)  # flatten_indices(..., force_clone=True)
            temps += [_empty((nnz,), _LONG), _empty((nnz,), _LONG), _empty((2 * nnz,), _LONG)]
            new_values = _empty((rows, *dense), values.dtype)
            indices = flat.view(1, nnz).narrow(1, 0, rows) if sd == 1 else _empty((sd, rows), _LONG)
        else:
            if sd > 1:
                temps.append(_empty((nnz,), _LONG))
            new_indices, new_values_full = _empty((sd, nnz), _LONG), _empty((nnz, *dense), values.dtype)
            temps += [_empty((nnz,), _LONG) for _ in range(3)]  # the sort's outputs and its buffer
            indices, new_values = new_indices.narrow(1, 0, rows), new_values_full.narrow(0, 0, rows)
        del temps
        out = _coo(x, indices, new_values, True)
        if real is not None:
            with _disable_current_modes():
                self.indices_of[out] = torch.unique(real, dim=1)
        return out

    def _sparse_mask(self, dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows, sd = int(mask._nnz()), mask.sparse_dim()
        shape = (rows, *dense.shape[sd:])
        one = _empty((), dense.dtype)  # a scalar of the projection
        values = _empty(shape, dense.dtype)
        indices = _empty((sd, rows), _LONG)
        temp = _empty(shape, dense.dtype)
        del temp, one
        out = _coo(mask, indices, values, mask.is_coalesced())
        self._inherit(out, mask)
        return out

    def _concat(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows = int(a._nnz()) + int(b._nnz())
        values = a._values()
        indices = _empty((a.sparse_dim(), rows), _LONG)
        new_values = _empty((rows, *values.shape[1:]), torch.promote_types(values.dtype, b._values().dtype))
        out = _coo(a, indices, new_values, False)
        ra, rb = self.indices_of.get(a), self.indices_of.get(b)
        if ra is not None and rb is not None:
            with _disable_current_modes():
                self.indices_of[out] = torch.cat([ra, rb], 1)
        return out

    def _add_dense_sparse_scratch(self, sparse: torch.Tensor, alpha: Any) -> None:
        if not self.cuda or sparse.dense_dim() == 0:
            return
        nnz = int(sparse._nnz())
        temps = []
        if sparse.sparse_dim() > 1:
            temps.append(_empty((nnz,), _LONG))  # flatten_indices
        if alpha != 1:
            temps.append(_empty(sparse._values().shape, sparse.dtype))  # values.mul(alpha)
        del temps

    def _inherit(self, out: torch.Tensor, src: torch.Tensor) -> None:
        real = self.indices_of.get(src)
        if real is not None:
            self.indices_of[out] = real

    def notes(self) -> list[str]:
        """What the estimate's warnings say of the sparse tensors traced."""
        out = []
        if self.made:
            ops = ", ".join(f"`{name}` ({n}x)" for name, n in sorted(self.made.items()))
            out.append(f"sparse tensors counted by their indices and values: {ops}")
        if self.distinct["coalesce"]:
            out.append(
                "sparse gradients: the number of distinct rows `coalesce` keeps is the sample batch's own "
                "(its indices, `sparse_rows='batch'`); a batch of the same shapes with more distinct "
                "indices needs more memory"
            )
        if self.bounded["coalesce"]:
            out.append(
                "sparse gradients: the number of distinct rows `coalesce` keeps is bounded by the number "
                "of indices (never under for any batch of these shapes); `sparse_rows='batch'` counts "
                "the sample batch's own distinct indices instead"
            )
        if self.unknown["coalesce"]:
            out.append(
                "sparse gradients: the number of distinct rows `coalesce` keeps is not known from the "
                "batch; bounded by the number of indices (an upper bound)"
            )
        if self.grown:
            out.append(
                f"`sparse.add_(sparse)` ({self.grown}x, e.g. SGD momentum over a sparse gradient): the "
                "tensor grows by the added rows at every call, step after step; not counted (no steady state)"
            )
        return out


def _flag(args: tuple, kwargs: dict, index: int, name: str) -> bool:
    value = args[index] if len(args) > index else kwargs.get(name, False)
    return bool(value)
