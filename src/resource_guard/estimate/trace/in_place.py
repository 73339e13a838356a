"""Operators the trace runs out of place that the real step runs in place.

Under a dispatch mode PyTorch's C++ treats every tensor as a subclass (``isTensorSubclassLike`` is
true whenever a mode is active), and two kinds of code then allocate an output that the real step
does not:

- autograd accumulates a gradient that fans in from several uses in place (``old.add_(new)``,
  ``InputBuffer::accumulate``) when it holds the last reference, never for subclasses: the trace sees
  a backward ``old + new`` of two same-shaped dense tensors (a recurrent model's gradients fan in once
  per time step; without this a Mamba step came out 6-8% high);
- ATen's composite functions fill a fresh zero buffer and update it in place, or out of place for
  subclasses "for composite compliance": ``gather_backward`` is ``zeros.scatter_add_(…)`` for real and
  ``zeros.scatter_add(…)`` in the trace, and so are the backward of indexing (``index_put``),
  ``index_select`` (``index_add``), ``masked_select`` (``masked_scatter``) and ``take`` (``put``). The
  trace sees a zero-fill (:data:`ZERO_FILLS`) and, next, an out-of-place operator with an in-place
  variant applied to it, both issued by one C++ call: the Python stack (:func:`call_site`) is the
  same. The user's own ``torch.zeros(n).scatter_add(…)`` is two Python calls and stays a copy.

The :class:`~resource_guard.estimate.trace.tracer.StorageTracker` lets such an operator's output take over
the buffer it was computed from (:class:`InPlace`) if that buffer dies before the next operator
(nothing else held it): the live total at the operator is counted without it, and the allocation
events show one buffer (:func:`merge_events`), as the allocator saw it. A buffer that outlives the
operator was a real copy and is counted as one. (A DeBERTa-v2 step, whose disentangled attention
gathers from relative-position scores 8x the size of the attention scores, came out 6% high in fp32.)

Example:
    >>> import torch
    >>> aten = torch.ops.aten
    >>> has_in_place_variant(aten.scatter_add.default), has_in_place_variant(aten.mm.default)
    (True, False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "InPlace",
    "ZERO_FILLS",
    "accumulates",
    "call_site",
    "has_in_place_variant",
    "is_query",
    "merge_events",
]

_aten = torch.ops.aten
#: the zero-filled buffers ATen's composites update in place (out of place for subclasses)
ZERO_FILLS = frozenset({_aten.zeros.default, _aten.new_zeros.default, _aten.zeros_like.default})


@dataclass
class InPlace:
    """An operator whose output the real step writes into ``src``'s buffer, if ``src`` dies with it.

    ``src_*`` describe the source's tracked storage; ``first_event`` is the index of the operator's
    first allocation event; ``out_uid`` is the output's uid, once tracked with the source's size.
    """

    src_key: int
    src_uid: int
    src_bytes: int
    src_category: str
    first_event: int
    out_uid: int | None = None


def call_site(frame: Any) -> tuple[tuple[Any, int], ...]:
    """The Python stack from ``frame`` down: (code, last instruction) of every frame."""
    site = []
    while frame is not None:
        site.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return tuple(site)


def has_in_place_variant(func: Any) -> bool:
    """Whether ``func`` is an out-of-place ATen operator with an in-place twin (``op`` / ``op_``)."""
    if func._schema.is_mutable or not hasattr(func, "overloadpacket"):
        return False
    name = func.overloadpacket.__name__
    return not name.endswith("_") and hasattr(_aten, name + "_")


def accumulates(old: torch.Tensor, new: Any) -> bool:
    """Whether a backward ``old + new`` may be autograd's gradient accumulation, in place for real."""
    if not isinstance(new, torch.Tensor) or old.layout != torch.strided or new.layout != torch.strided:
        return False
    if old.shape != new.shape or old.dtype != new.dtype or old._base is not None:
        return False
    return old.is_contiguous()


_QUERIES: dict[Any, bool] = {}


def is_query(func: Any) -> bool:
    """Whether ``func`` only reads (``prim.device``, ``.item()``): no tensor out, nothing written.

    Such calls come between an operator and the release of its inputs (autograd asks the output's
    device), so they neither allocate nor mark a point where the live total is observed.
    """
    found = _QUERIES.get(func)
    if found is None:
        schema = func._schema
        found = not schema.is_mutable and not any("Tensor" in str(r.type) for r in schema.returns)
        _QUERIES[func] = found
    return found


def merge_events(events: list[tuple[int, int]], p: InPlace) -> bool:
    """Rewrite ``events`` (from ``p.first_event`` on) so the source's buffer is the output's: its free
    and the output's allocation go, the output's later events use the source's uid. False if either
    event is missing (nothing changed)."""
    if p.out_uid is None:
        return False
    tail = events[p.first_event :]
    freed = next((i for i, (uid, d) in enumerate(tail) if uid == p.src_uid and d < 0), None)
    born = next((i for i, (uid, d) in enumerate(tail) if uid == p.out_uid and d > 0), None)
    if freed is None or born is None:
        return False
    rest = [ev for i, ev in enumerate(tail) if i not in (freed, born)]
    events[p.first_event :] = [(p.src_uid if uid == p.out_uid else uid, d) for uid, d in rest]
    return True
