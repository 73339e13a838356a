"""A bounded torch.profiler window over a few training steps, and what the report needs from it.

:class:`ProfileWindow` is the setting (how many steps to skip, wait, warm up and record);
:class:`StepProfiler` runs ``torch.profiler`` over exactly that window (CPU, plus CUDA where
available), stops it as soon as the window is recorded (no profiler is left running, also after an
exception: :meth:`StepProfiler.stop`), writes the Chrome trace gzipped into the log dir (deleted again
if larger than ``max_trace_bytes``) and condenses the events into a :class:`ProfileSummary`: step wall
time, kernel count and sizes, host-to-device copy time, matmul shapes and dtypes. The heavy part
(trace export, key averages) happens in :meth:`StepProfiler.summarize`, called once at the end of
the run, not inside the training loop.

Example:
    >>> ProfileWindow(active=2).steps_needed
    9
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import gzip
import math
import re
import shutil
import statistics
import sys
import tempfile
import threading
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.host.quiet import native_stderr_silenced
from resource_guard.observe.opclasses import (
    STALL_STEP_SHARE,
    SYNC_CALLS,
    EventRecord,
    classify,
    frame_matters,
    is_library_file,
    op_breakdown,
)
from resource_guard.report.types import ProfileSummary

__all__ = ["ProfileWindow", "ProfileSummary", "EventRecord", "StepProfiler", "summarize_events", "op_sites"]

_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
_TOP_OPS = 10
_MAX_SHAPES = 20


@dataclass(frozen=True)
class ProfileWindow:
    """Which steps torch.profiler records (``torch.profiler.schedule`` with ``repeat=1``).

    Attributes:
        wait: steps idle after ``skip_first`` before warming up.
        warmup: steps traced but discarded (the profiler's own start-up cost lands here).
        active: steps recorded (at most 20: the window is meant to be small).
        skip_first: steps left alone at the start of the run (data-loader start, lazy inits).
        max_trace_bytes: a gzipped trace above this size is deleted (the summary is kept).
        record_shapes: record input shapes and dtypes (needed by the alignment and precision rules).
        with_stack: record the Python stack of each op (the user's lines behind syncs and casts);
            like everything else here it costs only inside the warm-up and active steps.
    """

    wait: int = 1
    warmup: int = 1
    active: int = 3
    skip_first: int = 5
    max_trace_bytes: int = 50 * 2**20
    record_shapes: bool = True
    with_stack: bool = True

    def __post_init__(self) -> None:
        for name, low in (
            ("wait", 0),
            ("warmup", 0),
            ("active", 1),
            ("skip_first", 0),
            ("max_trace_bytes", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigurationError(f"`ProfileWindow({name}={value!r})` must be an int >= {low}")
        if self.active > 20:
            raise ConfigurationError(
                f"`ProfileWindow(active={self.active!r})` must be <= 20 (a bounded window)"
            )

    @property
    def steps_needed(self) -> int:
        """Steps the run must have for the window to complete."""
        return self.skip_first + self.wait + self.warmup + self.active


def _misaligned(shapes: tuple[tuple[int, ...], ...]) -> bool:
    """A matrix dimension (last two of each 2-D+ input) that is not a multiple of 8."""
    return any(d % 8 for s in shapes if len(s) >= 2 for d in s[-2:])


def summarize_events(events: Iterable[EventRecord], steps: int) -> ProfileSummary:
    """Condense a window's events into a :class:`ProfileSummary` (a pure function).

    ``ProfilerStep#`` events give the step wall time; device events the kernels and copies;
    matmul ops (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``) their shapes and dtypes; all of them
    the time by op class, call sites and exposed communication
    (:func:`resource_guard.observe.opclasses.op_breakdown`). Python frames (``with_stack``) are not ops.
    """
    events = list(events)
    classes = op_breakdown(events, steps)
    per = max(steps, 1)
    step_walls, kernels, device_us, h2d, h2d_pageable = [], [], 0.0, 0.0, 0.0
    matmul_us = fp32_us = misaligned_us = 0.0
    misaligned: dict[tuple[str, tuple[tuple[int, ...], ...]], None] = {}
    ops: dict[str, list[float]] = {}
    for ev in events:
        if ev.name.startswith("ProfilerStep"):
            step_walls.append(ev.duration_us)
            continue
        if ev.python:
            continue
        if ev.on_device:
            device_us += ev.duration_us
            if "Memcpy HtoD" in ev.name:
                h2d += ev.duration_us
                if "Pageable" in ev.name:
                    h2d_pageable += ev.duration_us
            elif not ev.name.startswith(("Memcpy", "Memset")):
                kernels.append(ev.duration_us)
            continue
        row = ops.setdefault(ev.name, [0, 0.0])
        row[0] += 1
        row[1] += ev.duration_us
        if ev.name in _MATMUL_OPS:
            matmul_us += ev.duration_us
            if ev.input_dtypes and all(d in ("float", "") for d in ev.input_dtypes[-2:]):
                fp32_us += ev.duration_us
            if _misaligned(ev.input_shapes):
                misaligned_us += ev.duration_us
                if len(misaligned) < _MAX_SHAPES:
                    misaligned[(ev.name, ev.input_shapes)] = None
    top = sorted(ops.items(), key=lambda kv: -kv[1][1])[:_TOP_OPS]
    return ProfileSummary(
        steps=steps,
        step_wall_us=statistics.median(step_walls) if step_walls else None,
        device_busy_us=device_us / per,
        kernel_count=len(kernels) / per,
        median_kernel_us=statistics.median(kernels) if kernels else None,
        h2d_us=h2d / per,
        h2d_pageable_us=h2d_pageable / per,
        matmul_us=matmul_us / per,
        fp32_matmul_us=fp32_us / per,
        misaligned_matmuls=tuple(misaligned),
        misaligned_matmul_us=misaligned_us / per,
        top_ops=tuple((name, round(n / per), round(us / per, 1)) for name, (n, us) in top),
        op_timeline=classes.timeline,
        op_class_us=tuple((c, round(us, 1)) for c, us in classes.class_us),
        syncs_per_step=classes.syncs,
        sync_idle_us=classes.sync_idle_us,
        sync_sites=classes.sync_sites,
        cast_sites=classes.cast_sites,
        comm_us=classes.comm_us,
        exposed_comm_us=classes.exposed_comm_us,
        op_class_spread_us=tuple((c, round(us, 1)) for c, us in classes.class_spread_us),
        stalls=classes.stalls,
    )


# the utility ops torch's own event list leaves out (``torch.autograd.profiler_util._filter_name``)
_FILTERED = frozenset({
    "[memory]", "[OutOfMemory]", "profiler::_record_function_enter", "profiler::_record_function_enter_new",
    "profiler::_record_function_exit", "aten::is_leaf", "aten::output_nr", "aten::_version",
})  # fmt: skip


def _records(prof: Any) -> list[EventRecord]:
    """The window's events as records: read straight from the profiler's results
    (:func:`_kineto_records`, a few hundredths of a second for 15,000 events), else from its public
    ``FunctionEvent`` list (:func:`_function_event_records`: the same figures, but building that list
    links every event into a tree in Python, about 2 s for the same window with ``with_stack``)."""
    fast = _kineto_records(prof)
    return fast if fast is not None else _function_event_records(prof)


# the guard's own code: ops it runs itself (its optimizer stepper, its probes, its logging) are its work,
# not the user's line that called into it; the demo plays the user
_GUARD_FILE = re.compile(r"(^|/)resource_guard/(?!demo\.py)")
_BACKWARD = "<built-in method run_backward"  # autograd's engine: the ops of the loss's backward


def op_sites(result: Any, wanted: Collection[tuple[str, int]] | None = None) -> dict[tuple[str, int], str]:
    """Each host op's call site, by ``(name, start_ns)``, from the profiler's event tree (``with_stack``):
    the user's line that made the call the op runs in (each Python call records its caller's line at
    the call: ``train.py:42 (train_step)``, not the line its function starts at), with the module path
    of the innermost ``nn.Module`` whose forward ran it (`` in blocks.3.attn.proj (Linear)``).

    Ops that resource_guard runs itself (the guard's optimizer stepper, its probes: the innermost
    non-library function is the guard's) are named ``resource_guard: <function> (the guard's own
    work)``, never the user's line that called into it; a backward the guard starts is the
    user's loss's. Empty where torch has no event tree.

    ``wanted``: only these ops' sites (the ones a report can name): the walk then leaves out the
    subtrees that hold none of them, and reads the Python frames only on the way to them (a window of
    70,000 events, most of them frames, in a few hundredths of a second instead of a few tenths).
    """
    tree = result.experimental_event_tree()
    starts = None if wanted is None else sorted({start for _, start in wanted})
    if starts is not None and not starts:
        return {}
    names = None if wanted is None else {name for name, _ in wanted}
    modules: dict[int, str] = {}  # module pointer -> class name
    parents: dict[int, int | None] = {}  # module pointer -> the module it ran inside
    ops: list[tuple[tuple[str, int], _Context]] = []
    # the nodes above the one visited, each with the context inside it once read (None: not yet)
    path: list[list[Any]] = []
    stack: list[tuple[Any, int]] = [(node, 0) for node in reversed(tree)]
    while stack:
        node, depth = stack.pop()
        del path[depth:]
        if starts is not None:  # a subtree with no wanted op in its time span is left alone
            k = bisect.bisect_left(starts, node.start_time_ns)
            if k == len(starts) or starts[k] > node.end_time_ns:
                continue
        name = node.name
        if name.startswith("aten::") and (names is None or name in names):
            key = (name, node.start_time_ns)
            if wanted is None or key in wanted:
                ops.append((key, _context(path, modules, parents)))
        path.append([node, None])
        stack.extend((child, depth + 1) for child in reversed(node.children))
    paths = _module_paths(modules, parents)
    out: dict[tuple[str, int], str] = {}
    for key, (site, module, guard) in ops:
        if guard is not None:
            out[key] = f"resource_guard: {guard} (the guard's own work)"
            continue
        where = site or "(no user frame recorded)"
        if module is not None:
            where += f" in {paths.get(module) or modules[module]}"
        out[key] = where
    return out


# (the user's line, the innermost module's pointer, the guard's function when the guard's own code runs)
_Context = tuple[str | None, int | None, str | None]


def _context(path: list[list[Any]], modules: dict[int, str], parents: dict[int, int | None]) -> _Context:
    """The context inside the last node of ``path``: each node's read once, from its parent's."""
    k = len(path)
    while k > 0 and path[k - 1][1] is None:
        k -= 1
    ctx: _Context = path[k - 1][1] if k > 0 else (None, None, None)
    for entry in path[k:]:
        ctx = entry[1] = _enter(entry[0], ctx, modules, parents)
    return ctx


def _enter(node: Any, ctx: _Context, modules: dict[int, str], parents: dict[int, int | None]) -> _Context:
    """The context inside ``node``: a Python call names its line (when the caller is the user's) and the
    function that runs from there (the guard's own, or the user's); an op or record function leaves
    the context of the calls around it."""
    fields = node.extra_fields
    caller = getattr(fields, "caller", None)
    if caller is None:
        return ctx
    site, module, guard = ctx
    file = caller.file_name
    if not is_library_file(file):
        site = f"{file}:{caller.line_number} ({caller.function_name})"
    callee = getattr(fields, "callsite", None)
    if callee is not None:  # a Python function: whose code runs from here on
        found = _GUARD_FILE.search(callee.file_name)
        if found:
            guard = f"{callee.function_name} in {callee.file_name[found.start() :].lstrip('/')}"
        elif not is_library_file(callee.file_name):
            guard = None
            # ops made by this function directly (an operator, float(t): no call of their own
            # to take a line from) are the function's; its calls name their own lines
            site = f"{callee.file_name}:{callee.line_number} ({callee.function_name})"
    elif node.name.startswith(_BACKWARD):
        guard = None
    info = getattr(fields, "module", None)
    if info is not None:
        ptr = int(info.self_ptr)
        modules.setdefault(ptr, str(info.cls_name))
        parents.setdefault(ptr, module)
        module = ptr
    return site, module, guard


def _module_paths(modules: dict[int, str], parents: dict[int, int | None]) -> dict[int, str]:
    """``path (Class)`` of each module pointer seen in the window, from the live root modules (the
    outermost ones, found by their address and class among the modules the calling frames hold, else
    among the garbage collector's objects): a root that is gone, or an address now held by another
    object, leaves its modules by class only."""
    roots = {ptr for ptr, up in parents.items() if up is None}
    if not roots:
        return {}
    out: dict[int, str] = {}
    found: set[int] = set()

    def name_from(obj: Any) -> None:
        if id(obj) in roots and isinstance(obj, torch.nn.Module) and type(obj).__name__ == modules[id(obj)]:
            found.add(id(obj))
            for name, sub in obj.named_modules(remove_duplicate=False):
                if id(sub) in modules and id(sub) not in out:
                    cls = type(sub).__name__
                    out[id(sub)] = f"{name} ({cls})" if name else f"{cls} (the model)"

    for obj in _held_modules():  # the callers' own references: cheap, and usually all of them
        name_from(obj)
    if found != roots:  # else the collector's objects (a few tenths of a second in a large process)
        for obj in gc.get_objects():
            if id(obj) in roots and id(obj) not in found:
                name_from(obj)
    return out


_HOLDERS = ("model", "module", "lightning_module", "_model", "net", "_module")
# the frames read: ours and the frameworks' (a guard's ``self``, Lightning's ``trainer``), never the user's.
# On Python < 3.13 reading ``frame.f_locals`` stores a snapshot of the locals on a frame that goes on
# running: a user's frame would then keep what it later ``del``s (a DataLoader's iterator, with its
# worker processes and feeder threads) alive until it returns
_FRAMEWORKS = ("resource_guard", "lightning", "pytorch_lightning", "transformers", "accelerate")


def _held_modules() -> list[Any]:
    """The modules the calling frames of this package and the frameworks hold: their locals, and a
    model held by a local (``self.model`` of a guard, ``trainer.lightning_module``, ``trainer.model``)."""
    out: list[Any] = []
    frame: Any = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.split(".", 1)[0] not in _FRAMEWORKS:
            frame = frame.f_back
            continue
        for value in list(frame.f_locals.values()):
            if isinstance(value, torch.nn.Module):
                out.append(value)
                continue
            for attr in _HOLDERS:
                try:
                    held = getattr(value, attr, None)
                except Exception:  # a property that raises: not a holder
                    continue
                if isinstance(held, torch.nn.Module):
                    out.append(held)
        frame = frame.f_back
    return out


def _kineto_records(prof: Any) -> list[EventRecord] | None:
    """Records from ``prof.profiler.kineto_results`` (``None`` where torch has no such results): the
    events torch's own list would hold, each host op's self time its duration less the ops and Python
    frames directly nested in it on its thread (the nesting ``FunctionEvent`` computes). Python frames
    that cannot change the breakdown (library frames,
    :func:`~resource_guard.observe.opclasses.frame_matters`) are left out of the records: with
    ``with_stack`` they are most of the window's events.

    The work per event is what the summary reads of it: input shapes only for the matmuls and for the
    ops of a name with a call long enough to be a stall (:func:`_stall_floor_us`), dtypes only for the
    matmuls, and call sites (:func:`op_sites`) only for the ops a report can name: copies and casts
    and what runs inside them, scalar reads and the ops a blocking runtime call runs in, and calls
    long enough to be a stall.
    """
    try:
        result = prof.profiler.kineto_results
        events, origin = result.events(), result.trace_start_ns()
    except (AttributeError, TypeError, RuntimeError):
        return None
    try:
        cpu = torch.autograd.DeviceType.CPU
        # (name, on device, start ns, end ns, thread, a Python frame, the event)
        rows: list[tuple[str, bool, int, int, int, bool, Any]] = []
        # host spans (thread, start_ns, -end_ns, name, index in rows or -1 for a frame), for the self times
        spans: list[tuple[int, int, int, str, int]] = []
        for ev in events:
            name = ev.name()
            if name in _FILTERED or ev.is_hidden_event():
                continue
            start, end, thread = ev.start_ns(), ev.end_ns(), ev.start_thread_id()
            if ev.is_python_function():
                if thread == ev.end_thread_id():  # nested in an op, a frame is not that op's own time
                    spans.append((thread, start, -end, name, -1))
                if frame_matters(name):
                    rows.append((name, False, start, end, thread, True, None))
                continue
            on_device = ev.device_type() != cpu
            if not on_device and not ev.is_async() and thread == ev.end_thread_id():
                spans.append((thread, start, -end, name, len(rows)))
            rows.append((name, on_device, start, end, thread, False, ev))
        own_ns, dropped, parent = _self_times(spans)
        floor_us = _stall_floor_us(rows)
        long_ops = {
            r[0] for r in rows if not r[5] and r[0].startswith("aten::") and r[3] - r[2] >= floor_us * 1e3
        }
        try:
            sites = op_sites(result, _site_keys(rows, spans, parent, floor_us))
        except (AttributeError, TypeError, RuntimeError, KeyError):  # a torch without the tree's fields
            sites = {}
        out: list[EventRecord] = []
        for i, (name, on_device, start, end, thread, python, ev) in enumerate(rows):
            if i in dropped:
                continue
            total_us = (end - start) / 1e3
            began_us = (start - origin) / 1e3
            if python:
                out.append(
                    EventRecord(name, False, total_us, (), (), began_us, total_us, int(thread or 0), True)
                )
                continue
            shapes: tuple[tuple[int, ...], ...] = ()
            dtypes: tuple[str, ...] = ()
            if name in long_ops or name in _MATMUL_OPS:
                shapes = tuple(tuple(x) for x in (ev.shapes() or ()) if isinstance(x, (list, tuple)))
                if name in _MATMUL_OPS:
                    dtypes = tuple(str(d) for d in (ev.dtypes() or ()))
            own = own_ns.get(i)
            duration_us = total_us if own is None else own / 1e3
            site = None if on_device else sites.get((name, start))
            out.append(EventRecord(name, on_device, duration_us, shapes, dtypes, began_us, total_us,
                                   int(thread or 0), False, site))  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        return None
    return out


def _stall_floor_us(rows: list[tuple[str, bool, int, int, int, bool, Any]]) -> float:
    """A bound under the shortest call :func:`~resource_guard.observe.opclasses.op_breakdown` can call a
    stall (a share of the median step; here of the shortest step, which a window cut short may drop
    later); ``inf`` without steps."""
    walls = [r[3] - r[2] for r in rows if r[0].startswith("ProfilerStep")]
    return STALL_STEP_SHARE * min(walls) / 1e3 if walls else math.inf


def _site_keys(
    rows: list[tuple[str, bool, int, int, int, bool, Any]],
    spans: list[tuple[int, int, int, str, int]],
    parent: list[int],
    floor_us: float,
) -> set[tuple[str, int]]:
    """``(name, start_ns)`` of the host ops whose call site a report can name (see :func:`_kineto_records`):
    sync and cast ops, every op nested in a cast op, every op a sync call runs in, and every call
    long enough to be a stall. ``spans`` sorted and ``parent`` as :func:`_self_times` left them."""
    keys: set[tuple[str, int]] = set()
    in_cast = [False] * len(spans)
    for k, (_, start, neg_end, name, i) in enumerate(spans):  # parents come before their children
        up = parent[k]
        inherited = up >= 0 and (in_cast[up] or (spans[up][4] >= 0 and _is_cast_op(spans[up][3])))
        in_cast[k] = inherited
        if i < 0 or not name.startswith(("aten::", "cuda")):
            continue
        if name in SYNC_CALLS:  # a blocking runtime call: the ops it runs in name its line
            while up >= 0:
                if spans[up][4] >= 0 and spans[up][3].startswith("aten::"):
                    keys.add((spans[up][3], spans[up][1]))
                up = parent[up]
            continue
        if (
            inherited
            or -neg_end - start >= floor_us * 1e3
            or classify(name, on_device=False) in _SITE_CLASSES
        ):
            keys.add((name, start))
    return {key for key in keys if key[0].startswith("aten::")}


_SITE_CLASSES = frozenset({"sync", "casts"})


def _is_cast_op(name: str) -> bool:
    return classify(name, on_device=False) == "casts"


def _self_times(spans: list[tuple[int, int, int, str, int]]) -> tuple[dict[int, int], set[int], list[int]]:
    """Each host op's self time in ns (by index into the rows; only ops with children), the rows
    dropped, and each span's parent (index into ``spans``, sorted here; -1: none): an op's self time is
    its duration less its direct children's (spans nested in it on its thread), after torch's merging of
    an op's only child of the same name into it (``aten::div`` calling ``aten::div``: one op, not two)."""
    spans.sort()  # by thread, then start, the longer first
    parent = [-1] * len(spans)
    kids: dict[int, list[int]] = {}  # only the spans with children (most frames have none)
    stack: list[int] = []
    for k, (thread, start, neg_end, _, _) in enumerate(spans):
        while stack and (
            spans[stack[-1]][0] != thread or start >= -spans[stack[-1]][2] or -neg_end > -spans[stack[-1]][2]
        ):
            stack.pop()
        if stack:
            parent[k] = stack[-1]
            kids.setdefault(stack[-1], []).append(k)
        stack.append(k)
    dropped: set[int] = set()  # indices into the rows
    for k in range(len(spans) - 1, -1, -1):  # innermost first
        up = parent[k]
        if up < 0 or spans[k][4] < 0 or spans[up][3] != spans[k][3] or kids.get(up) != [k]:
            continue
        inner = kids.pop(k, [])
        kids[up] = inner  # torch keeps the outer op, which takes the inner one's children
        for c in inner:
            parent[c] = up
        dropped.add(spans[k][4])
    own: dict[int, int] = {}
    for k, nested in kids.items():
        _, start, neg_end, name, i = spans[k]
        if i < 0 or i in dropped or not nested or name.startswith("ProfilerStep"):
            continue
        own[i] = -neg_end - start - sum(-spans[c][2] - spans[c][1] for c in nested)
    return own, dropped, parent


def _function_event_records(prof: Any) -> list[EventRecord]:
    """Public ``FunctionEvent`` fields (``device_type``, ``self_*_time_total``, ``input_*``) as records."""
    out = []
    for ev in prof.events():
        on_device = ev.device_type != torch.autograd.DeviceType.CPU
        is_step = ev.name.startswith("ProfilerStep")
        if is_step:
            duration = ev.cpu_time_total
        else:
            duration = ev.self_device_time_total if on_device else ev.self_cpu_time_total
        shapes = tuple(tuple(s) for s in (ev.input_shapes or ()) if isinstance(s, (list, tuple)))
        dtypes = tuple(str(d) for d in (getattr(ev, "input_dtypes", None) or ()))
        span = ev.time_range
        out.append(
            EventRecord(
                ev.name,
                on_device,
                float(duration),
                shapes,
                dtypes,
                start_us=float(span.start),
                total_us=float(span.end - span.start),
                thread=int(ev.thread or 0),
                python=bool(getattr(ev, "is_python_function", False)),
            )
        )
    return out


class StepProfiler:
    """torch.profiler over one :class:`ProfileWindow`. Call :meth:`step` after every training step.

    Args:
        window: which steps to record.
        trace_dir: where the gzipped trace goes (``None``: no trace file).
        device_type: ``"cuda"`` adds CUDA activity when CUDA is available.
        trace_name: file name stem of the trace (e.g. ``"rank0"``).

    Errors from torch.profiler propagate to the caller (the monitor turns them into one warning).
    """

    def __init__(
        self,
        window: ProfileWindow,
        trace_dir: Path | None,
        *,
        device_type: str = "cpu",
        trace_name: str = "rank0",
    ) -> None:
        self.window = window
        self._trace_dir = trace_dir
        self._device_type = device_type
        self._trace_name = trace_name
        self._prof: Any = None
        self._captured: Any = None
        self._steps_seen = 0
        self._finished = False
        self._cut_short = False

    @property
    def running(self) -> bool:
        return self._prof is not None

    @property
    def traces_next_step(self) -> bool:
        """Whether the step after the last :meth:`step` runs traced (the schedule's warm-up or active
        steps): slowed by the profiler's own work (``record_shapes``, ``with_stack``)."""
        w = self.window
        return self._prof is not None and w.skip_first + w.wait <= self._steps_seen < w.steps_needed

    def start(self) -> None:
        """Start the profiler (idempotent). Nothing is recorded before ``skip_first + wait`` steps."""
        if self._prof is not None or self._finished:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device_type == "cuda" and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        w = self.window
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=w.wait, warmup=w.warmup, active=w.active, repeat=1, skip_first=w.skip_first
            ),
            on_trace_ready=self._on_trace_ready,
            record_shapes=w.record_shapes,
            with_stack=w.with_stack,
        )
        with native_stderr_silenced():  # Kineto's native `profiler_start` line is not the user's
            prof.start()
        self._prof = prof

    def _on_trace_ready(self, prof: Any) -> None:
        self._captured = prof

    def step(self) -> None:
        """Advance the schedule; stops the profiler as soon as the window has been recorded."""
        prof = self._prof
        if prof is None:
            return
        self._steps_seen += 1
        with native_stderr_silenced():  # the schedule starts/stops Kineto inside step()
            prof.step()
        if self._captured is not None or self._steps_seen >= self.window.steps_needed:
            self.stop()

    def stop(self) -> None:
        """Stop the profiler now (idempotent); a window cut short keeps what it recorded."""
        prof, self._prof = self._prof, None
        if prof is not None:
            self._finished = True
            recorded = self._captured is not None
            with native_stderr_silenced():
                prof.stop()
            self._cut_short = not recorded and self._captured is not None

    def summarize(self) -> ProfileSummary | None:
        """Summary of the recorded window and the trace file; ``None`` if nothing was recorded."""
        self.stop()
        prof, self._captured = self._captured, None
        if prof is None:
            return None
        notes: list[str] = []
        # the trace is written first (torch holds the interpreter lock for it); its compression runs on a
        # thread while the events are read (zlib lets go of the lock)
        trace = self._export(prof)
        try:
            with _gc_paused():  # tens of thousands of short-lived tuples: no full collection in between
                records = _records(prof)
                if self._cut_short:  # the last ProfilerStep span runs from the last step() to stop()
                    last = max(
                        (i for i, r in enumerate(records) if r.name.startswith("ProfilerStep")), default=None
                    )
                    records = [r for i, r in enumerate(records) if i != last]
                steps = sum(1 for r in records if r.name.startswith("ProfilerStep"))
                if steps < self.window.active:
                    notes.append(
                        f"the run ended inside the profiler window: {steps} of {self.window.active} steps"
                    )
                summary = summarize_events(records, steps)
        finally:
            path = None if trace is None else trace.finish(notes)
        return dataclasses.replace(summary, trace_path=path, notes=tuple(notes))

    def _export(self, prof: Any) -> _TraceFile | None:
        """Write the window's Chrome trace as JSON and start compressing it (see :class:`_TraceFile`)."""
        if self._trace_dir is None:
            return None
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        path = self._trace_dir / f"{self._trace_name}.pt.trace.json.gz"
        return _TraceFile(prof, path, self.window.max_trace_bytes)


class _TraceFile:
    """The window's gzipped Chrome trace at ``path``: torch writes the JSON (a ".gz" path it would gzip
    line by line at level 9: 0.6 s for a 15,000-event window); it is compressed here at level 1 in 1 MiB
    blocks (a few times faster), on a thread of its own, while the caller goes on; :meth:`finish` waits
    for it and deletes a file larger than ``max_bytes``."""

    def __init__(self, prof: Any, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        self._scratch = tempfile.TemporaryDirectory(dir=path.parent)
        self._error: BaseException | None = None
        try:
            plain = Path(self._scratch.name) / "trace.json"
            prof.export_chrome_trace(str(plain))
        except BaseException:
            self._scratch.cleanup()
            raise
        self._thread = threading.Thread(target=self._compress, args=(plain,), daemon=True)
        self._thread.start()

    def _compress(self, plain: Path) -> None:
        try:
            with plain.open("rb") as source, gzip.open(self.path, "wb", compresslevel=1) as target:
                shutil.copyfileobj(source, target, 1 << 20)
        except BaseException as exc:  # raised again by finish(), on the caller's thread
            self._error = exc

    def finish(self, notes: list[str]) -> str | None:
        """The trace's path once written (``None``: deleted for its size, with a note); raises what the
        compression raised."""
        self._thread.join()
        self._scratch.cleanup()
        if self._error is not None:
            raise self._error
        size = self.path.stat().st_size
        if size > self.max_bytes:
            with contextlib.suppress(OSError):
                self.path.unlink()
            notes.append(f"trace of {size} bytes exceeded max_trace_bytes={self.max_bytes}; deleted")
            return None
        return str(self.path)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a block that makes many objects and no cycles: in a process
    holding a framework's objects, a full collection it would trigger costs a tenth of a second."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
