"""Which ``scaled_dot_product_attention`` kernel a GPU target runs, and tracing with that kernel.

PyTorch picks the SDPA backend at run time (``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, pytorch/pytorch@001f694a): the first of
flash → memory-efficient → math whose checks pass. What each keeps for backward differs by orders of
magnitude: the fused kernels keep their output and a float32 log-sum-exp per query row, the math
path keeps the (batch, heads, L, S) attention probabilities (float32 for fp16/bf16 inputs, which it
upcasts) and a dropout mask. :func:`select_backend` applies the checks that depend on what a
pre-flight knows (capability, dtype, head dims, mask, causal shape); :func:`run_backend` traces the
chosen CUDA kernel itself: the CUDA ops' meta functions run on CPU fake tensors, so the saved
tensors are the kernel's own (log-sum-exp ``(B, H, L)`` for flash, ``(B, H, ⌈L/32⌉·32)`` for
memory-efficient, ``(B, H, L, 1)`` for cuDNN). The math path with dropout is traced op for op, with
CUDA's dropout (a ``bool`` mask kept, not the CPU composite's float noise).

cuDNN attention (preferred over flash on sm90/sm100 only with cuDNN newer than 9.15, which the
pre-flight cannot know) keeps the same bytes as flash; ``prefer_cudnn`` selects it. ROCm builds run
the AOTriton flash / memory-efficient kernels; the sm80 rules stand in for them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from resource_guard.estimate.emulate.target import Target

__all__ = ["FLASH", "EFFICIENT", "CUDNN", "MATH", "select_backend", "run_backend", "attention_for"]

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
_LOW = (torch.float16, torch.bfloat16)
_aten = torch.ops.aten
_ASSUMED_CAPABILITY = (8, 0)  # a CUDA target of unknown capability: an Ampere-or-newer data-centre GPU


def _flash_ok(cap: tuple[int, int], dtype: torch.dtype, d_qk: int, d_v: int, *, mask: bool,
              dropout_p: float, causal_square: bool, grad: bool) -> bool:  # fmt: skip
    if cap < (8, 0) or dtype not in _LOW or mask or not causal_square or d_qk != d_v or d_qk > 256:
        return False
    if cap in ((8, 6), (8, 9), (12, 0), (12, 1)) and grad:  # consumer parts: less shared memory
        return d_qk <= 192 or (d_qk > 224 and dropout_p == 0.0)
    return True


def _efficient_ok(cap: tuple[int, int], dtype: torch.dtype, d_qk: int, d_k: int, d_v: int) -> bool:
    if cap < (5, 0) or d_qk != d_k or d_qk <= 0 or d_v <= 0:
        return False
    if dtype == torch.bfloat16 and cap < (8, 0):
        return False
    if dtype not in (*_LOW, torch.float32):
        return False
    if cap >= (8, 0):
        align = 8 if dtype in _LOW else 4
    elif cap >= (7, 0):
        align = 8 if dtype in _LOW else 1
    else:
        align = 1
    return d_qk % align == 0 and d_v % align == 0


def _cudnn_ok(cap: tuple[int, int], dtype: torch.dtype, d_qk: int, d_v: int, dropout_p: float) -> bool:
    return (
        cap >= (8, 0)
        and dtype in _LOW
        and d_qk == d_v
        and d_qk % 8 == 0
        and d_qk <= 128
        and math.isclose((dropout_p * 16) % 1, 0.0, abs_tol=1e-9)
    )


def select_backend(
    target: Target,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    prefer_cudnn: bool = False,
) -> str:
    """The SDPA backend ``target`` would run for these inputs: ``"flash"``, ``"efficient"``, ``"cudnn"``
    or ``"math"`` (the CPU and MPS targets: ``"math"``; their own kernels are traced as they are).

    Example:
        >>> q = torch.empty(2, 8, 128, 64, dtype=torch.float16)
        >>> a100, v100 = Target("cuda", "a100", (8, 0)), Target("cuda", "v100", (7, 0))
        >>> select_backend(a100, q, q, q), select_backend(v100, q, q, q)
        ('flash', 'efficient')
    """
    if not target.cuda_like:
        return MATH
    cap = target.capability or _ASSUMED_CAPABILITY
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return MATH
    dtype = query.dtype
    if key.dtype != dtype or value.dtype != dtype:
        return MATH
    d_qk, d_k, d_v = query.shape[-1], key.shape[-1], value.shape[-1]
    grad = any(t.requires_grad for t in (query, key, value))
    square = not is_causal or query.shape[-2] == key.shape[-2]
    if min(query.shape[-2], key.shape[-2]) == 0:
        return MATH
    if prefer_cudnn and attn_mask is None and _cudnn_ok(cap, dtype, d_qk, d_v, dropout_p):
        return CUDNN
    mask = attn_mask is not None
    if _flash_ok(cap, dtype, d_qk, d_v, mask=mask, dropout_p=dropout_p, causal_square=square, grad=grad):
        return FLASH
    if _efficient_ok(cap, dtype, d_qk, d_k, d_v):
        return EFFICIENT
    return MATH


def _repeat_kv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if key.shape[-3] == query.shape[-3]:
        return key, value
    repeat = query.shape[-3] // key.shape[-3]
    return key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)


def _as_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask becomes an additive bias in the query's dtype, as ``convert_boolean_attn_mask`` does."""
    if mask is None or mask.dtype != torch.bool:
        return mask if mask is None or mask.dtype == dtype else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask.logical_not(), float("-inf"))


def run_backend(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Run the CUDA kernel of ``backend`` on (fake) tensors; returns the attention output."""
    grad = any(t.requires_grad for t in (query, key, value))
    if backend == FLASH:  # supports grouped-query attention natively
        return _aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, scale=scale
        )[0]
    if enable_gqa:
        key, value = _repeat_kv(query, key, value)
    fused = {
        EFFICIENT: _aten._scaled_dot_product_efficient_attention,
        CUDNN: _aten._scaled_dot_product_cudnn_attention,
    }.get(backend)
    if fused is not None:  # both take a bias, not a boolean mask
        bias = _as_bias(attn_mask, query.dtype)
        return fused(query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]
    # math: CUDA upcasts fp16/bf16 to float32 (allow_fp16_bf16_reduction_math_sdp is off by default)
    dtype = query.dtype
    attn_mask = _as_bias(attn_mask, dtype)  # as scaled_dot_product_attention converts a bool mask first
    if dtype in _LOW:
        query, key, value = query.float(), key.float(), value.float()
        if attn_mask is not None:
            attn_mask = attn_mask.float()
    if dropout_p > 0.0:
        out = _math_with_cuda_dropout(query, key, value, attn_mask, dropout_p, is_causal, scale)
    else:
        out = _aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale
        )[0]
    return out.to(dtype) if out.dtype != dtype else out


def _math_with_cuda_dropout(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` with dropout, op for op (``attention.cpp``), but with the
    dropout CUDA runs: inside the composite, ``at::dropout`` on CPU tensors keeps a float noise tensor
    of the probabilities' size, where CUDA's ``native_dropout`` keeps a ``bool`` mask."""
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    q = query * (-factor if scale is not None and scale < 0 else factor)
    if is_causal:
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
        attn_mask = _as_bias(keep, query.dtype)
    attn = torch.matmul(q, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = _aten._safe_softmax(attn, -1)
    attn = _aten.native_dropout(attn, dropout_p, True)[0]
    return torch.matmul(attn, value)


def attention_for(target: Target, chosen: Counter[str]) -> Callable[..., torch.Tensor]:
    """``F.scaled_dot_product_attention`` as ``target`` runs it; counts each choice in ``chosen``."""

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        **unknown: Any,
    ) -> torch.Tensor:
        if unknown:  # a newer PyTorch's argument: let PyTorch decide
            return torch.nn.functional.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
                **unknown,
            )
        backend = select_backend(target, query, key, value, attn_mask, dropout_p, is_causal)
        chosen[backend] += 1
        return run_backend(
            backend, query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )

    return sdpa
