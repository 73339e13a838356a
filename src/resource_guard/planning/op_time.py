"""A per-operator step-time model on this CPU: FLOPs and bytes of every traced operator, calibrated.

The memory estimate runs the training step on fake tensors; :func:`count_step_ops` listens to that
same trace (:func:`~resource_guard.estimate.trace.tracer.observe_ops`) and gives every operator a class,
its FLOPs and its bytes moved:

- **matmul / conv / attention**: FLOPs by formula (``torch.utils.flop_counter``'s registry; the CPU's
  fused attention ``_scaled_dot_product_flash_attention_for_cpu`` by its two matmuls, its backward by
  five); a matmul's layout (``nt``: a Linear's forward); a fused LSTM layer by its projections and its
  time steps;
- **copy** (casts, clones, concatenations) and **elementwise / other**: the bytes of their inputs and
  outputs; autocast's casts, float32 + bfloat16 operators, dropout's ``bernoulli_``, max-pooling and
  gelu's backward by their own calibrated rates;
- **view** (metadata only): no kernel.

:func:`cpu_calibration` measures, once per CPU profile and thread count (cached for the process; on one
thread in this thread's CPU time, so a shared machine's load does not move it), in about 1-2 s:
matmuls per dtype and layout at three sizes over operands out of the cache (small matmuls are far from
peak), elementwise passes in and out of the cache, casts, the fused attention forward and backward at
two head sizes, a convolution, an LSTM's time step, and two small **real training steps** (2 and 8
blocks of Linear, LayerNorm, GELU; AdamW) whose slope gives the host time per traced operator as a step
pays it (dispatch, autograd's graph and engine, the module calls and the Python between operators),
their intercept the fixed time per micro-step, and AdamW's update the time per optimizer operator.
An operator's time is then its kernel (``max(FLOPs / rate(dtype, size, layout), bytes / bandwidth)``;
the optimizer's states read out of the cache) plus its host time (class ``"framework"``), and a step of
``k`` accumulation micro-steps is ``k × micro-step + (k − 1) × accumulation + optimizer`` (the
optimizer's code path as it runs on the CPU). The result is a :class:`StepTimePrediction`, by class.

Checked against real steps by ``benchmarks/plan_quality.py --speed`` (8 models, every fitting
configuration; ``benchmarks/README.md``).

Example:
    >>> import torch
    >>> model = OpTimeModel(cpu_calibration())
    >>> p = model.predict(torch.nn.Linear(64, 64), torch.optim.SGD(torch.nn.Linear(64, 64).parameters()),
    ...                   torch.randn(8, 64), lambda m, b: m(b).sum(), precision="32-true")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from resource_guard.devices import cpu_profile

__all__ = [
    "OP_CLASSES",
    "CpuCalibration",
    "OpTimeModel",
    "StepOps",
    "StepTimeModel",
    "StepTimePrediction",
    "classify_op",
    "count_step_ops",
    "cpu_calibration",
]

OP_CLASSES = ("matmul", "conv", "attention", "transcendental", "elementwise", "copy", "view", "framework")
_MATMUL_LIKE = ("matmul", "conv", "attention")
_CALIBRATED_DTYPES = (torch.float32, torch.bfloat16)
_MATMUL_SIZES = (64, 192, 512)  # n of an n×n×n matmul: 0.5, 14 and 268 MFLOP
_COPY_NUMELS = (2**14, 2**18, 2**22)  # 64 KiB, 1 MiB and 16 MiB of fp32
_COLD_NUMEL, _COLD_TENSORS = 2**20, 16  # 64 MiB of fp32, past any last-level cache of one core's share
_LAYOUTS = ("nn", "nt", "tn")
_MATMUL_POOL_BYTES = 16 * 2**20  # the operands a calibration matmul rotates through: past the caches
_COPY_NAMES = frozenset(
    {"_to_copy", "copy_", "clone", "contiguous", "cat", "stack", "_copy_from", "index_select", "gather"}
)
# elementwise operators bound by their arithmetic (exp, erf) rather than by memory on a CPU
_TRANSCENDENTAL = (
    "softmax", "gelu", "exp", "tanh", "sigmoid", "erf", "silu", "layer_norm", "pow",
)  # fmt: skip
# operators far slower than their bytes say (random numbers; bfloat16 max-pooling and gelu's backward),
# timed by elements
_NAMED_RATES = ("bernoulli_", "max_pool2d_with_indices", "gelu_backward")
# operators the fake trace shows that a real step does not pay for (a fresh gradient's detach, aliases)
_TRACE_ONLY = frozenset({"detach", "alias", "lift_fresh", "sym_size"})
_NO_WORK = frozenset(
    {"detach", "alias", "_unsafe_view", "empty", "empty_like", "empty_strided", "lift_fresh", "sym_size"}
)


# -- counting ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpWork:
    """One traced operator: its class, FLOPs, bytes moved and the dtype it computes in.

    ``flops`` of a ``"transcendental"`` operator counts the elements of its largest input instead.
    ``name``: the ATen operator (``"addmm"``); ``phase``: ``"forward"``, ``"backward"`` or ``"optimizer"``;
    ``variant``: a matmul's layout (``"nt"``: its second operand a transposed view; ``"rnn"``: a fused
    recurrent layer, run as ``steps`` sequential time steps), an attention's ``"forward"`` /
    ``"backward"`` (over ``steps`` heads: batch × heads), a copy's ``"cast"`` (dtype change).
    ``shape``: a matmul's ``(batch, m, n, k)`` and an attention's ``(batch × heads, queries, keys, head
    size)`` (a GPU's tiles and waves depend on them); empty for other operators. A causal attention's
    ``flops`` count the half its kernel computes.
    """

    op_class: str
    flops: float
    bytes: int
    dtype: torch.dtype
    name: str = ""
    phase: str = ""
    variant: str = ""
    steps: int = 1
    shape: tuple[int, ...] = ()


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            seen.setdefault(id(t), t)
    return list(seen.values())


def _arg(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs.get(name, default) if a.kwarg_only or i >= len(args) else args[i]
    return default


def _registry_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float | None:
    """FLOPs from ``torch.utils.flop_counter``'s formulas (the registry FlopCounterMode uses), or None.

    The one place that reads the registry: ``tests/planning/test_op_time.py`` fails loudly if it moves.
    """
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return None
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that does not take this overload: counted by bytes
        return None


def _cpu_attention_flops(func: Any, args: tuple, kwargs: dict) -> float:
    """The CPU's fused attention: ``QKᵀ`` and ``PV`` forward (4·B·H·L·S·E), 2.5× that backward; causal ÷ 2."""
    backward = func.__name__.split(".")[0].endswith("_backward")
    q, k, v = (_arg(func, args, kwargs, n) for n in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return 0.0
    lead = math.prod(q.shape[:-2])
    forward = 2.0 * lead * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    causal = bool(_arg(func, args, kwargs, "is_causal", False))
    return forward * (2.5 if backward else 1.0) * (0.5 if causal else 1.0)


def _is_transposed(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.stride(-1) != 1 and t.stride(-2) == 1


def _matmul_layout(name: str, args: tuple) -> str:
    """``"nn"``, ``"nt"``, ``"tn"`` or ``"tt"``: which operands of a matmul are transposed views."""
    operands = args[1:3] if name in ("addmm", "baddbmm") else args[:2]
    if len(operands) < 2:
        return ""
    return "".join("t" if _is_transposed(t) else "n" for t in operands)


def _matmul_shape(name: str, args: tuple) -> tuple[int, ...]:
    """``(batch, m, n, k)`` of ``mm``/``addmm``/``bmm``/``baddbmm`` (empty for other operators)."""
    operands = args[1:3] if name in ("addmm", "baddbmm") else args[:2]
    if len(operands) < 2 or not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in operands):
        return ()
    a, b = operands
    return (math.prod(a.shape[:-2]), int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1]))


def _rnn_flops(name: str, ins: list[torch.Tensor]) -> float:
    """A fused recurrent layer (``mkldnn_rnn_layer``): its input and hidden projections, 2× backward."""
    floats = [t for t in ins if t.is_floating_point()]
    if not floats or floats[0].dim() < 2:
        return 0.0
    rows = floats[0].numel() // floats[0].shape[-1]  # time steps × batch
    weights = sum(t.numel() for t in floats[1:] if t.dim() == 2)
    return 2.0 * rows * weights * (2.0 if "backward" in name else 1.0)


def classify_op(func: Any, args: tuple, kwargs: dict, out: Any) -> OpWork:
    """The class, FLOPs and bytes moved of one ATen operator call (fake or real tensors).

    Example:
        >>> a, b = torch.ones(4, 8), torch.ones(8, 2)
        >>> w = classify_op(torch.ops.aten.mm.default, (a, b), {}, a @ b)
        >>> w.op_class, w.flops, w.bytes, w.variant
        ('matmul', 128.0, 224, 'nn')
    """
    name = func.__name__.split(".")[0]
    ins, outs = _tensors((args, kwargs)), _tensors(out)
    dtype = next((t.dtype for t in (*outs, *ins) if t.is_floating_point()), torch.float32)

    def work(op_class: str, flops: float, moved: int, variant: str = "") -> OpWork:
        return OpWork(op_class, flops, moved, dtype, name, variant=variant)

    if getattr(func, "is_view", False) or name in _NO_WORK:
        return work("view", 0.0, 0)
    outs = [t for t in outs if all(t is not i for i in ins)]  # an in-place op's output is its input
    moved = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
    if name == "embedding":  # reads the rows it gathers, not the table
        moved = 2 * sum(map(_nbytes, outs)) + sum(_nbytes(t) for t in ins if not t.is_floating_point())
    if name.startswith("nll_loss"):  # reads one score per row (the target's), not the whole row
        moved = sum(_nbytes(t) for t in outs if t.numel() <= 1) + sum(
            2 * _nbytes(t) for t in ins if not t.is_floating_point()
        )
        if "backward" in name:  # writes its full-size gradient (mostly zeros)
            moved += sum(map(_nbytes, outs))
    if "attention" in name:
        flops = _registry_flops(func, args, kwargs, out)
        variant = "backward" if "backward" in name else "forward"
        causal = bool(_arg(func, args, kwargs, "is_causal", False))
        if flops is None:
            flops = _cpu_attention_flops(func, args, kwargs)
        elif causal:  # the registry counts a causal attention whole; its kernel skips the masked half
            flops *= 0.5
        query, key = _arg(func, args, kwargs, "query"), _arg(func, args, kwargs, "key")
        heads = math.prod(query.shape[:-2]) if isinstance(query, torch.Tensor) and query.dim() > 2 else 1
        shape: tuple[int, ...] = ()
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() >= 2:
            shape = (int(heads), int(query.shape[-2]), int(key.shape[-2]), int(query.shape[-1]))
        return dataclasses.replace(work("attention", flops, moved, variant), steps=int(heads), shape=shape)
    if "rnn" in name or "lstm" in name or "gru" in name:
        first = ins[0] if ins else None  # time-major here whatever the module's batch_first
        steps = first.shape[0] if first is not None and first.dim() == 3 else 1
        # the weights are read again at every time step
        weights = sum(_nbytes(t) for t in ins[1:] if t.is_floating_point() and t.dim() == 2)
        moved += (int(steps) - 1) * weights * (2 if "backward" in name else 1)
        return dataclasses.replace(work("matmul", _rnn_flops(name, ins), moved, "rnn"), steps=int(steps))
    flops = _registry_flops(func, args, kwargs, out)
    if flops is not None:
        if "conv" in name:
            return work("conv", flops, moved, "backward" if "backward" in name else "forward")
        matmul = work("matmul", flops, moved, _matmul_layout(name, args))
        return dataclasses.replace(matmul, shape=_matmul_shape(name, args))
    if name in _NAMED_RATES:  # slow beyond their bytes on a CPU: timed by their own calibrated rate
        return work("elementwise", float(max((t.numel() for t in (*ins, *outs)), default=0)), moved, "named")
    if any(t in name for t in _TRANSCENDENTAL):
        return work("transcendental", float(max((t.numel() for t in ins), default=0)), moved)
    if name in _COPY_NAMES:
        kinds = {t.dtype for t in (*ins, *outs) if t.is_floating_point()}
        return work("copy", 0.0, moved, "cast" if len(kinds) > 1 else "")
    if len({t.dtype for t in ins if t.is_floating_point() and t.dim() > 0}) > 1:  # fp32 + bf16
        return work("elementwise", float(max(t.numel() for t in ins)), moved, "mixed")
    return work("elementwise", 0.0, moved)


@dataclass(frozen=True)
class StepOps:
    """The operators of one traced step: one micro-step's forward and backward, and the optimizer's."""

    micro_step: tuple[OpWork, ...]
    optimizer: tuple[OpWork, ...]
    gradient_bytes: int = 0
    gradient_tensors: int = 0


def count_step_ops(
    model: nn.Module,
    optimizer: Any,
    batch: Any,
    loss_fn: Any = None,
    *,
    precision: str = "32-true",
    checkpoint_every: int = 0,
    device: Any = "cpu",
) -> StepOps:
    """Trace one step on fake tensors (the memory estimate's trace) and list its operators.

    ``checkpoint_every``: 0 none, 1 every block, k every k-th block (the recompute is traced).
    ``device``: the target (a kind or a catalog name/spec): its behaviour is traced (autocast's policy,
    the attention kernel, the optimizer's code path: a for-loop on the CPU, ``foreach`` on a GPU).
    """
    from resource_guard.estimate.estimator import estimate_memory
    from resource_guard.estimate.trace.tracer import observe_ops
    from resource_guard.planning.checkpointing import apply_checkpointing

    seen: list[tuple[str, OpWork]] = []

    def observe(phase: str, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        root = phase.split(":")[0]
        if root in ("forward", "backward", "optimizer"):
            w = classify_op(func, args, kwargs, out)
            seen.append((phase, dataclasses.replace(w, phase=root)))

    handle = apply_checkpointing(model, every=checkpoint_every) if checkpoint_every else None
    try:
        with observe_ops(observe):
            estimate_memory(model, optimizer, batch, loss_fn, device=device, precision=precision)
    finally:
        if handle is not None:
            handle.remove()
    variants = {p for p, _ in seen if p.startswith("optimizer:")}
    # the code path the CPU runs: a for-loop unless the optimizer's settings fix it ("as-set")
    gpu = getattr(device, "kind", device) in ("cuda", "rocm") or (
        isinstance(device, str) and device not in ("cpu", "mps") and "optimizer:foreach" in variants
    )
    default = "optimizer:foreach" if gpu and "optimizer:foreach" in variants else "optimizer:for-loop"
    path = "optimizer:as-set" if "optimizer:as-set" in variants else default
    micro = tuple(w for p, w in seen if p.split(":")[0] in ("forward", "backward"))
    trained = [p for p in model.parameters() if p.requires_grad]
    return StepOps(
        micro,
        tuple(w for p, w in seen if p == path),
        gradient_bytes=sum(_nbytes(p) for p in trained),
        gradient_tensors=len(trained),
    )


# -- calibration ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuCalibration:
    """This CPU's measured speeds (``cpu_calibration``).

    Attributes:
        matmul_flops_per_s: ``(flops of the matmul, FLOP/s)`` points, smallest first, per dtype name
            (``"torch.float32"``: the harmonic mean over layouts) and per dtype and layout
            (``"torch.bfloat16/nt"``: the second operand a transposed view, as in a Linear's forward).
        copy_bytes_per_s: per dtype name, ``(bytes moved, bytes/s)`` points of an elementwise pass over
            data that is in the cache (a forward's freshly made activations), smallest first.
        cold_bytes_per_s: per dtype name, bytes/s of an in-place pass over data that is not in the cache
            (the optimizer's states, touched once a step).
        cast_bytes_per_s: ``(bytes moved, bytes/s)`` points of float32 <-> bfloat16 conversions (autocast's
            casts), smallest first.
        op_overhead_s: host time per traced operator of a real training micro-step beyond its kernel
            (dispatch, autograd's graph and engine, the module calls and Python between operators),
            measured on a small model whose kernels are negligible.
        micro_step_overhead_s: fixed host time of one micro-step (the loss, the backward's start).
        optimizer_op_overhead_s: host time per traced operator of the optimizer's update (its Python
            loop over the parameters, the step counters), measured on AdamW.
        view_overhead_s: host time of one bare view (no kernel, no autograd).
        rnn_step_s: per dtype name, the fixed time of one time step of a fused recurrent layer
            (``mkldnn_rnn_layer``, forward or backward) beyond its matmuls' FLOPs.
        conv_flops_per_s: FLOP/s of a 3×3 convolution per dtype name (forward) and ``"…/backward"``.
        named_per_s: elements/s of operators slower than their bytes, keyed ``"bernoulli_/torch.float32"``
            (dropout's random numbers; ``max_pool2d_with_indices``: bfloat16 pooling is not vectorised).
        attention_flops_per_s: ``(FLOPs per head, FLOP/s)`` points of the CPU's fused attention per dtype
            name (``"torch.float32"``: forward) and ``"torch.float32/backward"`` (far below a plain matmul's,
            bfloat16's backward most), measured at a small and a larger model's head size.
        transcendental_per_s: per dtype name, ``(elements, elements/s)`` points of ``log_softmax``
            forward and backward (exp, log: bound by arithmetic as much as by memory).
        threads: ``torch.get_num_threads()`` when measured.
        calibration_s: how long the measurement took.
    """

    matmul_flops_per_s: Mapping[str, tuple[tuple[float, float], ...]]
    copy_bytes_per_s: Mapping[str, tuple[tuple[float, float], ...]]
    op_overhead_s: float
    view_overhead_s: float
    attention_flops_per_s: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    transcendental_per_s: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    cold_bytes_per_s: Mapping[str, float] = field(default_factory=dict)
    cast_bytes_per_s: tuple[tuple[float, float], ...] = ()
    micro_step_overhead_s: float = 0.0
    optimizer_op_overhead_s: float = 0.0
    rnn_step_s: Mapping[str, float] = field(default_factory=dict)
    conv_flops_per_s: Mapping[str, float] = field(default_factory=dict)
    named_per_s: Mapping[str, float] = field(default_factory=dict)
    threads: int = 1
    calibration_s: float = 0.0

    def matmul_rate(self, dtype: torch.dtype, flops: float, layout: str = "") -> float:
        """FLOP/s of a matmul of ``flops`` in ``dtype`` (interpolated in log size; fp32's if not measured)."""
        rates = self.matmul_flops_per_s
        points = (
            rates.get(f"{dtype}/{layout}")
            or rates.get(str(dtype))
            or rates.get(f"torch.float32/{layout}")
            or rates["torch.float32"]
        )
        return _interpolate(points, flops)

    def bandwidth(self, dtype: torch.dtype, nbytes: float) -> float:
        """Bytes/s of an elementwise pass over ``nbytes`` in ``dtype``."""
        points = self.copy_bytes_per_s.get(str(dtype)) or self.copy_bytes_per_s["torch.float32"]
        return _interpolate(points, nbytes)

    def cold_bandwidth(self, dtype: torch.dtype, nbytes: float) -> float:
        """Bytes/s of a pass over data not in the cache (no slower than the in-cache curve says)."""
        cold = self.cold_bytes_per_s.get(str(dtype)) or self.cold_bytes_per_s.get("torch.float32")
        hot = self.bandwidth(dtype, nbytes)
        return min(hot, cold) if cold else hot


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + f * (y1 - y0)
    return points[-1][1]


def _median_s(fn: Callable[[], Any], timer: Callable[[], float], reps: int, rounds: int = 3) -> float:
    """Median over ``rounds`` of the mean time of ``reps`` calls."""
    fn()  # warm-up: first-call allocation and kernel selection
    times = []
    for _ in range(rounds):
        start = timer()
        for _ in range(reps):
            fn()
        times.append((timer() - start) / reps)
    return max(statistics.median(times), 1e-12)


def _attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool) -> None:
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if backward:
        out.sum().backward()


def _softmax_step(x: torch.Tensor) -> None:
    torch.log_softmax(x, dim=-1).sum().backward()


def _scale_all(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.mul_(1.0)


def _lstm_step(lstm: nn.Module, x: torch.Tensor) -> None:
    lstm(x)[0].sum().backward()


def _harmonic(points: list[tuple[tuple[float, float], ...]]) -> tuple[tuple[float, float], ...]:
    return tuple((column[0][0], len(column) / sum(1.0 / r for _, r in column)) for column in zip(*points))


class _Rotating:
    """``torch.mm`` over a pool of operand pairs, one pair a call: each call's operands are out of the
    cache, as a training step's are (its weights and activations were last touched operators ago)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], layout: str) -> None:
        self.pairs = [(a.t() if layout[0] == "t" else a, b.t() if layout[1] == "t" else b) for a, b in pairs]
        self.next = 0

    def __call__(self) -> torch.Tensor:
        a, b = self.pairs[self.next]
        self.next = (self.next + 1) % len(self.pairs)
        return torch.mm(a, b)


def _measure_matmuls(timer: Callable[[], float]) -> dict[str, tuple[tuple[float, float], ...]]:
    """Square matmuls per dtype and layout: ``nn``, ``nt`` (a Linear's forward), ``tn`` (its weight grad).

    Each size runs over a pool of operand pairs larger than a core's caches, one pair a call.
    """
    rates: dict[str, tuple[tuple[float, float], ...]] = {}
    with torch.no_grad():
        for dtype in _CALIBRATED_DTYPES:
            by_layout: dict[str, list[tuple[float, float]]] = {layout: [] for layout in _LAYOUTS}
            for n in _MATMUL_SIZES:
                pair_bytes = 2 * n * n * torch.empty((), dtype=dtype).element_size()
                count = max(2, min(256, _MATMUL_POOL_BYTES // pair_bytes))
                pairs = [(torch.ones(n, n, dtype=dtype), torch.ones(n, n, dtype=dtype)) for _ in range(count)]
                flops = 2.0 * n**3
                for layout in _LAYOUTS:
                    seconds = _median_s(_Rotating(pairs, layout), timer, count)
                    by_layout[layout].append((flops, flops / seconds))
            for layout, points in by_layout.items():
                rates[f"{dtype}/{layout}"] = tuple(points)
            rates[str(dtype)] = _harmonic([tuple(p) for p in by_layout.values()])
    return rates


def _measure_passes(
    timer: Callable[[], float],
) -> tuple[dict[str, tuple[tuple[float, float], ...]], dict[str, float], tuple[tuple[float, float], ...]]:
    """Elementwise passes in cache (a few sizes) and out of it, per dtype; casts float32 <-> bfloat16."""
    hot: dict[str, tuple[tuple[float, float], ...]] = {}
    cold: dict[str, float] = {}
    with torch.no_grad():
        for dtype in _CALIBRATED_DTYPES:
            points = []
            for numel in _COPY_NUMELS:
                x = torch.ones(numel, dtype=dtype)
                moved = 2.0 * numel * x.element_size()  # read and write
                seconds = _median_s(functools.partial(x.mul, 2.0), timer, 2 if numel > 2**20 else 8)
                points.append((moved, moved / seconds))
            hot[str(dtype)] = tuple(points)
            pool = [torch.ones(_COLD_NUMEL, dtype=dtype) for _ in range(_COLD_TENSORS)]
            moved = 2.0 * _COLD_NUMEL * _COLD_TENSORS * pool[0].element_size()
            cold[str(dtype)] = moved / _median_s(functools.partial(_scale_all, pool), timer, 1)
        casts = []
        for numel in _COPY_NUMELS:  # there and back, as autocast casts weights and gradients
            wide = torch.ones(numel)
            narrow = wide.bfloat16()
            there = _median_s(functools.partial(wide.to, torch.bfloat16), timer, 2 if numel > 2**20 else 8)
            back = _median_s(narrow.float, timer, 2 if numel > 2**20 else 8)
            casts.append((6.0 * numel, 12.0 * numel / (there + back)))
    return hot, cold, tuple(casts)


def _measure_rnn(
    timer: Callable[[], float], matmul: Mapping[str, tuple[tuple[float, float], ...]]
) -> dict[str, float]:
    """An LSTM's fixed time per time step: one sequence of 32 steps, forward and backward, less its FLOPs."""
    steps, width = 32, 64
    out: dict[str, float] = {}
    for dtype in _CALIBRATED_DTYPES:
        torch.manual_seed(0)
        lstm = nn.LSTM(width, width, batch_first=True).to(dtype)
        x = torch.randn(1, steps, width, dtype=dtype, requires_grad=True)
        seconds = _median_s(functools.partial(_lstm_step, lstm, x), timer, 2, rounds=5)
        flops = 3 * 2.0 * steps * 4 * width * 2 * width  # forward, and twice that backward
        rate = _interpolate(matmul.get(str(dtype)) or matmul["torch.float32"], flops / 3 / steps)
        out[str(dtype)] = max(seconds - flops / rate, 0.0) / (2 * steps)
    return out


def _conv_step(conv: nn.Module, x: torch.Tensor, backward: bool) -> None:
    out = conv(x)
    if backward:
        out.sum().backward()


def _measure_conv_and_named(timer: Callable[[], float]) -> tuple[dict[str, float], dict[str, float]]:
    """A 3×3 convolution forward and backward per dtype; dropout's ``bernoulli_`` and max-pooling."""
    conv_rates: dict[str, float] = {}
    named: dict[str, float] = {}
    for dtype in _CALIBRATED_DTYPES:
        torch.manual_seed(0)
        conv = nn.Conv2d(32, 64, 3, padding=1).to(dtype)
        x = torch.randn(4, 32, 16, 16, dtype=dtype, requires_grad=True)
        flops = 2.0 * 4 * 64 * 16 * 16 * 32 * 9
        with torch.no_grad():
            forward = _median_s(functools.partial(_conv_step, conv, x, False), timer, 2)
        both = _median_s(functools.partial(_conv_step, conv, x, True), timer, 2)
        conv_rates[str(dtype)] = flops / forward
        conv_rates[f"{dtype}/backward"] = 2.0 * flops / max(both - forward, forward)
        with torch.no_grad():
            y = torch.empty(2**18, dtype=dtype)
            named[f"bernoulli_/{dtype}"] = y.numel() / _median_s(
                functools.partial(y.bernoulli_, 0.9), timer, 2
            )
            img = torch.randn(8, 32, 32, 32, dtype=dtype)
            pool = functools.partial(torch.nn.functional.max_pool2d, img, 2, return_indices=True)
            named[f"max_pool2d_with_indices/{dtype}"] = img.numel() / _median_s(pool, timer, 2)
            a, b = torch.ones(2**16, 64), torch.ones(2**16, 64, dtype=torch.bfloat16)
            named[f"mixed/{dtype}"] = a.numel() / _median_s(functools.partial(torch.add, a, b), timer, 2)
            g, x = torch.randn(2**16, 64, dtype=dtype), torch.randn(2**16, 64, dtype=dtype)
            gelu = functools.partial(torch.ops.aten.gelu_backward.default, g, x)
            named[f"gelu_backward/{dtype}"] = x.numel() / _median_s(gelu, timer, 2)
    return conv_rates, named


def _tiny_model(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU()]
    return nn.Sequential(*layers)


def _tiny_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _measure_step_overheads(
    timer: Callable[[], float], partial: CpuCalibration, reps: int = 10
) -> tuple[float, float, float]:
    """Per-operator host time of real training steps whose kernels are negligible.

    Two small models (2 and 8 blocks of Linear, LayerNorm, GELU; batch 2), each traced with
    :func:`count_step_ops` and run for real (forward and backward; AdamW's update and ``zero_grad``):
    the slope between them is the time per micro-step operator, the intercept the fixed time per
    micro-step; the optimizer's time over its traced operators the time per optimizer operator. The
    kernels' own predicted time is taken off first.
    """
    points = []
    for blocks in (2, 8):
        model, batch = _tiny_model(blocks), torch.randn(2, 8)
        ops = count_step_ops(model, torch.optim.AdamW, batch, _tiny_loss)
        kernels = predict_ops(ops, partial)
        opt = torch.optim.AdamW(model.parameters())
        micro_times, opt_times = [], []
        for i in range(reps + 2):  # two warm-ups
            t0 = timer()
            _tiny_loss(model, batch).backward()
            t1 = timer()
            opt.step()
            opt.zero_grad()
            t2 = timer()
            if i >= 2:
                micro_times.append(t1 - t0)
                opt_times.append(t2 - t1)
        points.append(
            (
                sum(w.name not in _TRACE_ONLY for w in ops.micro_step),
                statistics.median(micro_times) - kernels.micro_step_s,
                sum(w.name not in _TRACE_ONLY for w in ops.optimizer),
                statistics.median(opt_times) - kernels.optimizer_s,
            )
        )
    (n2, m2, o2, p2), (n8, m8, o8, p8) = points
    per_op = max((m8 - m2) / max(n8 - n2, 1), partial.view_overhead_s)
    fixed = max(m2 - n2 * per_op, 0.0)
    per_opt_op = max((p2 + p8) / max(o2 + o8, 1), partial.view_overhead_s)
    return per_op, fixed, per_opt_op


def default_timer() -> Callable[[], float]:
    """The calibration's clock: this thread's CPU time when torch runs one thread, else the wall clock.

    One thread's CPU time is what the work takes on a core of its own: a machine shared with other
    processes does not make the calibration (and so the plan) depend on their load at that moment.
    """
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def measure_cpu(timer: Callable[[], float] | None = None) -> CpuCalibration:
    """Measure this CPU now (matmuls, passes and casts per dtype, two tiny training steps; ~1-2 s).

    ``timer``: the clock (default :func:`default_timer`; a fake one in tests).
    """
    timer = timer or default_timer()
    started = timer()
    matmul = _measure_matmuls(timer)
    copies, cold, cast = _measure_passes(timer)
    attention: dict[str, tuple[tuple[float, float], ...]] = {}
    transcendental: dict[str, tuple[tuple[float, float], ...]] = {}
    for dtype in _CALIBRATED_DTYPES:
        forward_points, backward_points = [], []
        for batch, heads, length, dim in ((16, 4, 64, 32), (2, 4, 256, 64)):  # a small and a larger model's
            q, k, v = (
                torch.randn(batch, heads, length, dim, dtype=dtype, requires_grad=True) for _ in range(3)
            )
            flops = 2.0 * batch * heads * length * length * 2 * dim  # forward, not causal
            with torch.no_grad():
                forward = _median_s(functools.partial(_attention_step, q, k, v, False), timer, 2)
            both = _median_s(functools.partial(_attention_step, q, k, v, True), timer, 2)
            per_head = flops / (batch * heads)
            forward_points.append((per_head, flops / forward))
            backward_points.append((2.5 * per_head, 2.5 * flops / max(both - forward, forward)))
        attention[str(dtype)] = tuple(forward_points)
        attention[f"{dtype}/backward"] = tuple(backward_points)
        points = []
        for rows in (64, 2048):
            x = torch.ones(rows, 1024, dtype=dtype, requires_grad=True)
            points.append(
                (float(x.numel()), 2.0 * x.numel() / _median_s(functools.partial(_softmax_step, x), timer, 1))
            )
        transcendental[str(dtype)] = tuple(points)
    rnn = _measure_rnn(timer, matmul)
    conv, named = _measure_conv_and_named(timer)
    with torch.no_grad():
        tiny = torch.ones(4)
        dispatch = _median_s(lambda: torch.add(tiny, tiny), timer, 200)
        view = _median_s(lambda: tiny.view(2, 2), timer, 200)
    kernels_only = CpuCalibration(
        matmul_flops_per_s=matmul,
        copy_bytes_per_s=copies,
        op_overhead_s=0.0,
        view_overhead_s=view,
        attention_flops_per_s=attention,
        transcendental_per_s=transcendental,
        cold_bytes_per_s=cold,
        cast_bytes_per_s=cast,
        rnn_step_s=rnn,
        conv_flops_per_s=conv,
        named_per_s=named,
        threads=torch.get_num_threads(),
    )
    per_op, fixed, per_opt_op = _measure_step_overheads(timer, kernels_only)
    return dataclasses.replace(
        kernels_only,
        op_overhead_s=max(per_op, dispatch),
        micro_step_overhead_s=fixed,
        optimizer_op_overhead_s=max(per_opt_op, dispatch),
        calibration_s=timer() - started,
    )


_CACHE: dict[tuple[Any, int], CpuCalibration] = {}
_LOCK = threading.Lock()


def cpu_calibration(*, timer: Callable[[], float] | None = None, refresh: bool = False) -> CpuCalibration:
    """This CPU's calibration, measured once per CPU profile and thread count in this process.

    Example:
        >>> cal = cpu_calibration()
        >>> cal is cpu_calibration()
        True
    """
    key = (cpu_profile(), torch.get_num_threads())
    with _LOCK:
        if refresh or key not in _CACHE:
            _CACHE[key] = measure_cpu(timer)
        return _CACHE[key]


# -- prediction -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTimePrediction:
    """Predicted time of one step, by operator class.

    Attributes:
        micro_step_s: one micro-step's forward and backward.
        optimizer_s: the optimizer's update, once per step.
        accumulate_s: what each micro-step after the first adds: its gradients added to the earlier ones
            (measured on this CPU: about what a fresh gradient's allocation costs, beyond one extra read).
        micro_step_by_class_s: ``micro_step_s`` split by :data:`OP_CLASSES`.
        flops_per_micro_step / bytes_per_micro_step: what the micro-step's operators compute and move.
        ops_per_micro_step: operators in a micro-step (views included).
    """

    micro_step_s: float
    optimizer_s: float
    micro_step_by_class_s: Mapping[str, float] = field(default_factory=dict)
    accumulate_s: float = 0.0
    flops_per_micro_step: float = 0.0
    bytes_per_micro_step: int = 0
    ops_per_micro_step: int = 0

    def step_s(self, accumulation_steps: int = 1) -> float:
        """An optimizer step of ``accumulation_steps`` micro-steps (each after the first adds its grads)."""
        k = accumulation_steps
        return k * self.micro_step_s + (k - 1) * self.accumulate_s + self.optimizer_s

    def describe(self, accumulation_steps: int = 1) -> str:
        """``"41.2 ms/step: matmul 60%, elementwise 25%, …"``."""
        total = sum(self.micro_step_by_class_s.values()) or 1.0
        parts = sorted(self.micro_step_by_class_s.items(), key=lambda kv: -kv[1])
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in parts if v / total >= 0.05)
        return f"{self.step_s(accumulation_steps) * 1e3:,.1f} ms/step ({shares})"


class StepTimeModel(Protocol):
    """What the planner asks of a step-time model (:class:`OpTimeModel`, or a test's stand-in)."""

    def predict(
        self,
        model: nn.Module,
        optimizer: Any,
        batch: Any,
        loss_fn: Any,
        *,
        precision: str,
        checkpoint_every: int,
    ) -> StepTimePrediction: ...


def _kernel_seconds(w: OpWork, cal: CpuCalibration) -> float:
    """The operator's own work: its FLOPs at the calibrated rate or its bytes at the bandwidth."""
    if w.op_class == "view":
        return 0.0
    if w.variant == "cast" and cal.cast_bytes_per_s:
        memory = w.bytes / _interpolate(cal.cast_bytes_per_s, w.bytes) if w.bytes else 0.0
    elif w.phase == "optimizer":  # the states were last touched a step ago: not in the cache
        memory = w.bytes / cal.cold_bandwidth(w.dtype, w.bytes) if w.bytes else 0.0
    else:
        memory = w.bytes / cal.bandwidth(w.dtype, w.bytes) if w.bytes else 0.0
    if w.op_class == "attention" and w.flops and cal.attention_flops_per_s:
        rates = cal.attention_flops_per_s
        rate = (
            rates.get(f"{w.dtype}/{w.variant}" if w.variant == "backward" else str(w.dtype))
            or rates.get("torch.float32/backward" if w.variant == "backward" else "torch.float32")
            or rates["torch.float32"]
        )
        return max(w.flops / _interpolate(rate, w.flops / max(w.steps, 1)), memory)
    if w.op_class == "transcendental" and cal.transcendental_per_s:
        points = cal.transcendental_per_s.get(str(w.dtype)) or cal.transcendental_per_s["torch.float32"]
        return max(w.flops / _interpolate(points, w.flops or 1.0), memory)
    if w.variant in ("named", "mixed") and w.flops:
        name = "mixed" if w.variant == "mixed" else w.name
        named = cal.named_per_s.get(f"{name}/{w.dtype}") or cal.named_per_s.get(f"{name}/torch.float32")
        return max(w.flops / named, memory) if named else memory
    if w.op_class == "conv" and w.flops and cal.conv_flops_per_s:
        key = f"{w.dtype}/backward" if w.variant == "backward" else str(w.dtype)
        fallback = "torch.float32/backward" if w.variant == "backward" else "torch.float32"
        conv_rate = cal.conv_flops_per_s.get(key) or cal.conv_flops_per_s[fallback]
        return max(w.flops / conv_rate, memory)
    if w.variant == "rnn":  # one small matmul per time step, each paying a fixed cost
        per_step = cal.rnn_step_s.get(str(w.dtype)) or cal.rnn_step_s.get("torch.float32", 0.0)
        # the weights are read again at every step, from the cache: the bandwidth of one step's bytes
        memory = w.bytes / cal.bandwidth(w.dtype, w.bytes / w.steps) if w.bytes else 0.0
        return max(w.flops / cal.matmul_rate(w.dtype, w.flops / w.steps), memory) + w.steps * per_step
    if w.op_class in _MATMUL_LIKE and w.flops:
        return max(w.flops / cal.matmul_rate(w.dtype, w.flops, w.variant), memory)
    return memory


def _overhead_seconds(w: OpWork, cal: CpuCalibration) -> float:
    """The host time around the kernel, as a training step pays it (see :class:`CpuCalibration`)."""
    if w.name in _TRACE_ONLY:
        return 0.0
    if w.phase == "optimizer":
        return cal.optimizer_op_overhead_s or cal.op_overhead_s
    return cal.op_overhead_s


def _op_seconds(w: OpWork, cal: CpuCalibration) -> float:
    return _kernel_seconds(w, cal) + _overhead_seconds(w, cal)


def predict_ops(ops: StepOps, cal: CpuCalibration) -> StepTimePrediction:
    """Time the counted operators with a calibration.

    Kernels go to their operator's class; the host time around them (per operator, and the fixed part
    of a micro-step) to ``"framework"``.
    """
    by_class = dict.fromkeys(OP_CLASSES, 0.0)
    for w in ops.micro_step:
        by_class[w.op_class] += _kernel_seconds(w, cal)
        by_class["framework"] += _overhead_seconds(w, cal)
    by_class["framework"] += cal.micro_step_overhead_s
    return StepTimePrediction(
        micro_step_s=sum(by_class.values()),
        optimizer_s=sum(_op_seconds(w, cal) for w in ops.optimizer),
        micro_step_by_class_s=by_class,
        # the add replaces what a fresh gradient costs (its allocation and first write): only the extra
        # read of the earlier gradients counts, which a backward has just touched
        accumulate_s=(
            ops.gradient_bytes / cal.bandwidth(torch.float32, 3 * ops.gradient_bytes)
            if ops.gradient_bytes
            else 0.0
        ),
        flops_per_micro_step=sum(w.flops for w in ops.micro_step if w.op_class in _MATMUL_LIKE),
        bytes_per_micro_step=sum(w.bytes for w in ops.micro_step),
        ops_per_micro_step=len(ops.micro_step),
    )


class OpTimeModel:
    """The per-operator step-time model on this CPU (see the module docstring).

    Args:
        calibration: the CPU's speeds (default: :func:`cpu_calibration`, measured on first use).
    """

    def __init__(self, calibration: CpuCalibration | None = None) -> None:
        if calibration is not None and not isinstance(calibration, CpuCalibration):
            raise TypeError(
                f"`OpTimeModel(calibration={calibration!r})` must be a CpuCalibration (`cpu_calibration()`)"
            )
        self._calibration = calibration

    @property
    def calibration(self) -> CpuCalibration:
        if self._calibration is None:
            self._calibration = cpu_calibration()
        return self._calibration

    def predict(
        self,
        model: nn.Module,
        optimizer: Any,
        batch: Any,
        loss_fn: Any = None,
        *,
        precision: str = "32-true",
        checkpoint_every: int = 0,
    ) -> StepTimePrediction:
        """Predict one step of ``batch`` (one micro-step) and the optimizer's update on this CPU."""
        ops = count_step_ops(
            model, optimizer, batch, loss_fn, precision=precision, checkpoint_every=checkpoint_every
        )
        return predict_ops(ops, self.calibration)
