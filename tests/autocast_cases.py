"""Op-by-op cases of CUDA autocast, shared by the CPU emulation tests and the real-GPU comparison.

Each case maps a name to ``(fn, expected)``: ``fn(t)`` runs one call on the tensors of
:func:`make_inputs`, ``expected`` is the output dtype CUDA autocast gives by its op lists (``LOW`` =
the autocast dtype). tests/estimate/test_target.py checks the emulation against ``expected``;
tests/test_gpu.py checks real ``torch.autocast("cuda")`` against the emulation.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

LOW = "low"  # the autocast dtype (float16 or bfloat16)


def make_inputs(low: torch.dtype, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Small tensors on ``device``: float32 activations ``x`` and weights, ``h``: ``x`` in ``low``."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    x = randn(4, 8, 16)
    return {
        "x": x,
        "h": x.to(low),
        "w": nn.Parameter(randn(16, 16)),
        "b": nn.Parameter(randn(16)),
        "img": randn(2, 4, 8, 8),
        "kernel": nn.Parameter(randn(4, 4, 3, 3)),
        "labels": torch.randint(0, 16, (32,), generator=gen).to(device),
        "device": torch.device(device),
    }


def _module(cls: Callable[..., nn.Module], t: dict[str, Any], *args: Any, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    module = cls(*args, **kwargs)
    return module if t["device"].type == "cpu" else module.to(t["device"])


def _low(t: dict[str, Any]) -> torch.Tensor:
    return t["h"]


CASES: dict[str, tuple[Callable[[dict[str, Any]], torch.Tensor], str | torch.dtype]] = {
    # lower_precision_fp
    "linear": (lambda t: F.linear(t["x"], t["w"], t["b"]), LOW),
    "matmul_operator": (lambda t: t["x"] @ t["w"], LOW),
    "bmm": (lambda t: torch.bmm(t["x"], t["x"].transpose(1, 2)), LOW),
    "baddbmm": (lambda t: torch.baddbmm(t["x"], t["x"], t["w"].expand(4, 16, 16)), LOW),
    "addmm": (lambda t: torch.addmm(t["b"], t["x"][0], t["w"]), LOW),
    "einsum": (lambda t: torch.einsum("bij,jk->bik", t["x"], t["w"]), LOW),
    "conv2d": (lambda t: F.conv2d(t["img"], t["kernel"]), LOW),
    "lstm": (lambda t: _module(nn.LSTM, t, 16, 8, batch_first=True)(t["x"])[0], LOW),
    "sdpa": (lambda t: F.scaled_dot_product_attention(*(t["x"].view(4, 8, 2, 8).transpose(1, 2),) * 3), LOW),
    # fp32
    "layer_norm": (lambda t: F.layer_norm(_low(t), (16,)), torch.float32),
    "group_norm": (lambda t: F.group_norm(t["img"].to(_low(t).dtype), 2), torch.float32),
    "exp": (lambda t: _low(t).exp(), torch.float32),
    "pow": (lambda t: _low(t) ** 2, torch.float32),
    "rsqrt": (lambda t: torch.rsqrt(_low(t)), torch.float32),
    "mse_loss": (lambda t: F.mse_loss(_low(t), t["x"]), torch.float32),
    "nll_loss": (lambda t: F.nll_loss(_low(t)[0], t["labels"][:8]), torch.float32),
    "cross_entropy": (lambda t: F.cross_entropy(_low(t).reshape(32, 16), t["labels"]), torch.float32),
    "bce_with_logits": (
        lambda t: F.binary_cross_entropy_with_logits(_low(t), t["x"].sigmoid()),
        torch.float32,
    ),
    "interpolate": (lambda t: F.interpolate(t["img"].to(_low(t).dtype), scale_factor=2.0), torch.float32),
    # fp32_set_opt_dtype / fp32_append_dtype
    "softmax": (lambda t: F.softmax(_low(t), dim=-1), torch.float32),
    "log_softmax_method": (lambda t: _low(t).log_softmax(-1), torch.float32),
    "softmax_explicit_dtype": (lambda t: torch.softmax(_low(t), -1, dtype=_low(t).dtype), LOW),
    "sum": (lambda t: _low(t).sum(), torch.float32),
    "cumsum": (lambda t: torch.cumsum(_low(t), 1), torch.float32),
    "norm": (lambda t: _low(t).norm(), torch.float32),
    "normalize": (lambda t: F.normalize(_low(t), dim=-1), torch.float32),
    # promote
    "addcmul": (lambda t: torch.addcmul(t["x"], _low(t), _low(t)), torch.float32),
    "atan2": (lambda t: torch.atan2(_low(t), t["x"]), torch.float32),
    # not listed: the input's dtype
    "gelu": (lambda t: F.gelu(_low(t)), LOW),
    "relu_fp32": (lambda t: F.relu(t["x"]), torch.float32),
    "dropout": (lambda t: F.dropout(_low(t), 0.1), LOW),
    # composites: multi-head attention's linear projections and (returned) fp32 softmax weights
    "mha_output": (
        lambda t: _module(nn.MultiheadAttention, t, 16, 2, batch_first=True)(*(t["x"],) * 3)[0],
        LOW,
    ),
    "mha_weights": (
        lambda t: _module(nn.MultiheadAttention, t, 16, 2, batch_first=True)(*(t["x"],) * 3)[1],
        torch.float32,
    ),
}


def expected_dtype(expected: str | torch.dtype, low: torch.dtype) -> torch.dtype:
    return low if expected == LOW else expected  # type: ignore[return-value]


# -- autocast regions a model opens inside the step's region ------------------------------------------
# Each case maps a name to ``(fn, expected)``: ``fn(t)`` returns a tuple of tensors computed under the
# step's autocast (``LOW``) with regions of its own, ``expected`` their dtypes on CUDA. The regions name
# ``x.device.type`` as models do: "cuda" on a GPU, "cpu" for the fake tensors of an estimate.
class _Fp32Matmul(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a @ b  # float32 only if the low-precision ``a`` was cast and autocast is off inside

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return grad @ b.t(), a.t() @ grad


@torch.autocast("cuda", enabled=False)  # built at import, before any estimate
def _fp32_scores(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).softmax(-1)


def _enabled_false(t: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    x, w = t["x"], t["w"]
    outside = F.linear(x, w)
    with torch.autocast(x.device.type, enabled=False):
        scores = x @ w
        probs = torch.softmax(scores, -1)
        kept_low = F.linear(outside, w.to(outside.dtype))  # autocast off: the input's dtype
    return outside, scores, probs, kept_low, x @ w


def _cuda_amp_enabled_false(t: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.autocast is deprecated
        region = torch.cuda.amp.autocast(enabled=False)
    with region:
        inside = t["x"] @ t["w"]
    return inside, t["x"] @ t["w"]


def _nested_dtype(t: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    x = t["x"]
    w = nn.Parameter(t["w"].detach().clone())  # a weight no enclosing region has cast and cached
    with torch.autocast(x.device.type, dtype=torch.float16):
        half = F.linear(x, w)
        with torch.autocast(x.device.type, enabled=False):
            full = F.linear(x, w)
            with torch.autocast(x.device.type):  # no dtype: the device's, as the float16 region set it
                again = F.linear(x, w)
    return half, full, again, F.linear(x, t["w"])


def _custom_fwd(t: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return (_Fp32Matmul.apply(_low(t), t["w"]),)


def _decorated(t: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return _fp32_scores(t["x"], t["w"]), t["x"] @ t["w"]


REGION_CASES: dict[str, tuple[Callable[[dict[str, Any]], tuple[torch.Tensor, ...]], tuple[Any, ...]]] = {
    "enabled_false": (_enabled_false, (LOW, torch.float32, torch.float32, LOW, LOW)),
    "cuda_amp_enabled_false": (_cuda_amp_enabled_false, (torch.float32, LOW)),
    "nested_dtype": (_nested_dtype, (torch.float16, torch.float32, torch.float16, LOW)),
    "custom_fwd_cast_inputs": (_custom_fwd, (torch.float32,)),
    "decorator_built_at_import": (_decorated, (torch.float32, LOW)),
}
