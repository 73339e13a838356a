"""Where a profiled step's time goes, by class of operation: the profiler window's events grouped into
matmul/conv, attention, elementwise, casts and copies, optimizer, communication and host-device syncs,
with the user's call sites of syncs and casts, the communication not hidden by compute and the device
idle time that syncs cause. Framework-free (no torch import): it reads :class:`EventRecord`\\ s, which
:mod:`resource_guard.observe.profile_events` makes from ``torch.profiler`` and
:mod:`resource_guard.observe.chrome_trace` from a recorded Chrome trace.

The classification is the table :data:`PATTERNS`: ``(class, where, regex, source)`` rows, first match
wins, ``where`` being ``"host"`` (a CPU op: ``aten::…`` names, record functions, CUDA runtime calls)
or ``"device"`` (a GPU kernel or copy). Host ops inside an ``Optimizer.step#…`` or
``Optimizer.zero_grad#…`` span count as ``optimizer`` whatever they are (the for-each and for-loop
paths run elementwise ops). A step's classes are read from the device timeline when the window saw
device activity (kernel time), else from the host's (ops' self CPU time); syncs are always host time
(the host blocked in them).

Example:
    >>> classify("aten::addmm", on_device=False), classify("aten::_to_copy", on_device=False)
    ('matmul', 'casts')
    >>> classify("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*)", on_device=True)
    'communication'
    >>> user_frame(("torch/nn/modules/module.py(1775): _call_impl", "train.py(42): step"))
    'train.py:42 (step)'

A call site is the user's line that made the op: where the reader of a live window gave each op its
site (``EventRecord.site``, from the profiler's event tree: the line of the call and the module the op
ran in, e.g. ``model.py:31 (forward) in blocks.3.attn.proj (Linear)``), that one; else (a recorded
Chrome trace) the innermost user Python frame, named by the line its function starts at.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "OP_CLASSES",
    "PATTERNS",
    "SYNC_CALLS",
    "EventRecord",
    "OpBreakdown",
    "STALL_FACTOR",
    "STALL_STEP_SHARE",
    "classify",
    "is_library_file",
    "merge_paths",
    "frame_matters",
    "user_frame",
    "op_breakdown",
]

# The classes, in report order. ``matmul`` includes convolutions (both are GEMMs on the device);
# ``sync`` is time the host spent blocked waiting for the device (on a CPU-only run, the scalar reads
# that would be syncs on a GPU: cheap there, they wait for nothing).
OP_CLASSES = (
    "matmul",
    "attention",
    "elementwise",
    "casts",
    "optimizer",
    "communication",
    "sync",
    "other",
)

# (class, where, pattern, source). First match wins, so the specific rows come first: flash-attention
# kernels contain "cutlass", optimizer kernels are elementwise, NCCL kernels are on their own stream.
PATTERNS: tuple[tuple[str, str, str, str], ...] = (
    # host-device syncs: the CUDA runtime calls that block the host until the device has finished
    # (a `.item()` or `.cpu()` runs aten::_local_scalar_dense / a D2H cudaMemcpyAsync followed by
    # cudaStreamSynchronize); CUDA runtime API reference, "synchronous" calls
    ("sync", "host", r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$", "CUDA runtime API"),
    ("sync", "host", r"^aten::(item|_local_scalar_dense)$", "aten native_functions.yaml"),
    ("communication", "host", r"^(c10d::|nccl:|gloo:|record_param_comms)", "torch.distributed c10d"),
    ("communication", "device", r"(?i)nccl", "NCCL kernel names (ncclKernel_*, ncclDevKernel_*)"),
    ("optimizer", "host", r"^(aten::_foreach_|aten::_fused_(adam|sgd|adagrad))", "torch.optim"),
    ("optimizer", "device", r"multi_tensor_apply|fused_adam|FusedAdam|fused_sgd", "torch.optim kernels"),
    ("casts", "host", r"^aten::(copy_|to|_to_copy|type_as|clone|_autocast_to_reduced_precision)$", "aten"),
    ("casts", "device", r"^Memcpy DtoD|copy_kernel|direct_copy", "ATen Copy.cu / CUDA memcpy"),
    (
        "attention",
        "host",
        r"^aten::(_?scaled_dot_product|_flash_attention|_efficient_attention|_cudnn_attention)",
        "aten SDPA backends",
    ),
    ("attention", "device", r"(?i)flash|fmha|attention|attn", "FlashAttention / xformers / cuDNN SDPA"),
    (
        "matmul",
        "host",
        r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmv|mv|dot|einsum|"
        r"(_|mkldnn_|cudnn_|miopen_)?convolution(_backward)?|conv[123]d|_convolution|conv_transpose[123]d)$",
        "aten BLAS and convolution ops",
    ),
    (
        "matmul",
        "device",
        r"(?i)gemm|gemv|cutlass|xmma|cublas|winograd|implicit_convolve|conv2d|fprop|dgrad|wgrad",
        "cuBLAS / CUTLASS / cuDNN kernel names",
    ),
    ("elementwise", "host", r"^aten::", "every other aten op (pointwise, reductions, norms, indexing)"),
    ("elementwise", "device", r"(?i)elementwise|reduce|norm|softmax|kernel", "ATen CUDA kernels"),
)
_COMPILED = tuple((cls, where, re.compile(pattern)) for cls, where, pattern, _ in PATTERNS)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_OPTIMIZER_SPAN = re.compile(r"^Optimizer\.(step|zero_grad)#")
_CLOSURE_FRAME = re.compile(r": \w*closure$")  # ``optimizer.step(closure)``'s closure (Lightning's)
# frames that are not the user's: the libraries between the user's line and the op
_LIBRARY_FRAME = re.compile(
    r"^(<built-in|<frozen)|(^|/)(torch|torchvision|lightning|lightning_fabric|pytorch_lightning|"
    r"transformers|accelerate|resource_guard|typing|contextlib|functools|threading|runpy)(/|\.py)"
)
# the demo plays the user: its loop and model are the code a call site should name
_USER_IN_LIBRARY = re.compile(r"(^|/)resource_guard/demo\.py")


@functools.lru_cache(maxsize=4096)
def is_library_file(name: str) -> bool:
    """Whether a file (or a Python frame's name, ``file.py(12): fn``) is a library's, not the user's.

    >>> is_library_file("torch/nn/modules/module.py"), is_library_file("my_project/train.py")
    (True, False)
    """
    if _USER_IN_LIBRARY.search(name):
        return False
    if _LIBRARY_FRAME.search(name):
        return True
    # a file that is not Python source nor ``<stdin>``/``<ipython-input-…>``: a console script's wrapper
    # (``venv/bin/resource-guard(8): <module>``), or a record function's name (``nn.Module: Linear_0``)
    file = name.split("(", 1)[0]
    return not file.endswith(".py") and not file.startswith("<")


@functools.lru_cache(maxsize=4096)  # a window repeats the same frames thousands of times
def frame_matters(name: str) -> bool:
    """Whether a Python frame (``with_stack``) can change the breakdown: a user's frame (a call site) or a
    closure an optimizer's step runs; a library frame between them is inert and may be left out.

    >>> frame_matters("train.py(12): step"), frame_matters("torch/nn/modules/module.py(1751): _call_impl")
    (True, False)
    """
    return not is_library_file(name) or bool(_CLOSURE_FRAME.search(name))


_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\)(: (?P<fn>.+))?$")
_MAX_SITES = 5
# A stall: one op call 20 times slower than the median of its kind (same op, same shapes) is the
# machine (a page fault, a descheduled thread, a blocked allocation), not the op; from 5% of the median
# step it would move a class's share, so it is set apart and counted at its kind's usual time.
STALL_FACTOR = 20.0
STALL_STEP_SHARE = 0.05


@dataclass(frozen=True)
class EventRecord:
    """One profiler event, reduced to what the summaries read (a seam for tests and recorded traces).

    Attributes:
        name: op, kernel, runtime call, ``ProfilerStep#N`` or Python frame (``file.py(12): fn``).
        on_device: a device event (kernel, copy, memset).
        duration_us: self time for host ops (children excluded), duration for device events and steps.
        input_shapes / input_dtypes: as ``record_shapes`` gives them.
        start_us: start on the profiler's clock (``None``: unknown; the timeline analyses skip it).
        total_us: inclusive duration (host spans; ``None``: ``duration_us``).
        thread: host thread id (spans enclose ops of their own thread only).
        python: a Python frame (``with_stack``), not an op.
        site: the op's call site where the reader knew it (the profiler's event tree: the user's line
            of the call and the module it ran in, :func:`resource_guard.observe.profile_events.op_sites`);
            ``None``: taken from the enclosing Python frames (the line their function starts at).
    """

    name: str
    on_device: bool
    duration_us: float
    input_shapes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()
    start_us: float | None = None
    total_us: float | None = None
    thread: int = 0
    python: bool = False
    site: str | None = None

    @property
    def end_us(self) -> float | None:
        if self.start_us is None:
            return None
        return self.start_us + (self.total_us if self.total_us is not None else self.duration_us)


@functools.lru_cache(maxsize=4096)  # a window repeats the same op names thousands of times
def classify(name: str, *, on_device: bool) -> str:
    """The class (one of :data:`OP_CLASSES`) of an op or kernel name, by :data:`PATTERNS`."""
    where = "device" if on_device else "host"
    for cls, kind, pattern in _COMPILED:
        if kind == where and pattern.search(name):
            return cls
    return "other"


def user_frame(stack: Sequence[str]) -> str | None:
    """The innermost frame of ``stack`` (innermost first) that is the user's, as ``file:line (function)``.

    Frames of torch, Lightning, resource_guard, built-ins and the standard library's plumbing are
    skipped: the line that matters is the user's call that led to the op.
    """
    for frame in stack:
        if is_library_file(frame):
            continue
        match = _FRAME.match(frame)
        if match:
            where = f"{match['file']}:{match['line']}"
            return f"{where} ({match['fn']})" if match["fn"] else where
    return None


@dataclass(frozen=True)
class OpBreakdown:
    """The window's time by class, per step (see :func:`op_breakdown`).

    Attributes:
        timeline: ``"device"`` (kernel time) or ``"host"`` (ops' self CPU time).
        class_us: microseconds per step by class, every class of :data:`OP_CLASSES`.
        syncs: host-device syncs per step (blocking CUDA runtime calls; on a host timeline, scalar
            reads such as ``aten::item``, which wait for nothing there).
        sync_idle_us: device idle time per step in the gaps that syncs opened (the device ran dry while
            the host waited and then launched again): what removing the syncs gives back.
        sync_sites / cast_sites: ``(file:line, calls per step, us per step)``, most expensive first.
        comm_us / exposed_comm_us: communication kernel time per step, and the part of it no compute
            kernel overlapped.
        class_spread_us: per class, half the range of its per-step values over the window's steps
            (``class_us`` is their median).
        stalls: ``(op, us, call site)`` of single op calls far slower than their kind (see
            :func:`op_breakdown`): counted at their kind's usual time, not in the classes.
    """

    timeline: str
    class_us: tuple[tuple[str, float], ...]
    syncs: float = 0.0
    sync_idle_us: float = 0.0
    sync_sites: tuple[tuple[str, float, float], ...] = ()
    cast_sites: tuple[tuple[str, float, float], ...] = ()
    comm_us: float = 0.0
    exposed_comm_us: float = 0.0
    class_spread_us: tuple[tuple[str, float], ...] = ()
    stalls: tuple[tuple[str, float, str | None], ...] = ()


def op_breakdown(events: Iterable[EventRecord], steps: int) -> OpBreakdown:
    """Group a window's events by class, per step (a pure function of the events).

    Each class's time per step is the median over the window's steps (``ProfilerStep#`` spans; ops
    outside them are shared out evenly), with its spread (half the range of the steps' values): one
    slow step does not move it. A single op call far slower than the other calls of that op with the
    same shapes (:data:`STALL_FACTOR` times their median, and at least :data:`STALL_STEP_SHARE` of the
    median step), in at most half of the steps, is a stall (:attr:`OpBreakdown.stalls`): it counts at
    the median of its kind, never as the share of its class.

    Args:
        events: the window's records (steps, ops, runtime calls, kernels, Python frames).
        steps: steps in the window (the per-step divisor).
    """
    per = max(steps, 1)
    events = list(events)
    spans = sorted(
        (e.start_us, e.end_us or e.start_us)
        for e in events
        if e.name.startswith("ProfilerStep") and e.start_us is not None
    )
    evs = [e for e in events if not e.name.startswith("ProfilerStep")]
    evs, stalls = _without_stalls(evs, spans)
    device = [e for e in evs if e.on_device]
    host = [e for e in evs if not e.on_device and not e.python]
    on_device = any(not e.name.startswith("Memset") for e in device)
    starts = [a for a, _ in spans]
    by_step = [dict.fromkeys(OP_CLASSES, 0.0) for _ in spans]
    pooled = dict.fromkeys(OP_CLASSES, 0.0)

    def charge(ev: EventRecord, cls: str) -> None:
        k = _step_index(starts, spans, ev.start_us)
        (by_step[k] if k >= 0 else pooled)[cls] += ev.duration_us

    optimizer_ops, cast_ops, sites = _enclosures(evs)
    sync_sites: dict[str, list[float]] = {}
    cast_sites: dict[str, list[float]] = {}
    syncs = 0
    sync_ends: list[float] = []
    for ev in host:
        cls = classify(ev.name, on_device=False)
        site = ev.site if ev.site is not None else sites.get(id(ev))
        if cls == "sync":
            # a GPU run's sync is the blocking runtime call (inside aten::item, .cpu(), …); a CPU
            # run has none, and its scalar reads (aten::item, one per .item()) are counted instead
            is_sync = ev.name in SYNC_CALLS if on_device else ev.name == "aten::item"
            if on_device and not is_sync:
                continue  # aten::item's own overhead: host time, not the device timeline's
            if is_sync:
                syncs += 1
                _add(sync_sites, site, ev.duration_us, 1)
                if ev.end_us is not None:
                    sync_ends.append(ev.end_us)
            charge(ev, "sync")
            continue
        if id(ev) in cast_ops and cls != "communication":
            cls = "casts"  # inside a copy: its result's allocation (empty_strided, empty_like)
        if id(ev) in optimizer_ops and cls != "communication":
            cls = "optimizer"  # an optimizer's copies are its step's time, not a cast site
        if cls == "casts":  # aten::to > _to_copy > copy_: one call per copy_, the time of all three
            _add(cast_sites, site, ev.duration_us, int(ev.name == "aten::copy_"))
        if not on_device:
            charge(ev, cls)
    comm: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []
    for ev in device:
        cls = classify(ev.name, on_device=True)
        if on_device:
            charge(ev, cls)
        if ev.start_us is None or ev.name.startswith(("Memcpy", "Memset")):
            continue
        (comm if cls == "communication" else compute).append((ev.start_us, ev.start_us + ev.duration_us))
    comm_union, compute_union = _union(comm), _union(compute)
    comm_us = _measure(comm_union)
    exposed = comm_us - _measure(_intersect(comm_union, compute_union))
    busy = _union([(e.start_us, e.start_us + e.duration_us) for e in device if e.start_us is not None])
    medians, spreads = {}, {}
    for c in OP_CLASSES:
        if by_step:
            values = [row[c] + pooled[c] / len(by_step) for row in by_step]
            medians[c], spreads[c] = statistics.median(values), (max(values) - min(values)) / 2
        else:
            medians[c], spreads[c] = pooled[c] / per, 0.0
    return OpBreakdown(
        timeline="device" if on_device else "host",
        class_us=tuple((c, medians[c]) for c in OP_CLASSES),
        syncs=syncs / per,
        sync_idle_us=_idle_after(busy, sync_ends) / per if on_device else 0.0,
        sync_sites=_top(sync_sites, per),
        cast_sites=_top(cast_sites, per),
        comm_us=comm_us / per,
        exposed_comm_us=max(0.0, exposed) / per,
        class_spread_us=tuple((c, spreads[c]) for c in OP_CLASSES),
        stalls=tuple((ev.name, round(us, 1), sites.get(id(ev)) or ev.site) for ev, us in stalls),
    )


def _may_stall(ev: EventRecord) -> bool:
    """A host aten op that does its own work: a blocking call (a sync, a runtime call waiting for the
    device) takes as long as what it waits for, and a device event's name does not say its size."""
    return (
        not ev.python
        and not ev.on_device
        and ev.name.startswith("aten::")
        and classify(ev.name, on_device=False) != "sync"
    )


def _step_index(starts: list[float], spans: list[tuple[float, float]], t: float | None) -> int:
    """The step span ``t`` falls in (-1: none, or unknown)."""
    if t is None or not spans:
        return -1
    k = bisect.bisect_right(starts, t) - 1
    return k if k >= 0 and t < spans[k][1] else -1


def _without_stalls(
    evs: list[EventRecord], spans: list[tuple[float, float]]
) -> tuple[list[EventRecord], list[tuple[EventRecord, float]]]:
    """``evs`` with each stall (see :func:`op_breakdown`) at the median time of its kind, and the stalls
    with the time each took. Only ops of a kind called at least three times can be told from their
    kind's usual time."""
    if not spans:
        return evs, []
    walls = sorted(b - a for a, b in spans)
    floor_us = STALL_STEP_SHARE * walls[len(walls) // 2]
    # the calls that may be stalls: their kinds' calls are gathered, and only they are looked at again
    candidates = [i for i, ev in enumerate(evs) if ev.duration_us >= floor_us and _may_stall(ev)]
    if not candidates:
        return evs, []
    kinds: dict[tuple[str, tuple[tuple[int, ...], ...]], list[float]] = {
        (evs[i].name, evs[i].input_shapes): [] for i in candidates
    }
    for ev in evs:
        times = kinds.get((ev.name, ev.input_shapes))
        if times is not None and _may_stall(ev):
            times.append(ev.duration_us)
    usual = {k: statistics.median(v) for k, v in kinds.items() if len(v) >= 3}
    outliers: list[tuple[int, float]] = []  # (index, the kind's usual time)
    for i in candidates:
        ev = evs[i]
        typical = usual.get((ev.name, ev.input_shapes))
        if typical is not None and ev.duration_us >= STALL_FACTOR * max(typical, 1.0):
            outliers.append((i, typical))
    # a slow call that recurs in most steps is the op's own time (the step does it), not a stall
    starts = [a for a, _ in spans]
    steps_hit: dict[tuple[str, tuple[tuple[int, ...], ...]], set[int]] = {}
    for i, _ in outliers:
        ev = evs[i]
        steps_hit.setdefault((ev.name, ev.input_shapes), set()).add(_step_index(starts, spans, ev.start_us))
    recurring = {k for k, hit in steps_hit.items() if len(hit) * 2 > len(spans)}
    out, stalls = list(evs), []
    for i, typical in outliers:
        ev = evs[i]
        if (ev.name, ev.input_shapes) not in recurring:
            stalls.append((ev, ev.duration_us))
            out[i] = dataclasses.replace(ev, duration_us=typical)
    return out, stalls


def _add(table: dict[str, list[float]], site: str | None, us: float, calls: int) -> None:
    row = table.setdefault(site or "(no user frame recorded)", [0.0, 0.0])
    row[0] += calls
    row[1] += us


def _top(table: dict[str, list[float]], per: int) -> tuple[tuple[str, float, float], ...]:
    rows = sorted(_by_line(table).items(), key=lambda kv: -kv[1][1])[:_MAX_SITES]
    return tuple((site, n / per, round(us / per, 1)) for site, (n, us) in rows)


_IN_MODULE = " in "


def _by_line(table: dict[str, list[float]]) -> dict[str, list[float]]:
    """One row per line of code: the same line run by several modules (each block of a stack) is one
    site, its module paths merged (``blocks.*.attn (Attn)``, see :func:`merge_paths`)."""
    lines: dict[str, tuple[list[float], list[str]]] = {}
    for site, (calls, us) in table.items():
        line, _, path = site.partition(_IN_MODULE)
        row, paths = lines.setdefault(line, ([0.0, 0.0], []))
        row[0] += calls
        row[1] += us
        if path:
            paths.append(path)
    return {
        (f"{line}{_IN_MODULE}{merge_paths(paths)}" if paths else line): row
        for line, (row, paths) in lines.items()
    }


def merge_paths(paths: Sequence[str]) -> str:
    """Module paths as one: equal ones as they are, paths that differ only in their indices with ``*``
    there (each of up to three classes on its own), else the first two and how many more.

    >>> merge_paths(["blocks.0.attn (Attn)", "blocks.11.attn (Attn)"])
    'blocks.*.attn (Attn)'
    >>> merge_paths(["0 (Linear)", "2 (Linear)"])
    '* (Linear)'
    >>> merge_paths(["b.0.a (Attn)", "b.0.a.proj (Linear)", "b.1.a (Attn)", "b.1.a.proj (Linear)"])
    'b.*.a (Attn), b.*.a.proj (Linear)'
    >>> merge_paths(["enc (Encoder)", "dec (Decoder)", "head (Linear)", "norm (LayerNorm)"])
    'enc (Encoder), dec (Decoder) and 2 more'
    """
    unique = list(dict.fromkeys(paths))
    if len(unique) == 1:
        return unique[0]
    by_class: dict[str, list[str]] = {}
    for p in unique:
        by_class.setdefault(p.rsplit(" (", 1)[-1] if p.endswith(")") else "", []).append(p)
    if 1 < len(by_class) <= 3:  # one line run in modules of a few classes: each class merged on its own
        merged = [merge_paths(group) for group in by_class.values()]
        if not any(" and " in m or ", " in m for m in merged):
            return ", ".join(merged)
    split = [p.rsplit(" (", 1) if p.endswith(")") and " (" in p else [p, ""] for p in unique]
    classes = {cls for _, cls in split}
    parts = [path.split(".") for path, _ in split]
    if len(classes) == 1 and len({len(p) for p in parts}) == 1:
        merged = []
        for tokens in zip(*parts):
            if len(set(tokens)) == 1:
                merged.append(tokens[0])
            elif all(t.isdigit() for t in tokens):
                merged.append("*")
            else:
                break
        else:
            cls = classes.pop()
            return ".".join(merged) + (f" ({cls}" if cls else "")
    more = f" and {len(unique) - 2} more" if len(unique) > 2 else ""
    return ", ".join(unique[:2]) + more


def _enclosures(events: list[EventRecord]) -> tuple[set[int], set[int], dict[int, str]]:
    """Per host op: whether an optimizer span encloses it, whether a cast/copy op does (the
    ``empty_strided`` a ``_to_copy`` allocates its result with is part of the copy's cost), and its
    innermost user Python frame.

    One sweep per thread over the spans in start order, keeping the open ones on a stack.
    """
    optimizer: set[int] = set()
    in_cast: set[int] = set()
    sites: dict[int, str] = {}
    by_thread: dict[int, list[EventRecord]] = {}
    for ev in events:
        if not ev.on_device and ev.start_us is not None:
            by_thread.setdefault(ev.thread, []).append(ev)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.start_us, -(e.end_us or 0.0)))
        # the open spans, innermost last, each (end, site, kind, cast): the innermost user frame's or
        # op's site among it and the spans around it; the innermost kind other than "cast" among them,
        # "opt" (an optimizer span) or "closure" (the closure an optimizer's step calls: Lightning runs
        # forward and backward there; they are not the optimizer's ops); whether a copy op is among
        # them. Each span carries what it inherits, so an op reads the innermost one alone
        open_spans: list[tuple[float, str | None, str | None, bool]] = []
        for ev in evs:
            start = ev.start_us or 0.0
            while open_spans and open_spans[-1][0] <= start:
                open_spans.pop()
            _, site, kind, cast = open_spans[-1] if open_spans else (0.0, None, None, False)
            if ev.python:
                frame = None if is_library_file(ev.name) else user_frame((ev.name,))
                closure = _CLOSURE_FRAME.search(ev.name) is not None
                open_spans.append((ev.end_us or start, frame or site, "closure" if closure else kind, cast))
                continue
            if kind == "opt":
                optimizer.add(id(ev))
            if cast:
                in_cast.add(id(ev))
            if site is not None:
                sites[id(ev)] = site
            if _OPTIMIZER_SPAN.match(ev.name):
                open_spans.append((ev.end_us or start, site, "opt", cast))
            elif ev.end_us is not None and ev.end_us > start and _is_cast(ev):
                open_spans.append((ev.end_us, ev.site or site, kind, True))
            elif ev.site is not None and ev.end_us is not None and ev.end_us > start:
                # an op whose site the reader knew (the line of the call): what runs inside it, such as
                # the blocking CUDA runtime call inside aten::item, was made by that line too
                open_spans.append((ev.end_us, ev.site, kind, cast))
    return optimizer, in_cast, sites


def _is_cast(ev: EventRecord) -> bool:
    return not ev.python and not ev.on_device and classify(ev.name, on_device=False) == "casts"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _measure(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _idle_after(busy: list[tuple[float, float]], sync_ends: list[float]) -> float:
    """Device idle time in the gaps of ``busy`` (a sorted union) that a sync ended in: the device ran
    dry while the host waited, and stayed idle until the host launched again. Each gap counts once."""
    if len(busy) < 2:
        return 0.0
    starts = [a for a, _ in busy]
    gaps: set[int] = set()
    for t in sync_ends:
        k = bisect.bisect_right(starts, t)  # busy[k - 1] starts at or before t
        if 0 < k < len(busy) and busy[k - 1][1] <= t:
            gaps.add(k)
    return sum(busy[k][0] - busy[k - 1][1] for k in gaps)
