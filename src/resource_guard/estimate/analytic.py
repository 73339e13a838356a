"""Analytic fallback when a training step cannot be traced: an upper bound from shapes alone.

What it counts, and how sure each part is:

- parameters, buffers, gradients and the batch: exact (shapes and dtypes);
- optimizer state: exact, from the optimizer's real state layout (its first ``step`` run on fake
  tensors, as the trace does); if even that fails, parameter-sized tensors per parameter by the
  optimizer's type (:func:`optimizer_states_per_param`);
- activations: a bound, not a measurement. Every leaf module is taken to keep ``ACTIVATION_FACTOR``
  tensors as large as its output (its own width where it has one, else that of the leaf before it,
  whose output it usually takes) for every position of the batch, which the stride of convolutions
  and pooling only makes smaller; attention modules add their ``batch x heads x seq x seq`` scores
  (three copies: scores, probabilities, dropout mask), and the loss its logits (float32
  log-probabilities and their gradient).
  Functional code that creates tensors larger than any module's output (a custom op on an expanded
  tensor) is outside what it can see;
- kernel scratch: on a CPU target, :data:`CPU_CONV_SCRATCH_BYTES` where there are depthwise
  (grouped) convolutions; and in bf16/fp16 on a CPU whose oneDNN has no kernels in that dtype (an
  AVX2-only CPU in bf16, most CPUs in fp16:
  :func:`~resource_guard.estimate.host.cpu_support.reduced_gemm_packs`),
  where convolutions run as ATen's im2col ``slow_conv2d``, two full-batch column buffers of the largest
  convolution (backward recomputes the columns beside their gradient);
- temporaries: the optimizer's own (a parameter-sized tensor per state on a foreach target, two of the
  largest parameter otherwise), plus :data:`MARGIN` of everything.

``benchmarks/fallback_bound.py`` checks the figure against real CPU steps of every model the test
suite and the benchmarks have (never below; within 2x on most). Callers see ``method="analytic"``,
and ``warnings`` says why the trace failed and that the figure is this bound.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from resource_guard.estimate.result import ANALYTIC, MemoryEstimate
from resource_guard.estimate.trace.recovery import fake_mode
from resource_guard.estimate.trace.tracer import CATEGORIES, StorageTracker
from resource_guard.step.precision import PrecisionSpec
from resource_guard.step.training import batch_size_of, iter_tensors

__all__ = [
    "ACTIVATION_FACTOR",
    "CPU_CONV_SCRATCH_BYTES",
    "MARGIN",
    "analytic_estimate",
    "optimizer_states_per_param",
]

ACTIVATION_FACTOR = 2  # tensors kept per leaf output: the output and what backward saves (or its gradient)
MARGIN = 0.25  # on top of everything: what the count cannot see
_SLACK_BYTES = 64 * 2**10
_TWO_STATES = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Lamb", "LAMB", "Adafactor")
_WIDTH_ATTRS = ("out_features", "out_channels", "embedding_dim", "nf", "hidden_size", "normalized_shape")
_STRIDED = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)
CPU_CONV_SCRATCH_BYTES = 3 * 2**20
"""CPU targets: oneDNN's grouped (depthwise) convolution-backward scratch, which no module output
shows (measured up to 2.4 MiB on a tiny ConvNeXt in bf16; it depends on the host's threads and ISA,
so an allowance)."""
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")


def optimizer_states_per_param(optimizer: Any) -> int:
    """How many parameter-sized tensors the optimizer keeps per parameter in steady state (by type)."""
    if isinstance(optimizer, (list, tuple)):  # a user step's optimizers: the most any of them keeps
        return max((optimizer_states_per_param(o) for o in optimizer), default=0)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    name = cls.__name__
    groups = getattr(optimizer, "param_groups", None) or [getattr(optimizer, "defaults", {})]
    if name in _TWO_STATES:
        return 3 if any(g.get("amsgrad") for g in groups) else 2
    if name == "SGD":
        return 1 if any(g.get("momentum", 0) for g in groups) else 0
    if name in ("Adagrad", "Adadelta", "Rprop", "ASGD"):
        return 2 if name in ("Adadelta", "Rprop") else 1
    if name == "RMSprop":
        return 1 + any(g.get("momentum", 0) for g in groups) + any(g.get("centered") for g in groups)
    return 2  # unknown optimizer: assume Adam-like


def _optimizer_state_bytes(model: nn.Module, optimizer: Any, spec: PrecisionSpec) -> int | None:
    """Bytes of the optimizer's state after one step on fake parameters; ``None`` if that cannot run."""
    from resource_guard.estimate.trace.fake_world import FakeStep  # fake_world imports the tracer, as we do

    tracker = StorageTracker(record_timeline=False)  # as a mode: it recovers what fake kernels refuse
    try:
        with fake_mode(), tracker:
            world = FakeStep(model, optimizer, (), spec, tracker)
            world.warm_up_optimizer()
            storages = {
                id(v.untyped_storage()): v.untyped_storage().nbytes()
                for opt in world.optimizers
                for st in opt.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor)
            }
    except Exception:  # the fallback of a fallback: count by the optimizer's type
        return None
    return int(sum(storages.values()))


def _width(m: nn.Module) -> int | None:
    for attr in _WIDTH_ATTRS:
        value = getattr(m, attr, None)
        if isinstance(value, int):
            return value
        if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
            return math.prod(value)
    weight = getattr(m, "weight", None)  # leaves with only a weight (RMSNorm-style)
    if isinstance(weight, torch.Tensor) and weight.dim() >= 1:
        return int(weight.shape[0])
    return None


def _heads(m: nn.Module) -> int | None:
    """Attention heads of an attention module (``nn.MultiheadAttention`` or a class named so)."""
    if not isinstance(m, nn.MultiheadAttention) and "attention" not in type(m).__name__.lower():
        return None
    for owner in (m, getattr(m, "config", None)):
        for attr in _HEAD_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _inputs(batch: Any, model: nn.Module) -> tuple[int | None, int | None]:
    """``(token positions, signal positions)`` of the batch.

    Tokens: integer ids (one position each), ``(B, S, D)`` features (``B*S``), ``(B, F)`` rows (``B``).
    Signals, which a model's first convolution takes: images ``(B, C, H, W)`` (``B*H*W``), a ``(B, C, L)``
    or a raw ``(B, L)`` waveform into a model with ``Conv1d`` layers (``B*L``).
    """
    conv1d = any(isinstance(m, nn.Conv1d) for m in model.modules())
    tokens: int | None = None
    signal: int | None = None
    for t in iter_tensors(batch):
        if t.dim() == 0:
            continue
        if not t.is_floating_point():
            tokens = max(tokens or 0, t.numel())
        elif t.dim() >= 4:
            signal = max(signal or 0, t.numel() // t.shape[1])
        elif conv1d and t.dim() in (2, 3):
            signal = max(signal or 0, t.shape[0] * t.shape[-1])
        else:
            tokens = max(tokens or 0, t.numel() // t.shape[-1] if t.dim() == 3 else t.shape[0])
    return tokens, signal


def _stride(m: nn.Module) -> float:
    """How much ``m`` shrinks (> 1) or grows (< 1) the positions it is given."""
    stride = getattr(m, "stride", None)
    if not isinstance(m, _STRIDED):
        return 1.0
    factor = float(math.prod(stride)) if isinstance(stride, tuple) else float(stride or 1)
    return 1.0 / factor if isinstance(m, nn.modules.conv._ConvTransposeNd) else factor


def _leaf_width(m: nn.Module) -> int | None:
    """Elements per position a leaf keeps: its output width, times the gates and directions of an RNN."""
    width = _width(m)
    if isinstance(m, nn.RNNBase) and width is not None:
        gates = {"LSTM": 4, "GRU": 3}.get(m.mode, 1)
        width *= gates * (2 if m.bidirectional else 1) * m.num_layers
    return width


def _activation_bound(model: nn.Module, batch: Any, spec: PrecisionSpec) -> tuple[int, int]:
    """``(activation bytes, bytes of the largest convolution's im2col columns)``, from one walk."""
    tokens, signal = _inputs(batch, model)
    batch_size = batch_size_of(batch) or 1
    widest = max((w for m in model.modules() if (w := _width(m)) is not None), default=1)
    compute = spec.compute_dtype.itemsize
    positions = float(tokens or signal or batch_size)  # what the module being visited sees
    most = positions
    total, last, columns = 0.0, None, 0.0
    for m in model.modules():  # in definition order, parents before their children
        heads = _heads(m)
        if heads:
            seq = positions / batch_size
            total += 3 * batch_size * heads * seq * seq * max(compute, 4)
        state = getattr(m, "ssm_state_size", None)
        inner = getattr(m, "intermediate_size", None)
        if isinstance(state, int) and isinstance(inner, int):  # a state-space scan: a state per position
            total += ACTIVATION_FACTOR * positions * inner * state * max(compute, 4)
        if next(m.children(), None) is not None:
            continue
        shrink = _stride(m)
        if shrink != 1.0:  # a convolution or pooling: the first one takes the signal, if any
            source = signal if signal is not None else positions
            signal = None
            positions = max(1.0, source / shrink)
        if isinstance(m, nn.modules.conv._ConvNd):  # im2col: in_channels × kernel rows per output position
            rows = m.in_channels // m.groups * math.prod(m.kernel_size)
            columns = max(columns, positions * rows * compute)
        last = _leaf_width(m) or last
        total += ACTIVATION_FACTOR * positions * (last or widest) * compute
        most = max(most, positions)
    # the loss: float32 log-probabilities over the widest output, and their gradient
    total += 2 * most * widest * 4
    return int(total), int(columns)


def analytic_estimate(
    model: nn.Module, optimizer: Any, batch: Any, spec: PrecisionSpec, device_kind: str, *, reason: str
) -> MemoryEstimate:
    """An upper-bound :class:`~resource_guard.MemoryEstimate` from shapes alone (see the module doc).

    Example:
        >>> from resource_guard.step.precision import parse_precision
        >>> model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        >>> est = analytic_estimate(model, torch.optim.AdamW, torch.randn(32, 64),
        ...                         parse_precision("32-true"), "cpu", reason="asked for")
        >>> est.method, est.breakdown["optimizer_state"] >= 2 * est.breakdown["gradients"]
        ('analytic', True)
    """
    params = list({id(p): p for p in model.parameters()}.values())

    def size(t: torch.Tensor) -> int:
        dtype = spec.param_dtype if t.is_floating_point() else t.dtype
        return t.numel() * dtype.itemsize

    param_bytes = sum(size(p) for p in params)
    trainable = [p for p in params if p.requires_grad]
    trainable_bytes = sum(size(p) for p in trainable)
    buffer_bytes = sum(size(b) for b in model.buffers())
    state_bytes = _optimizer_state_bytes(model, optimizer, spec)
    layout = "its real state layout"
    if state_bytes is None:
        state_bytes = optimizer_states_per_param(optimizer) * trainable_bytes
        layout = "parameter-sized tensors per parameter by its type"
    input_bytes = sum(t.numel() * t.element_size() for t in iter_tensors(batch))
    activations, columns = _activation_bound(model, batch, spec)
    if spec.autocast_dtype is not None:
        activations += trainable_bytes // 2  # autocast's low-precision copies of the weights
    grouped = (m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups > 1)
    if device_kind == "cpu" and next(grouped, None) is not None:
        activations += CPU_CONV_SCRATCH_BYTES
    im2col = _cpu_im2col(spec, device_kind)
    if im2col:
        activations += 2 * columns
    largest = max((size(p) for p in trainable), default=0)
    states = max(1, round(state_bytes / trainable_bytes)) if trainable_bytes else 1
    temporaries = states * trainable_bytes if device_kind in ("cuda", "rocm") else 2 * largest
    known = param_bytes + buffer_bytes + trainable_bytes + state_bytes + input_bytes
    known += activations + temporaries
    temporaries += int(known * MARGIN) + _SLACK_BYTES
    breakdown = dict.fromkeys(CATEGORIES, 0)
    breakdown.update(
        parameters=param_bytes,
        gradients=trainable_bytes,
        optimizer_state=state_bytes,
        activations=activations,
        temporaries=temporaries,
        inputs=input_bytes,
        other=buffer_bytes,
    )
    how = (
        f"analytic upper bound: parameters, gradients, batch exact, optimizer state from {layout}; "
        f"activations bounded by {ACTIVATION_FACTOR} tensors per leaf output at every position, attention "
        f"scores and the loss, plus {MARGIN:.0%}"
    )
    if im2col and columns:
        how += f"; {im2col}"
    return MemoryEstimate(
        peak_bytes=sum(breakdown.values()),
        breakdown=breakdown,
        method=ANALYTIC,
        precision=spec.name,
        device_kind=device_kind,
        peak_phase=None,
        batch_size=batch_size_of(batch),
        parameter_count=sum(p.numel() for p in params),
        trainable_parameter_count=sum(p.numel() for p in trainable),
        persistent_bytes=param_bytes + buffer_bytes + state_bytes,
        warnings=(reason, how),
    )


def _cpu_im2col(spec: PrecisionSpec, device_kind: str) -> str | None:
    """Why a CPU target's convolutions run as ATen's im2col here, or ``None`` where they need not."""
    dtype = spec.compute_dtype
    if device_kind != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    from resource_guard.devices.cpu import cpu_profile
    from resource_guard.estimate.host.cpu_support import reduced_gemm_packs

    if reduced_gemm_packs(dtype):  # the CPU profile's answer (the oneDNN cap included)
        return None
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    isa = cpu_profile().isa or "unknown"
    return (
        f"this CPU's oneDNN (ISA {isa}) has no {name} kernels: convolutions counted as im2col "
        "(two column buffers)"
    )
