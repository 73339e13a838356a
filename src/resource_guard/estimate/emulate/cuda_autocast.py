"""CUDA autocast emulated over CPU fake tensors: :class:`CudaAutocast`.

CUDA autocast cannot run in an estimate: on a CPU-only build ``torch.autocast("cuda")`` switches
itself off, and autograd on fake CUDA tensors aborts the process. So the policy of
:mod:`resource_guard.estimate.emulate.target` is applied here, one level above autograd as the real
``AutocastCUDA`` kernels are: a ``TorchFunctionMode`` sees ``linear``, ``layer_norm``, ``softmax``,
``cross_entropy`` ... and casts their arguments, caching the low-precision copy of each float32 leaf
weight for the autocast region (a weight used twice is cast once, and its copy lives until the region
ends or backward frees it, as on CUDA). Autograd records the casts, so backward keeps what CUDA keeps.
The state it applies is the thread's CUDA autocast state, which the autocast regions the model opens
inside change as on a GPU (:mod:`resource_guard.estimate.emulate.autocast_regions`): ``enabled=False`` turns
the policy off, a region with another dtype switches it.

Dropout, with or without autocast: on CUDA ``at::dropout`` runs the fused ``native_dropout`` kernel
(``is_fused_kernel_acceptable`` in ``aten/src/ATen/native/Dropout.cpp``: a CUDA tensor, ``0 < p < 1``,
not empty), which keeps a one-byte ``bool`` mask for backward; on the CPU it multiplies by a noise
tensor of the input's dtype and keeps that (four bytes an element in float32). :func:`_cuda_dropout`
runs the CUDA path. In-place dropout (``dropout_``) keeps its noise on CUDA too and is left as is.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.emulate.autocast_regions import emulated_lower, outer_region
from resource_guard.estimate.emulate.target import (
    APPEND_DTYPE,
    BANNED,
    FP32,
    LOWER,
    PROMOTE,
    SET_DTYPE,
    python_policy_of,
)

__all__ = ["CudaAutocast"]


def _eligible(t: Any) -> bool:
    """CUDA autocast casts defined floating tensors other than float64 (``is_autocast_eligible``)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _map_args(fn: Callable[[torch.Tensor], torch.Tensor], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def one(a: Any) -> Any:
        if _eligible(a):
            return fn(a)
        if isinstance(a, (list, tuple)) and any(_eligible(x) for x in a):
            return type(a)(fn(x) if _eligible(x) else x for x in a)
        return a

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _has_dtype(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


def _first_tensor(args: tuple, kwargs: dict) -> Any:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


class CudaAutocast(TorchFunctionMode):
    """CUDA autocast (``dtype`` float16 or bfloat16) applied to CPU fake tensors, for the forward pass.

    ``attention`` runs ``scaled_dot_product_attention`` after its inputs were cast (see
    :mod:`resource_guard.estimate.emulate.attention`); ``dtype=None`` applies no autocast of its own, only
    that
    (a region the model opens may still turn autocast on, as on a GPU).
    ``calls`` counts, per policy, the calls that were cast. ``cache=False`` casts weights afresh each
    time (activation checkpointing recomputes a block in its own short autocast region).

    Example:
        >>> with CudaAutocast(torch.float16):
        ...     x = torch.randn(4, 8)
        ...     F.linear(x, torch.randn(3, 8)).dtype, F.softmax(x.half(), -1).dtype
        (torch.float16, torch.float32)
    """

    def __init__(
        self,
        dtype: torch.dtype | None,
        attention: Callable[..., torch.Tensor] | None = None,
        *,
        cache: bool = True,
    ) -> None:
        super().__init__()
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise ConfigurationError(
                f"`CudaAutocast(dtype={dtype!r})` must be torch.float16 or torch.bfloat16"
            )
        self.dtype = dtype
        self.attention = attention
        self.calls: Counter[str] = Counter()
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._caching = cache
        self._depth = 0
        self._region: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> CudaAutocast:
        self._depth += 1
        if self._depth == 1:  # the step's own region; the model's regions inside are routed to it
            self._region = outer_region(self.dtype, self._cache)
            self._region.__enter__()
        try:
            return super().__enter__()  # type: ignore[no-any-return]
        except BaseException:
            self._leave(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._leave(*exc)

    def _leave(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._region is not None:
            region, self._region = self._region, None
            region.__exit__(*exc)  # restores the CUDA autocast state; clears the weight-cast cache

    # -- casts ---------------------------------------------------------------------------------------
    def _to_lower(self, t: torch.Tensor, low: torch.dtype) -> torch.Tensor:
        """``cached_cast`` of ``aten/src/ATen/autocast_mode.cpp``: keyed by the source tensor alone."""
        if t.dtype == low:
            return t
        cacheable = (
            self._caching
            and torch.is_autocast_cache_enabled()
            and t.dtype == torch.float32
            and t.is_leaf
            and t.requires_grad
            and not t._is_view()
        )
        if not cacheable:
            return t.to(low)
        hit = self._cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self._cache[id(t)] = (t, t.to(low))
        return hit[1]

    @staticmethod
    def _to_fp32(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float32 else t.float()

    # -- the mode ------------------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if func is torch.dropout:
            return _cuda_dropout(*args, **kwargs)
        policy = python_policy_of(func)
        if policy == "sdpa":
            return self._sdpa(func, args, kwargs)
        low = emulated_lower()  # the step's dtype, or what a region the model opened asks for
        if low is None or policy is None or kwargs.get("out") is not None:
            if policy is None and _is_python_composite(func):
                return _run_composite(self, func, args, kwargs)
            return func(*args, **kwargs)
        first = _first_tensor(args, kwargs)
        if policy == BANNED:
            raise ConfigurationError(
                "`F.binary_cross_entropy` is refused under CUDA autocast (PyTorch raises: unsafe to "
                "autocast); use `F.binary_cross_entropy_with_logits` / `nn.BCEWithLogitsLoss`."
            )
        if not _eligible(first) and policy in (FP32, SET_DTYPE, APPEND_DTYPE):
            return func(*args, **kwargs)
        self.calls[policy] += 1
        if policy == LOWER:
            args, kwargs = _map_args(lambda t: self._to_lower(t, low), args, kwargs)
        elif policy == FP32:
            args, kwargs = _map_args(self._to_fp32, args, kwargs)
        elif policy in (SET_DTYPE, APPEND_DTYPE):
            if _has_dtype(args, kwargs):
                return func(*args, **kwargs)
            return self._fp32_out(func, name, args, kwargs)
        elif policy == PROMOTE:
            widest = max(
                (a.dtype for a in (*args, *kwargs.values()) if _eligible(a)),
                key=lambda d: torch.finfo(d).bits,
                default=None,
            )
            if widest is not None:
                args, kwargs = _map_args(lambda t: t.to(widest), args, kwargs)
        elif policy == "cross_entropy":
            return _cross_entropy(self, *args, **kwargs)
        return func(*args, **kwargs)

    def _fp32_out(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        x = args[0] if args else kwargs.get("input")
        fake_half = (
            isinstance(x, torch.Tensor)
            and x.dtype == torch.float16
            and (isinstance(x, FakeTensor) or x.is_meta)
        )
        if name in ("softmax", "log_softmax") and fake_half:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int):  # CUDA's softmax of a half input: no float32 copy (half_to_float)
                kernel = torch.ops.aten._softmax if name == "softmax" else torch.ops.aten._log_softmax
                return kernel(x, dim, True)
        return func(*args, **{**kwargs, "dtype": torch.float32})

    def _sdpa(self, func: Any, args: tuple, kwargs: dict) -> Any:
        low = emulated_lower()
        if low is not None:
            self.calls[LOWER] += 1
            args, kwargs = _map_args(lambda t: self._to_lower(t, low), args, kwargs)
        if self.attention is None:
            return func(*args, **kwargs)
        return self.attention(*args, **kwargs)


def _cuda_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``torch.dropout`` as CUDA runs it: ``native_dropout`` (a ``bool`` mask saved) where fused.

    >>> x = torch.randn(8, 8, requires_grad=True)
    >>> type(_cuda_dropout(x, 0.1, True).grad_fn).__name__
    'NativeDropoutBackward0'
    """
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, train)[0]
    return torch.dropout(input, p, train)


def _cross_entropy(
    mode: CudaAutocast,
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` as it runs under CUDA autocast (``aten::cross_entropy_loss`` is not listed).

    Its C++ decomposition calls ``log_softmax`` with an explicit dtype (the input's, so it stays in
    float16), then ``nll_loss`` (fp32 policy: a float32 copy of the log-probabilities); a label
    smoothing term sums the log-probabilities in float32 (``sum``: fp32_set_opt_dtype).
    """
    if size_average is not None or reduce is not None:
        reduction = F._Reduction.legacy_get_string(size_average, reduce)  # type: ignore[attr-defined]
    class_dim = 1 if input.dim() > 1 else 0
    logp = torch.log_softmax(input, class_dim, dtype=input.dtype)
    weight32 = mode._to_fp32(weight) if weight is not None and _eligible(weight) else weight
    n_classes = input.shape[class_dim]
    if target.is_floating_point():  # class probabilities
        if label_smoothing > 0:
            target = target * (1 - label_smoothing) + label_smoothing / n_classes
        prod = logp * target
        if weight32 is not None:
            shape = [1] * input.dim()
            shape[class_dim] = n_classes
            prod = prod * weight32.view(shape)
        loss = -prod.sum(class_dim, dtype=torch.float32)
        if reduction == "mean":
            return loss.sum() / max(1, input.numel() // max(1, n_classes))
        return loss.sum() if reduction == "sum" else loss
    nll = F.nll_loss(mode._to_fp32(logp), target, weight32, ignore_index=ignore_index, reduction=reduction)
    if label_smoothing <= 0:
        return nll
    smooth = -logp.sum(class_dim, dtype=torch.float32)
    smooth = smooth.masked_fill(target == ignore_index, 0.0)
    if reduction == "mean":
        smooth = smooth.sum() / (target != ignore_index).sum().clamp(min=1)
    elif reduction == "sum":
        smooth = smooth.sum()
    return (1 - label_smoothing) * nll + label_smoothing * (smooth / n_classes)


_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _is_python_composite(func: Any) -> bool:
    """A Python function of ``torch.nn.functional`` whose body calls other torch functions."""
    return isinstance(func, types.FunctionType) and func.__module__ == "torch.nn.functional"


def _run_composite(mode: CudaAutocast, func: types.FunctionType, args: tuple, kwargs: dict) -> Any:
    """Run the body of a Python ``torch.nn.functional`` composite with ``mode`` seeing the calls inside.

    A function mode is popped while it handles a call, so the calls inside a Python composite (the
    ``linear``/``bmm``/``softmax`` of ``F.multi_head_attention_forward``) would escape the policy; CUDA
    autocast sees them, being a dispatch key. The body is run again with the mode pushed and its own
    ``has_torch_function*`` entry checks answering False (else it would hand the call straight back to
    the mode). This leans on ``torch.nn.functional`` importing those checks as module globals; if that
    changes, the function runs as before, with the mode popped (tests/estimate/test_target.py notices).
    """
    if not all(name in func.__globals__ for name in _CHECKS):
        return func(*args, **kwargs)
    scope = dict(func.__globals__)
    scope.update(dict.fromkeys(_CHECKS, lambda *a, **k: False))
    body = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    with mode:
        return body(*args, **kwargs)
