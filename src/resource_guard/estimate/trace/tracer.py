"""Live-storage accounting of one training step run on fake tensors.

A :class:`StorageTracker` is a ``TorchDispatchMode`` that sits above a ``FakeTensorMode``. Every
operator output's storage is registered with its byte size and a category; a weak-reference
finalizer takes it off the books when the storage dies, exactly when the real storage would be freed
(autograd, Python reference counting and the optimizer run as they would for real). After each
operator the live total, plus the operator's known internal scratch space (``_kernels``), is compared
with the running peak.

Data-dependent operators are handled without real model-sized memory: values that derive only from
the batch (attention masks, label counts) are computed for real on small "shadow" tensors. Operators
whose fake kernel fails otherwise (a data-dependent value nobody knows, a wrong or missing meta
kernel) are recovered one by one by :class:`~resource_guard.estimate.trace.recovery.Recovery`, which
records what it did.

Some operators run out of place only because the trace runs under a dispatch mode; the real step runs
them in place (autograd's gradient accumulation, ATen's composites that fill a zero buffer):
:mod:`~resource_guard.estimate.trace.in_place` tells which, and the tracker lets such an operator's output
take over its source's buffer when the source dies with the operator.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from resource_guard.estimate.trace.composite import CompositeOps
from resource_guard.estimate.trace.in_place import (
    ZERO_FILLS,
    InPlace,
    accumulates,
    call_site,
    has_in_place_variant,
    is_query,
    merge_events,
)
from resource_guard.estimate.trace.recovery import Recovery
from resource_guard.estimate.trace.sparse import SparseOps, is_sparse, sparse_parts
from resource_guard.step.batching import SHADOW_MAX_NUMEL

__all__ = ["CATEGORIES", "PeakRecord", "SHADOW_MAX_NUMEL", "StorageTracker", "observe_ops"]

#: ``(phase, func, args, kwargs, out)`` callbacks told of every traced operator (see :func:`observe_ops`)
_OP_OBSERVERS: list[Callable[[str, Any, tuple, dict, Any], None]] = []


@contextlib.contextmanager
def observe_ops(observer: Callable[[str, Any, tuple, dict, Any], None]) -> Iterator[None]:
    """Tell ``observer(phase, func, args, kwargs, out)`` of every operator traced inside the block.

    The step-time model (:mod:`resource_guard.planning.op_time`) counts FLOPs and bytes with it from
    the same trace the memory estimate runs; queries (sizes, strides) are not reported.
    """
    _OP_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OP_OBSERVERS.remove(observer)


CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "inputs",
    "other",
)
_PHASE_CATEGORY = {"forward": "activations", "backward": "temporaries", "optimizer": "temporaries"}
_aten = torch.ops.aten


@dataclass(frozen=True)
class PeakRecord:
    """The highest point of one phase: live bytes, by category, and the operator that reached it."""

    bytes: int
    breakdown: dict[str, int]
    phase: str
    op: str
    op_index: int


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse, nested or other storage-less tensors
        return None


_FACTORIES = {
    _aten.ones.default, _aten.zeros.default, _aten.full.default, _aten.arange.default,
    _aten.arange.start, _aten.arange.start_step, _aten.scalar_tensor.default,
}  # fmt: skip


def _constant_factory(func: Any, args: tuple, kwargs: dict) -> bool:
    """A factory of a known, small value: a shadow can hold it."""
    if func not in _FACTORIES:
        return False
    if func is _aten.scalar_tensor.default:
        return True
    if func in (_aten.ones.default, _aten.zeros.default, _aten.full.default):
        size = args[0]
        return all(isinstance(n, int) for n in size) and math.prod(size) <= SHADOW_MAX_NUMEL
    bounds = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(bounds) != len(args) or not bounds:  # a symbolic or tensor bound
        return False
    start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (*bounds, 1)[:3]
    return step != 0 and 0 <= (end - start) / step <= SHADOW_MAX_NUMEL


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            if isinstance(value, torch.Tensor):
                written.append(value)
            elif isinstance(value, (list, tuple)):
                written.extend(v for v in value if isinstance(v, torch.Tensor))
    return written


class StorageTracker(TorchDispatchMode):
    """Counts live storage bytes by category while a step runs on fake tensors.

    Args:
        kernel_extra: ``(func, args, kwargs, out, size_of) -> KernelExtra | None``: scratch memory the real
            kernel allocates and frees inside the operator, and its true output sizes.
        record_timeline: keep the live total by category after every operator.
        composite: the custom operators to run through their composite kernel (``None``: none).
        sparse: the operators that make sparse tensors, run as the target's kernels
            (:mod:`~resource_guard.estimate.trace.sparse`; ``None``: their fake rules).
    """

    def __init__(
        self,
        kernel_extra: Callable[..., Any] | None = None,
        *,
        record_timeline: bool = True,
        composite: CompositeOps | None = None,
        sparse: SparseOps | None = None,
    ) -> None:
        super().__init__()
        self._kernel_extra = kernel_extra
        self.composite = composite
        self.sparse = sparse
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [nbytes, category, uid]
        self._uids = itertools.count()
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.phase = "setup"
        self.gradient_uids: tuple[tuple[int, int], ...] = ()  # (uid, events recorded when accumulated)
        self._gradient_ready: dict[int, int] = {}
        self._sparse_gradients: dict[
            int, int
        ] = {}  # uid of a sparse gradient's values -> next accumulation's bytes
        self.sparse_gradient_uids: tuple[tuple[int, int], ...] = ()
        self.recording = False
        self.peaks: dict[str, PeakRecord] = {}
        self.events: list[tuple[int, int]] = []  # (uid, +nbytes alloc | -nbytes free)
        self.timeline: list[tuple[str, tuple[int, ...]]] = []
        self.op_count = 0
        self.shadows: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.recovery = Recovery(self.shadows)
        self.record_timeline = record_timeline
        self._in_place: InPlace | None = None  # the current operator, if it may run in place for real
        self._deferred: tuple[Any, ...] | None = None  # its observation, made at the next operator
        self._zero_fill: tuple[int, int, tuple] | None = None  # (key, uid, call site) of the last op's zeros
        self._alias: dict[int, int] = {}  # uid of an output -> uid of the buffer it took over

    # -- bookkeeping -------------------------------------------------------------------------------
    def track(self, t: torch.Tensor, category: str | None = None, *, nbytes: int | None = None) -> None:
        """Register ``t``'s storage (if new) under ``category`` (default: the phase's category).

        ``nbytes`` overrides the storage's size where the real kernel's output is larger than the
        fake one (see ``_kernels``). A sparse tensor is tracked by its parts (indices, values); a part
        that is the batch's, a parameter's or the optimizer's (a gradient's indices viewing the batch's)
        keeps its category.
        """
        if is_sparse(t):
            with _disable_current_modes():  # its parts, without an operator of the trace
                parts = sparse_parts(t)
            for part in parts:
                st = _storage(part)
                entry = self._live.get(id(st)) if st is not None else None
                owned = entry is None or entry[1] in ("activations", "temporaries", "gradients")
                self.track(part, category if owned else None)
            if category == "gradients" and t.layout == torch.sparse_coo:
                self._note_sparse_gradient(parts[1], t.sparse_dim())
            return
        st = _storage(t)
        if st is None:
            return
        key = id(st)
        entry = self._live.get(key)
        if entry is not None:
            if category == "gradients" and entry[1] != category:  # AccumulateGrad took it: a gradient now
                self._gradient_ready[entry[2]] = len(self.events)
            if category is not None and entry[1] != category:
                self.totals[entry[1]] -= entry[0]
                self.totals[category] += entry[0]
                entry[1] = category
            return
        nbytes = int(st.nbytes()) if nbytes is None else max(nbytes, int(st.nbytes()))
        cat = category or _PHASE_CATEGORY.get(self.phase.split(":")[0], "other")
        uid = next(self._uids)
        self._live[key] = [nbytes, cat, uid]
        self.totals[cat] += nbytes
        self.total += nbytes
        if self.recording:
            self.events.append((uid, nbytes))
        weakref.finalize(st, self._free, key, uid)

    def _note_sparse_gradient(self, values: torch.Tensor, sparse_dim: int) -> None:
        """A sparse gradient: the next micro-step's accumulation concatenates the old rows and the new
        (``sparse += sparse``; :mod:`~resource_guard.estimate.trace.sparse`), allocating both again."""
        st = _storage(values)
        entry = self._live.get(id(st)) if st is not None else None
        if entry is None or entry[1] != "gradients":
            return
        rows = values.shape[0] if values.dim() else 0
        row_bytes = values[0].numel() * values.element_size() if rows else 0
        self._sparse_gradients[entry[2]] = 2 * rows * (row_bytes + 8 * sparse_dim)

    def live_storages(self) -> tuple[tuple[int, int], ...]:
        """``(id, bytes)`` of every live tracked storage."""
        return tuple((entry[2], entry[0]) for entry in self._live.values())

    def size_of(self, t: torch.Tensor) -> int | None:
        """The tracked byte size of ``t``'s storage, or ``None`` if it is not tracked."""
        st = _storage(t)
        entry = self._live.get(id(st)) if st is not None else None
        return None if entry is None else int(entry[0])

    def _free(self, key: int, uid: int) -> None:
        entry = self._live.get(key)
        if entry is None or entry[2] != uid:
            return
        del self._live[key]
        self.totals[entry[1]] -= entry[0]
        self.total -= entry[0]
        if self.recording:
            self.events.append((self._alias.get(uid, uid), -entry[0]))

    def _resized(self, t: torch.Tensor) -> None:
        st = _storage(t)
        entry = self._live.get(id(st)) if st is not None else None
        if entry is None or st is None:
            return
        delta = int(st.nbytes()) - entry[0]
        if delta:
            entry[0] += delta
            self.totals[entry[1]] += delta
            self.total += delta
            if self.recording:
                self.events.append((self._alias.get(entry[2], entry[2]), delta))

    def start_phase(self, phase: str) -> None:
        self._settle()
        self.phase = phase
        if phase == "zero_grad":  # the step's gradients: what a later micro-step starts with
            ready = self._gradient_ready
            grads = [uid for _, cat, uid in self._live.values() if cat == "gradients"]
            self.gradient_uids = tuple((self._alias.get(uid, uid), ready.get(uid, -1)) for uid in grads)
            self.sparse_gradient_uids = tuple(
                (self._alias.get(uid, uid), n) for uid, n in self._sparse_gradients.items() if uid in grads
            )
        self._observe(phase, "<start>", 0)

    def _settle(self) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        key, op, scratch, full, in_place, pending = deferred
        entry = self._live.get(pending.src_key)
        if entry is not None and entry[2] == pending.src_uid:
            self._record(key, op, scratch, *full)  # something else held the source: a real copy
        else:
            self._record(key, op, scratch, *in_place)
            if merge_events(self.events, pending):
                assert pending.out_uid is not None
                self._alias[pending.out_uid] = pending.src_uid

    def _observe(self, key: str, op: str, scratch: int) -> None:
        if not self.recording:
            return
        p = self._in_place
        entry = self._live.get(p.src_key) if p is not None else None
        if p is not None and p.out_uid is not None and entry is not None and entry[2] == p.src_uid:
            totals = dict(self.totals)
            totals[p.src_category] -= p.src_bytes
            full = (self.total, dict(self.totals))
            self._deferred = (key, op, scratch, full, (self.total - p.src_bytes, totals), p)
            return  # seen once the source had its chance to die
        self._record(key, op, scratch, self.total, self.totals)

    def _record(self, key: str, op: str, scratch: int, total: int, totals: dict[str, int]) -> None:
        current = total + scratch
        best = self.peaks.get(key)
        if best is None or current > best.bytes:
            breakdown = dict(totals)
            breakdown["temporaries"] += scratch
            self.peaks[key] = PeakRecord(current, breakdown, self.phase, op, self.op_count)
        if self.record_timeline:
            self.timeline.append((self.phase, tuple(totals.values())))

    def detach(self) -> None:
        """Stop reacting to storages that die after the trace."""
        self._settle()
        self.recording = False
        self._live = {}

    # -- shadows: real values of small batch-derived tensors ----------------------------------------
    def _shadow_args(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if torch.Tag.nondeterministic_seeded in func.tags:
            return None
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if not tensors or any(t not in self.shadows for t in tensors):
            return None
        mutable = func._schema.is_mutable

        def real(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                shadow = self.shadows[a]
                return shadow.clone() if mutable else shadow
            return a

        return tree_map(real, args), tree_map(real, kwargs)

    def _run_shadow(self, func: Any, real_args: tuple, real_kwargs: dict) -> Any:
        with _disable_current_modes():
            return func(*real_args, **real_kwargs)

    def _attach_shadows(
        self, out: Any, real_out: Any, func: Any, args: tuple, kwargs: dict, real: Any
    ) -> None:
        fakes, _ = tree_flatten(out)
        reals, _ = tree_flatten(real_out)
        for f, r in zip(fakes, reals):
            if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor) and r.numel() <= SHADOW_MAX_NUMEL:
                self.shadows[f] = r
        if func._schema.is_mutable:
            fake_w = _written_args(func, args, kwargs)
            real_w = _written_args(func, *real)
            for f, r in zip(fake_w, real_w):
                self.shadows[f] = r

    def shadow(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Declare ``real`` the value of ``fake`` (used for the batch)."""
        if real.numel() <= SHADOW_MAX_NUMEL and real.device.type == "cpu" and not real.is_meta:
            self.shadows[fake] = real

    # -- the mode ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        query = is_query(func)
        if not query:
            self._settle()
        real = self._shadow_args(func, args, kwargs) if self.shadows else None
        if real is None and _constant_factory(func, args, kwargs):
            real = (args, kwargs)  # a small constant made in the step (``torch.ones`` mask): its value
        ran, out = False, None
        if self.sparse is not None and self.sparse.handles(func):
            ran, out = self.sparse.run(func, self, args, kwargs, phase=self.phase)
        if not ran and self.composite is not None:
            ran, out = self.composite.run(func, self, args, kwargs, in_forward=self.phase == "forward")
        try:
            out = out if ran else func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - recovered per operator, or re-raised by `recover`
            out = self.recovery.recover(func, args, kwargs, exc)
            real = None  # an exact recovery attached the outputs' shadows itself
        if real is not None:
            # a shadow is a nicety: the fake result stands on its own
            with contextlib.suppress(Exception):
                self._attach_shadows(out, self._run_shadow(func, *real), func, args, kwargs, real)
        self.recovery.observe(func, out)
        if query:
            return out
        # the Python stack that entered C++, only where a zero-fill is made or may be consumed
        site = call_site(sys._getframe(1)) if func in ZERO_FILLS or self._zero_fill is not None else ()
        self._in_place = self._in_place_source(func, args, site)
        try:
            return self._after(func, args, kwargs, out)
        finally:
            self._in_place = None

    def _in_place_source(self, func: Any, args: tuple, site: tuple) -> InPlace | None:
        """The input whose buffer the real ``func`` may write its output into (see the module notes)."""
        zero_fill, self._zero_fill = self._zero_fill, None
        if func in ZERO_FILLS:
            self._zero_fill = (-1, -1, site)  # its buffer is noted by _after, once tracked
            return None
        if not self.recording or not args or not isinstance(args[0], torch.Tensor):
            return None
        src = args[0]
        accumulation = func is _aten.add.Tensor and self.phase.startswith("backward")
        if accumulation:
            if not accumulates(src, args[1] if len(args) > 1 else None):
                return None
        elif zero_fill is None or site != zero_fill[2] or not has_in_place_variant(func):
            return None
        st = _storage(src)
        entry = self._live.get(id(st)) if st is not None else None
        if entry is None or st is None:
            return None
        if not accumulation and zero_fill is not None and (id(st), entry[2]) != zero_fill[:2]:
            return None
        return InPlace(id(st), entry[2], entry[0], entry[1], len(self.events))

    def _after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        extra = (
            self._kernel_extra(func, args, kwargs, out, self.size_of)
            if self._kernel_extra is not None
            else None
        )
        sizes = extra.output_bytes if extra is not None else ()
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for i, t in enumerate(outputs):
            if isinstance(t, FakeTensor):
                self.track(t, nbytes=sizes[i] if i < len(sizes) else None)
        self._note_outputs(outputs)
        if func._schema.is_mutable:
            for t in _written_args(func, args, kwargs):
                self._resized(t)
        self.op_count += 1
        for observer in _OP_OBSERVERS:
            observer(self.phase, func, args, kwargs, out)
        scratch = (extra.scratch_bytes if extra is not None else 0) + self.recovery.take_scratch()
        if scratch and self.recording:
            uid = next(self._uids)
            self.events.append((uid, scratch))
            self.events.append((uid, -scratch))
        self._observe(self.phase, str(func), scratch)
        return out

    def _note_outputs(self, outputs: list[torch.Tensor]) -> None:
        """Complete the zero-fill or in-place records of this operator with its (single) output."""
        st = _storage(outputs[0]) if len(outputs) == 1 else None
        entry = self._live.get(id(st)) if st is not None else None
        if self._zero_fill is not None:
            self._zero_fill = None if entry is None else (id(st), entry[2], self._zero_fill[2])
        p = self._in_place
        if p is None:
            return
        if entry is None or entry[2] == p.src_uid or entry[0] != p.src_bytes:
            return
        if any(uid == entry[2] and d > 0 for uid, d in self.events[p.first_event :]):  # born here
            p.out_uid = entry[2]
