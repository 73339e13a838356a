"""What real kernels allocate beyond what their fake (meta) versions show.

On fake tensors only an operator's declared outputs are seen. A few real CPU kernels do more: oneDNN
convolutions reorder their inputs into blocked layouts, batch-norm backward keeps an input-sized
buffer, oneDNN's LSTM returns a workspace whose meta kernel says it is empty, the fused inference
kernels of ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` hold their projections, scores
and feed-forward inside one operator, the CPU
flash-attention kernels allocate per-thread accumulators, and ATen's CPU scatter kernels accumulate a
bf16/fp16 ``self`` in a float32 copy (``scatter_add_`` of a gather's backward: twice the bf16 gradient
buffer) and ``masked_scatter`` keeps an index per mask element. Indexing with a boolean mask
(``x[mask]``, ``aten.index.Tensor``; ``embedding_sparse_backward``'s ``padding_idx`` drops its rows so)
first turns the mask into positions, ``mask.nonzero()`` (``expandTensors`` in ATen's
``TensorAdvancedIndexingUtils.h``, every device: ``count × mask.dim()`` int64), held beside the output
until the kernel returns: that rule needs no probe (:func:`_mask_positions_bytes`). ATen's CPU
``_embedding_bag``, where it makes ``offset2bag`` (``mean``, ``max``, or ``sum`` off its fast path:
``padding_idx``, per-sample weights), makes it one element longer than its fake (``make_offset2bag_out``
in ``EmbeddingBag.cpp``: ``resize_(n + 1)``, filled, then ``resize_(n)``: the storage stays ``n + 1``),
and keeps it for the backward (:func:`_offset2bag_bytes`). For these
operators the real kernel is *probed*: run once on real zero tensors of the same shapes (one
operator's tensors, never the model's), its allocations read from torch.profiler's memory records,
and the answer cached by shape. Probes are skipped above ``PROBE_BUDGET_BYTES``; then a rule of thumb
measured on the same kernels stands in (scaled by the operator's tensor bytes). Reduced-precision
GEMMs are probed only where this CPU runs them through oneDNN
(:func:`~resource_guard.estimate.host.cpu_support.reduced_gemm_packs`, which reads the CPU profile; ATen's
own loop allocates nothing, and is too slow to probe; under a played CPU profile whose oneDNN packs where
this process's does not, the rule of thumb stands in), and a CPU flash attention costing more than
``PROBE_BUDGET_FLOPS`` is probed at one and two heads per thread and extrapolated (its scratch is affine
in the heads).

These CPU kernels also stand in for the target's kernels (cuDNN keeps comparable workspaces); the
allocator model in :mod:`resource_guard.estimate.allocation.allocator` adds what only CUDA has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from resource_guard.devices.cpu import cpu_profile
from resource_guard.estimate.host.cpu_support import CpuStepCheck, reduced_gemm_packs
from resource_guard.estimate.host.quiet import quiet_profile

__all__ = ["KernelExtra", "PROBE_BUDGET_BYTES", "PROBE_BUDGET_FLOPS", "kernel_extra"]

PROBE_BUDGET_BYTES = 512 * 2**20
#: floating-point operations one probe may cost; a bigger CPU flash attention is probed at one and two
#: heads per thread and extrapolated (:func:`_reduced_probe`)
PROBE_BUDGET_FLOPS = 4 * 10**9
_aten = torch.ops.aten


@dataclass(frozen=True)
class KernelExtra:
    """``scratch_bytes`` freed inside the operator; ``output_bytes`` per flattened output tensor."""

    scratch_bytes: int
    output_bytes: tuple[int | None, ...] = ()


# the CPU flash-attention kernels keep per-thread fp32 accumulators (measured: ~1.7x / ~5.7x q's
# bytes for bf16 forward / backward at ViT-like shapes on 2 threads); probed for CPU targets only
_CPU_FLASH = {
    "_scaled_dot_product_flash_attention_for_cpu": 2.0,
    "_scaled_dot_product_flash_attention_for_cpu_backward": 6.0,
}


def _probed_ops() -> dict[Any, float]:
    """Operators to probe, with the rule-of-thumb scratch (× the largest tensor) used above budget."""
    ops: dict[Any, float] = {
        _aten.convolution.default: 1.0,
        _aten.convolution_backward.default: 2.0,
        _aten.native_batch_norm_backward.default: 1.0,
    }
    for name, factor in (
        ("mkldnn_rnn_layer", 16.0),
        ("mkldnn_rnn_layer_backward", 16.0),
        # the fused inference paths of nn.TransformerEncoderLayer / nn.MultiheadAttention (eval mode,
        # no_grad): their projections, scores and feed-forward live and die inside one operator
        ("_transformer_encoder_layer_fwd", 8.0),
        ("_native_multi_head_attention", 8.0),
        *_CPU_FLASH.items(),
    ):
        op = getattr(_aten, name, None)
        if op is not None:
            ops[op.default] = factor
    return ops


_PROBED = _probed_ops()
_CPU_ONLY = {getattr(_aten, name).default for name in _CPU_FLASH if hasattr(_aten, name)}


def _scatter_ops() -> dict[Any, float]:
    """ATen's CPU scatter-like kernels (every overload but ``out=``), with the rule-of-thumb scratch ×
    ``self``'s bytes for float32: only ``masked_scatter`` keeps one (a 4-byte index per element);
    reduced-precision ``self`` is accumulated in a float32 copy (2 × its bytes) by all of them."""
    ops: dict[Any, float] = {}
    for name in ("scatter", "scatter_add", "scatter_reduce", "index_add", "masked_scatter"):
        for variant in (name, name + "_"):
            packet = getattr(_aten, variant, None)
            for overload in packet.overloads() if packet is not None else ():
                if not overload.startswith("out"):
                    ops[getattr(packet, overload)] = 1.0 if name == "masked_scatter" else 0.0
    return ops


_CPU_SCATTER = _scatter_ops()
# oneDNN bf16/fp16 GEMMs on CPU pack operands into scratch: measured ~1.4x the largest operand
_REDUCED_GEMM_FACTOR = 1.5
# ATen's CPU reductions of a bf16/fp16 tensor into float32 (``mean``, ``sum(dtype=torch.float32)``) first
# copy the whole input to float32, and ``mean`` sums into a float32 result before casting it back
# (``mean(x)``: an input-sized float32 copy and a float32 output, freed inside): probed, CPU targets only
_CPU_WIDENING = {_aten.mean.dim, _aten.mean.default, _aten.sum.dim_IntList, _aten.sum.default}


def _bytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _signature(func: Any, args: tuple, kwargs: dict) -> tuple:
    def key(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), tuple(a.stride()), a.dtype, a.requires_grad)
        return a

    flat, spec = tree_flatten((args, kwargs))
    return (func, str(spec), tuple(key(a) for a in flat))


_CACHE: dict[tuple, KernelExtra] = {}


def _probe(
    func: Any, args: tuple, kwargs: dict, size_of: Callable[[torch.Tensor], int | None]
) -> KernelExtra:
    from resource_guard.estimate.host.measure import allocation_deltas, peak_of

    def real(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        tracked = size_of(a)
        if a.dim() == 1 and tracked is not None and tracked > _bytes_of(a):  # a workspace the fake kept empty
            return torch.zeros(tracked // a.element_size(), dtype=a.dtype)
        # the same layout, expanded (stride-0) dimensions included: some kernels take another path then
        span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride())) if a.numel() else 0
        return torch.zeros(span, dtype=a.dtype).as_strided(a.shape, a.stride())

    with _disable_current_modes():
        real_args, real_kwargs = tree_map(real, (args, kwargs))
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((real_args, real_kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        with quiet_profile() as prof:
            out = func(*real_args, **real_kwargs)
        peak = peak_of(allocation_deltas(prof))
        outputs: list[int | None] = []
        kept = 0
        seen: set[int] = set()
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            outputs.append(int(st.nbytes()))
            if id(st) not in inputs and id(st) not in seen:
                seen.add(id(st))
                kept += int(st.nbytes())
    return KernelExtra(max(0, peak - kept), tuple(outputs))


def _leading(func: Any, args: tuple) -> tuple[int, int, Callable[[int], tuple]] | None:
    """``(units, flops per unit, cut)`` for the CPU flash attention, whose probe may be cut.

    Once every thread has a head to work on, its scratch is affine in batch × heads (measured at
    AVX-512 and AVX2 alike: the forward keeps a per-thread constant, the backward adds ``T·D`` bf16
    elements per head, exactly), so probes at one and two heads per thread are extrapolated.
    ``cut(n)`` returns ``args`` with ``B=1, H=n``. GEMMs are never cut: oneDNN's packing scratch
    depends on the rows through its blocking, not smoothly.
    """
    if func not in _CPU_ONLY:
        return None
    tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    q, k = args[:2] if "backward" not in str(func) else args[1:3]
    bh = tuple(q.shape[:2])
    if any(t.dim() < 3 or tuple(t.shape[:2]) != bh for _, t in tensors):
        return None  # a broadcast mask or grouped heads: not cut
    per_head = 4 * int(q.shape[2]) * int(k.shape[2]) * int(q.shape[3]) * (3 if "backward" in str(func) else 1)
    return int(bh[0] * bh[1]), per_head, lambda n: _cut(args, {i: (1, n) for i, _ in tensors})


def _cut(args: tuple, lead: dict[int, tuple[int, ...]]) -> tuple:
    """``args`` with the tensors at the keys of ``lead`` given those leading sizes (meta tensors with the
    original strides, so the layout class, row- or column-major, is kept)."""
    out = list(args)
    with _disable_current_modes():
        for i, sizes in lead.items():
            t = args[i]
            shape = (*sizes, *t.shape[len(sizes) :])
            out[i] = torch.empty_strided(shape, t.stride(), dtype=t.dtype, device="meta")
    return tuple(out)


def _reduced_probe(
    func: Any, args: tuple, kwargs: dict, size_of: Callable[[torch.Tensor], int | None]
) -> KernelExtra:
    """The probe of ``func``; one costing more than :data:`PROBE_BUDGET_FLOPS` is run at one and two
    units per thread and extrapolated where :func:`_leading` allows it (output sizes: the fake's)."""
    lead = _leading(func, args)
    threads = max(1, torch.get_num_threads())
    if lead is None or lead[0] * lead[1] <= PROBE_BUDGET_FLOPS or lead[0] <= 2 * threads:
        return _probe(func, args, kwargs, size_of)
    units, _, cut = lead
    # below one unit per thread the per-thread buffers are not all taken: cut to `threads` and twice that
    one = _probe(func, cut(threads), kwargs, size_of).scratch_bytes
    two = _probe(func, cut(2 * threads), kwargs, size_of).scratch_bytes
    return KernelExtra(two + max(0, two - one) * (units - 2 * threads) // threads)


def _blas_copy_bytes(func: Any, args: tuple) -> int:
    """Bytes of the operands a BLAS matmul must first copy: neither row- nor column-major (e.g. expanded)."""
    total = 0
    operands = args[1:3] if func in (_aten.addmm.default, _aten.baddbmm.default) else args[:2]
    for t in operands:
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            continue
        rows, cols = t.shape[-2], t.shape[-1]
        s_row, s_col = t.stride()[-2], t.stride()[-1]
        row_major = s_col == 1 and s_row >= max(1, cols)
        col_major = s_row == 1 and s_col >= max(1, rows)
        if not (row_major or col_major) and rows > 1 and cols > 1:
            total += _bytes_of(t)
    return total


_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


def kernel_extra(
    func: Any,
    args: tuple,
    kwargs: dict,
    out: Any,
    size_of: Callable[[torch.Tensor], int | None],
    *,
    device_kind: str = "cpu",
    cpu_check: CpuStepCheck | None = None,
) -> KernelExtra | None:
    """Scratch and true output sizes of the real kernel of ``func``, or ``None`` if it has none.

    ``size_of`` tells the tracked storage size of an input (workspaces whose fake is empty).
    ``device_kind`` is the target's: the CPU-only kernels (oneDNN's reduced-precision GEMMs, which
    pack their operands into scratch where this CPU lets oneDNN run them, and the CPU flash attention)
    are probed only for CPU targets; on CUDA, cuBLAS works in its workspace (see
    :mod:`resource_guard.estimate.allocation.allocator`). For a CPU target, ``cpu_check`` is told each
    operator
    (:class:`~resource_guard.estimate.host.cpu_support.CpuStepCheck`: what this CPU can run of the step).
    """
    cpu = device_kind == "cpu"
    if cpu and cpu_check is not None:
        cpu_check.saw_op(func, args)
    if func in _MATMULS:
        copied = _blas_copy_bytes(func, args)
        dtype = next((t.dtype for t in args[:3] if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
        reduced = cpu and dtype in (torch.bfloat16, torch.float16) and reduced_gemm_packs(dtype)
        if not reduced or dtype is None:
            return KernelExtra(copied) if copied else None
        if cpu_profile().played and not _process_gemm_packs(dtype):
            # a played CPU whose oneDNN packs where this process's does not: a probe here would measure
            # ATen's loop (nothing), so the rule of thumb stands in for the played CPU's packing
            extra = _rule(args, kwargs, out, _REDUCED_GEMM_FACTOR)
        else:
            extra = _probe_or_rule(func, args, kwargs, out, size_of, _REDUCED_GEMM_FACTOR)
        return KernelExtra(max(extra.scratch_bytes, copied))
    if func in _EMBEDDING_BAGS and cpu:
        return _offset2bag_bytes(args, out)
    if func in _UNREDUCED_LOSSES:
        return _unreduced_loss_bytes(func, args, kwargs, out, size_of)
    if func is _aten.index.Tensor:
        positions = _mask_positions_bytes(args, out)
        return KernelExtra(positions) if positions else None
    if func in _CPU_ONLY and not cpu:
        return None
    if func in _CPU_SCATTER:
        return _scatter_extra(func, args, kwargs, out, size_of) if cpu else None
    if func in _CPU_WIDENING:
        return _widening_extra(func, args, kwargs, out, size_of) if cpu else None
    factor = _PROBED.get(func)
    if factor is None:
        return None
    if not cpu and _low_precision(args):
        # a CPU kernel in fp16/bf16 says nothing of cuDNN's workspace on the target, and runs very
        # slowly here (a small fp16 conv net took ~19 min to probe): the rule of thumb stands
        return _rule(args, kwargs, out, factor)
    return _probe_or_rule(func, args, kwargs, out, size_of, factor)


_EMBEDDING_BAGS = {_aten._embedding_bag.default, _aten._embedding_bag_forward_only.default}
# ATen's pointwise losses with a reduction compute the unreduced loss into a buffer and reduce into it:
# the 0-d loss returned keeps that whole buffer as its storage (fp32 ``mse_loss`` of a (16, 40) input:
# a 0-d tensor on 2,560 bytes; its fake: 4). A loop that holds its loss (``loss = criterion(out, y)``
# until the next step; LBFGS's first closure loss through its step) holds the buffer.
_UNREDUCED_LOSSES = {
    getattr(_aten, name).default
    for name in ("mse_loss", "smooth_l1_loss", "binary_cross_entropy", "soft_margin_loss")
    if hasattr(_aten, name)
}


def _unreduced_loss_bytes(
    func: Any, args: tuple, kwargs: dict, out: Any, size_of: Callable[[torch.Tensor], int | None]
) -> KernelExtra | None:
    """The storage of a reduced pointwise loss (:data:`_UNREDUCED_LOSSES`): probed on the real kernel,
    above the probe budget the broadcast shape of its inputs in the output's dtype.

    Example:
        >>> a, b = torch.zeros(16, 40), torch.zeros(40)
        >>> extra = _unreduced_loss_bytes(_aten.mse_loss.default, (a, b), {}, torch.zeros(()), lambda t: None)
        >>> extra.output_bytes
        (2560,)
    """
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        return None  # reduction="none": the fake's output is the buffer already
    tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    if len(tensors) < 2:
        return None
    shape = torch.broadcast_shapes(tensors[0].shape, tensors[1].shape)
    rule = KernelExtra(0, (shape.numel() * out.element_size(),))
    if shape.numel() * out.element_size() * 4 > PROBE_BUDGET_BYTES:
        return rule
    key = (_signature(func, args, kwargs), torch.get_num_threads())
    found = _CACHE.get(key)
    if found is None:
        try:
            probed = _probe(func, args, kwargs, size_of)
            found = KernelExtra(probed.scratch_bytes, probed.output_bytes)
        except Exception:  # a probe is a refinement; without it the broadcast buffer stands
            found = rule
        _CACHE[key] = found
    return found


def _offset2bag_bytes(args: tuple, out: Any) -> KernelExtra | None:
    """The CPU ``_embedding_bag``'s ``offset2bag`` storage: ``n + 1`` elements where the fake has ``n``."""
    offset2bag = out[1]
    n = int(args[1].numel())
    if n == 0 or offset2bag.numel() != n:
        return None  # the fast ``sum`` path makes it empty
    return KernelExtra(0, (None, (n + 1) * offset2bag.element_size()))


def _mask_positions_bytes(args: tuple, out: Any) -> int:
    """Bytes of the positions (``mask.nonzero()``, int64) ``x[mask]`` makes of its boolean masks.

    With one mask (and no other index) the number of positions is the output's size where the mask's
    dimensions went (exact); with several indices it is bounded by the mask's elements (never under).

    Example:
        >>> x, m = torch.zeros(6, 2), torch.tensor([True, False] * 3)
        >>> _mask_positions_bytes((x, [m]), x[m])  # 3 positions, 1 dimension, int64
        24
    """
    indices = list(args[1]) if len(args) > 1 else []
    given = [(i, t) for i, t in enumerate(indices) if isinstance(t, torch.Tensor)]
    masks = [(i, t) for i, t in given if t.dtype in (torch.bool, torch.uint8)]
    if not masks or not isinstance(out, torch.Tensor):
        return 0
    if len(given) == 1:
        at = masks[0][0]  # every leading ``None`` keeps one dimension before the mask's
        return int(out.shape[at]) * masks[0][1].dim() * 8 if out.dim() > at else 0
    return sum(int(t.numel()) * t.dim() * 8 for _, t in masks)


def _scatter_extra(
    func: Any, args: tuple, kwargs: dict, out: Any, size_of: Callable[[torch.Tensor], int | None]
) -> KernelExtra | None:
    """A CPU scatter kernel's scratch: probed where its rule of thumb says it has any."""
    self_ = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if self_ is None:
        return None
    factor = 2.0 if self_.dtype in (torch.bfloat16, torch.float16) else _CPU_SCATTER[func]
    if not factor:
        return None
    return _probe_or_rule(func, args, kwargs, out, size_of, factor)


def _widening_extra(
    func: Any, args: tuple, kwargs: dict, out: Any, size_of: Callable[[torch.Tensor], int | None]
) -> KernelExtra | None:
    """A CPU reduction's float32 copy of a bf16/fp16 input (``mean``; ``sum`` asked for a wider dtype)."""
    self_ = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if self_ is None or self_.dtype not in (torch.bfloat16, torch.float16):
        return None
    if func in (_aten.sum.dim_IntList, _aten.sum.default) and kwargs.get("dtype") in (None, self_.dtype):
        return None
    return _probe_or_rule(func, args, kwargs, out, size_of, 2.0)


def _process_gemm_packs(dtype: torch.dtype) -> bool:
    """Whether this process's own oneDNN packs ``dtype`` GEMMs (what a probe here would measure)."""
    from resource_guard.estimate.host.cpu_support import _reduced_gemm_packs

    try:
        return _reduced_gemm_packs(dtype)
    except RuntimeError:
        return True


def _low_precision(args: tuple) -> bool:
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16)
        for t in tree_flatten(args)[0]
    )


def _rule(args: tuple, kwargs: dict, out: Any, factor: float) -> KernelExtra:
    """``factor`` × the largest tensor of the call: the scratch when no probe is run."""
    tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
    return KernelExtra(int(max((_bytes_of(t) for t in tensors), default=0) * factor))


def _probe_or_rule(
    func: Any,
    args: tuple,
    kwargs: dict,
    out: Any,
    size_of: Callable[[torch.Tensor], int | None],
    factor: float,
) -> KernelExtra:
    """The probed extra of ``func`` (cached by signature), or ``factor`` × its largest tensor."""
    tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
    if sum(_bytes_of(t) for t in tensors) * 2 > PROBE_BUDGET_BYTES:
        return _rule(args, kwargs, out, factor)
    key = (_signature(func, args, kwargs), tuple(size_of(t) for t in tensors), torch.get_num_threads())
    found = _CACHE.get(key)
    if found is None:
        try:
            found = _reduced_probe(func, args, kwargs, size_of)
        except Exception:  # a probe is a refinement; without it the rule of thumb stands
            found = _rule(args, kwargs, out, factor)
        _CACHE[key] = found
    return found
