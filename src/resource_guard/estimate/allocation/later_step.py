"""A later step of the same training loop, one that starts with the gradients allocated.

An estimate traces one step that starts without gradients and frees them at its end
(``zero_grad(set_to_none=True)``). In micro-steps 2..k of gradient accumulation, and in every step of a
loop that zeroes gradients instead of freeing them (``zero_grad(set_to_none=False)``, the default before
torch 2.0; Hugging Face's Trainer calls ``model.zero_grad()``), the gradients are alive through forward
and backward, and backward computes each new gradient into a temporary that autograd adds into the old
one and frees (``AccumulateGrad``: ``variable_grad += new_grad`` when grad mode is off;
``torch/csrc/autograd/functions/accumulate_grad.h``). Used by
:func:`~resource_guard.estimate.allocation.allocator.device_fit` (``gradients_kept=True``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = ["later_peak_from_timeline", "later_step", "running_peak"]

_GROWN = 1 << 40  # ids of a sparse gradient's concatenation: apart from the temporaries' (-1, -2, ...)


def _trailing_frees(events: Sequence[tuple[int, int]]) -> int:
    end = len(events)
    while end > 0 and events[end - 1][1] < 0:
        end -= 1
    return end


def running_peak(initial: Sequence[tuple[int, int]], events: Sequence[tuple[int, int]]) -> int:
    """The peak of the live bytes over ``events`` from ``initial``."""
    live = peak = sum(size for _, size in initial)
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def later_step(
    events: Sequence[tuple[int, int]],
    initial: Sequence[tuple[int, int]] = (),
    gradients: Collection[tuple[int, int]] = (),
    sparse: Mapping[int, int] | None = None,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(initial, events)`` of a later step that starts with the step's gradients allocated.

    The gradients are ``gradients`` (``(id, n)`` of the trace, :attr:`MemoryEstimate.gradient_allocations`)
    or, without them, the storages born in the step and still alive where its trailing run of frees
    (``zero_grad``) begins — which also takes whatever the end of backward frees where the optimizer
    allocates nothing (plain SGD). Each becomes an initial allocation and its frees are dropped; its
    birth becomes a temporary of its size (the new gradient), freed where the trace accumulated it into
    ``.grad`` (after event ``n``: a weight used several times sums its contributions first), or at once
    where that is not known.

    A sparse gradient (``sparse``: the id of its values -> the bytes its accumulation allocates) is
    not added into in place: ``sparse += sparse`` concatenates the old rows and the new into new
    indices and values and frees the old (``add_out_sparse_cpu``, ``add_out_sparse_cuda``). Where it is
    accumulated, those bytes are allocated and the kept gradient freed; they live to the end. Each
    micro-step adds its rows again: the figures are the second micro-step's.

    Example (storage 0 a parameter, 1 an activation, 2 and 3 gradients freed by ``zero_grad``):
        >>> later_step([(1, 64), (2, 32), (1, -64), (3, 16), (2, -32), (3, -16)], [(0, 8)])
        ([(0, 8), (2, 32), (3, 16)], [(1, 64), (-1, 32), (-1, -32), (1, -64), (-2, 16), (-2, -16)])
    """
    end = _trailing_frees(events)
    freed_early = {uid for uid, delta in events[:end] if delta < 0}
    ready = dict(gradients)
    wanted = set(ready)
    kept: dict[int, int] = {}
    for uid, delta in events[:end]:
        if delta > 0 and (uid in wanted if wanted else uid not in freed_early):
            kept[uid] = kept.get(uid, 0) + delta
    out: list[tuple[int, int]] = []
    later: dict[int, list[tuple[int, int]]] = {}  # event count -> the new gradients added in then
    temp = 0
    grown = {uid: n for uid, n in (sparse or {}).items() if uid in kept}
    tail: list[tuple[int, int]] = []
    for i, (uid, delta) in enumerate(events):
        if uid not in kept:
            out.append((uid, delta))
        elif delta > 0 and i < end:
            temp -= 1
            out.append((temp, delta))
            n = ready.get(uid, -1)
            done = [(temp, -delta)]
            if uid in grown:  # a sparse gradient: the concatenation replaces the kept one
                done = [(temp - _GROWN, grown[uid]), (uid, -kept[uid]), *done]
                tail.append((temp - _GROWN, -grown[uid]))
            if n > i + 1:
                later.setdefault(n, []).extend(done)
            else:
                out.extend(done)
        out += later.pop(i + 1, [])
    for rest in later.values():
        out += rest
    return [*initial, *kept.items()], out + tail


def later_peak_from_timeline(estimate: Any) -> int:
    """The live peak of a later step from the timeline: every forward/backward point with all the
    gradients present (for an estimate without allocation events)."""
    from resource_guard.estimate.trace.tracer import CATEGORIES

    g = CATEGORIES.index("gradients")
    points = [sizes for _, sizes in estimate.timeline]
    grads = max((sizes[g] for sizes in points), default=0)
    later = max(
        (
            sum(sizes) - sizes[g] + grads
            for phase, sizes in estimate.timeline
            if phase in ("forward", "backward")
        ),
        default=0,
    )
    return max(int(estimate.peak_bytes), later)
