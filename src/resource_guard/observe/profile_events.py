r"""The profiler window's events as :class:`~resource_guard.observe.opclasses.EventRecord`\ s: read
straight from torch's results (:func:`kineto_records`), each host op with its self time and, for the ops
a report can name, its call site from the profiler's event tree (:func:`op_sites`); else from torch's
public ``FunctionEvent`` list (:func:`function_event_records`, the same figures, slower).

The work per event is what the summary reads of it (issue #40: closing a run costs under a second): a
window recorded with stacks holds tens of thousands of Python frames, read once and left out of the
records unless they can change the breakdown (:func:`~resource_guard.observe.opclasses.frame_matters`).
"""

from __future__ import annotations

import bisect
import gc
import math
import re
import sys
from collections.abc import Collection
from typing import Any

import torch

from resource_guard.observe.opclasses import (
    STALL_STEP_SHARE,
    SYNC_CALLS,
    EventRecord,
    classify,
    frame_matters,
    is_library_file,
)

__all__ = ["MATMUL_OPS", "records", "op_sites", "kineto_records", "function_event_records"]

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")


# the utility ops torch's own event list leaves out (``torch.autograd.profiler_util._filter_name``)
_FILTERED = frozenset({
    "[memory]", "[OutOfMemory]", "profiler::_record_function_enter", "profiler::_record_function_enter_new",
    "profiler::_record_function_exit", "aten::is_leaf", "aten::output_nr", "aten::_version",
})  # fmt: skip


def records(prof: Any) -> list[EventRecord]:
    """The window's events as records: read straight from the profiler's results
    (:func:`kineto_records`, a few hundredths of a second for 15,000 events), else from its public
    ``FunctionEvent`` list (:func:`function_event_records`: the same figures, but building that list
    links every event into a tree in Python, about 2 s for the same window with ``with_stack``)."""
    fast = kineto_records(prof)
    return fast if fast is not None else function_event_records(prof)


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


def kineto_records(prof: Any) -> list[EventRecord] | None:
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
            if name in long_ops or name in MATMUL_OPS:
                shapes = tuple(tuple(x) for x in (ev.shapes() or ()) if isinstance(x, (list, tuple)))
                if name in MATMUL_OPS:
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
    """``(name, start_ns)`` of the host ops whose call site a report can name (see :func:`kineto_records`):
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


def function_event_records(prof: Any) -> list[EventRecord]:
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
