"""The device an estimate is *for* (:class:`Target`), and CUDA's autocast policy as data.

An estimate traces on fake CPU tensors, but the run it stands for may be on a GPU, where autocast
follows other rules than on the CPU: CUDA autocast runs ``softmax``, ``layer_norm``, ``exp``, ``sum``
and most losses in float32 and promotes ``addcmul``/``index_put``/... to the widest input type,
where CPU autocast runs them in the low-precision dtype. The lists below say which; they are applied
by :class:`~resource_guard.estimate.emulate.cuda_autocast.CudaAutocast`.

The lists are the exact registration names of the ``AutocastCUDA`` kernels of torch 2.13, read from
``ATen/autocast_mode.h`` (macros ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``)
and ``aten/src/ATen/autocast_mode.cpp`` (pytorch/pytorch@008ec6b1840c94ff6d0f685bc10fbf585167c673),
and equal to ``torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")`` (119 names; a
test keeps it so). Docs: "CUDA Ops that can autocast to float32" in PyTorch's ``amp.rst``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from resource_guard.devices import resolve_device
from resource_guard.errors import ConfigurationError

__all__ = [
    "APPEND_DTYPE",
    "AUTOCAST_SOURCE",
    "BANNED",
    "CUDA_BANNED",
    "CUDA_FP32",
    "CUDA_FP32_APPEND_DTYPE",
    "CUDA_FP32_SET_OPT_DTYPE",
    "CUDA_LOWER_PRECISION_FP",
    "CUDA_PROMOTE",
    "FP32",
    "LOWER",
    "PROMOTE",
    "SET_DTYPE",
    "Target",
    "cuda_policy_of",
    "python_policy_of",
]

AUTOCAST_SOURCE = (
    "torch 2.13 ATen/autocast_mode.h + aten/src/ATen/autocast_mode.cpp "
    "(pytorch/pytorch@008ec6b1840c94ff6d0f685bc10fbf585167c673), = AutocastCUDA registrations"
)

CUDA_LOWER_PRECISION_FP = frozenset({
    "aten::_convolution", "aten::_convolution.deprecated", "aten::_scaled_dot_product_flash_attention",
    "aten::_thnn_fused_gru_cell", "aten::_thnn_fused_lstm_cell", "aten::addbmm", "aten::addmm",
    "aten::addmv", "aten::addr", "aten::baddbmm", "aten::bmm", "aten::chain_matmul", "aten::conv1d",
    "aten::conv2d", "aten::conv3d", "aten::conv_tbc", "aten::conv_transpose1d",
    "aten::conv_transpose2d.input", "aten::conv_transpose3d.input", "aten::convolution",
    "aten::cudnn_convolution", "aten::cudnn_convolution_transpose", "aten::einsum", "aten::gru_cell",
    "aten::linalg_multi_dot", "aten::linalg_vecdot", "aten::linear", "aten::lstm_cell", "aten::matmul",
    "aten::mm", "aten::mv", "aten::prelu", "aten::rnn_relu_cell", "aten::rnn_tanh_cell",
    "aten::scaled_dot_product_attention",
})  # fmt: skip
CUDA_FP32 = frozenset({
    "aten::_upsample_bicubic2d_aa", "aten::_upsample_bilinear2d_aa", "aten::_upsample_nearest_exact1d",
    "aten::_upsample_nearest_exact2d", "aten::_upsample_nearest_exact3d", "aten::acos", "aten::asin",
    "aten::binary_cross_entropy_with_logits", "aten::cdist", "aten::cosh", "aten::cosine_embedding_loss",
    "aten::cosine_similarity", "aten::dist", "aten::erfinv", "aten::exp", "aten::expm1",
    "aten::frobenius_norm.dim", "aten::group_norm", "aten::hinge_embedding_loss", "aten::huber_loss",
    "aten::kl_div", "aten::l1_loss", "aten::layer_norm", "aten::log", "aten::log10", "aten::log1p",
    "aten::log2", "aten::logsumexp", "aten::margin_ranking_loss", "aten::mse_loss",
    "aten::multi_margin_loss", "aten::multilabel_margin_loss", "aten::native_layer_norm", "aten::nll_loss",
    "aten::nll_loss2d", "aten::nuclear_norm", "aten::nuclear_norm.dim", "aten::pdist",
    "aten::poisson_nll_loss", "aten::pow.Scalar", "aten::pow.Tensor_Scalar", "aten::pow.Tensor_Tensor",
    "aten::reciprocal", "aten::renorm", "aten::rms_norm", "aten::rsqrt", "aten::sinh",
    "aten::smooth_l1_loss", "aten::soft_margin_loss", "aten::softplus", "aten::tan",
    "aten::triplet_margin_loss", "aten::upsample_bicubic2d", "aten::upsample_bilinear2d",
    "aten::upsample_linear1d", "aten::upsample_nearest1d", "aten::upsample_nearest2d",
    "aten::upsample_nearest3d", "aten::upsample_trilinear3d",
})  # fmt: skip
# called with ``dtype=torch.float32`` when no dtype was given (no input cast by autocast itself)
CUDA_FP32_SET_OPT_DTYPE = frozenset({
    "aten::cumprod", "aten::cumsum", "aten::linalg_matrix_norm", "aten::linalg_matrix_norm.str_ord",
    "aten::linalg_vector_norm", "aten::log_softmax.int", "aten::prod", "aten::prod.dim_int",
    "aten::softmax.int", "aten::sum", "aten::sum.dim_IntList",
})  # fmt: skip
# redispatched to the overload taking a dtype, with float32
CUDA_FP32_APPEND_DTYPE = frozenset({"aten::norm.Scalar", "aten::norm.ScalarOpt_dim"})
CUDA_PROMOTE = frozenset({
    "aten::addcdiv", "aten::addcmul", "aten::atan2", "aten::bilinear", "aten::cross", "aten::dot",
    "aten::grid_sampler", "aten::index_put", "aten::scatter_add", "aten::tensordot", "aten::vdot",
})  # fmt: skip
CUDA_BANNED = frozenset({"aten::binary_cross_entropy"})  # raises under CUDA autocast

LOWER, FP32, SET_DTYPE, APPEND_DTYPE, PROMOTE, BANNED = (
    "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned",
)  # fmt: skip
_LISTS = (
    (LOWER, CUDA_LOWER_PRECISION_FP),
    (FP32, CUDA_FP32),
    (SET_DTYPE, CUDA_FP32_SET_OPT_DTYPE),
    (APPEND_DTYPE, CUDA_FP32_APPEND_DTYPE),
    (PROMOTE, CUDA_PROMOTE),
    (BANNED, CUDA_BANNED),
)


def cuda_policy_of(op: str) -> str | None:
    """The CUDA autocast policy of a registration name (``"aten::softmax.int"``), or ``None`` if unlisted.

    >>> cuda_policy_of("aten::layer_norm"), cuda_policy_of("aten::linear"), cuda_policy_of("aten::gelu")
    ('fp32', 'lower_precision_fp', None)
    """
    for policy, names in _LISTS:
        if op in names:
            return policy
    return None


def _python_names() -> dict[str, str]:
    """Policy by the name a ``TorchFunctionMode`` sees (``F.softmax``: ``softmax``; ``Tensor.pow``: ``pow``).

    An op with several listed overloads maps by its base name; a few Python-level spellings (the
    operators ``@`` and ``**``, ``F.grid_sample``, ``F.interpolate``) map to the op they reach.
    ``aten::lstm`` and friends are not in the lists above: on CUDA, cuDNN's RNN carries its own
    autocast kernel (``aten/src/ATen/native/cudnn/AutocastRNN.cpp``, built only with CUDA), which
    runs it in the low-precision dtype.
    """
    names: dict[str, str] = {}
    for policy, ops in _LISTS:
        for op in ops:
            names[op.split("::")[1].split(".")[0]] = policy
    names.update(
        {
            "__matmul__": LOWER, "__rmatmul__": LOWER, "multi_dot": LOWER,
            "lstm": LOWER, "gru": LOWER, "rnn_tanh": LOWER, "rnn_relu": LOWER,
            "__pow__": FP32, "__rpow__": FP32, "__rtruediv__": FP32, "__rdiv__": FP32,
            "interpolate": FP32, "grid_sample": PROMOTE, "norm": APPEND_DTYPE,
            "linalg_norm": SET_DTYPE, "cross_entropy": "cross_entropy",
            "scaled_dot_product_attention": "sdpa",
        }
    )  # fmt: skip
    del names["_scaled_dot_product_flash_attention"]  # a kernel, not a user-facing call
    return names


_PY_POLICY = _python_names()


def python_policy_of(func: Any) -> str | None:
    """The CUDA policy of what a ``TorchFunctionMode`` saw: a Python-level function or an ``OpOverload``.

    >>> python_policy_of(torch.nn.functional.softmax), python_policy_of(torch.ops.aten.mm.default)
    ('fp32_set_opt_dtype', 'lower_precision_fp')
    """
    if isinstance(func, torch._ops.OpOverload):  # a direct ``torch.ops.aten.x.y`` call: its exact name
        schema = func._schema
        return cuda_policy_of(schema.name + (f".{schema.overload_name}" if schema.overload_name else ""))
    return _PY_POLICY.get(getattr(func, "__name__", ""))


@dataclass(frozen=True)
class Target:
    """The device an estimate is for.

    Attributes:
        kind: ``"cuda"``, ``"rocm"``, ``"mps"`` or ``"cpu"``.
        name: the catalog name (``"a100-40gb"``) or the kind itself.
        capability: CUDA compute capability ``(major, minor)``; ``None`` where unknown or not NVIDIA.
    """

    kind: str
    name: str = ""
    capability: tuple[int, int] | None = None

    @property
    def cuda_like(self) -> bool:
        """Whether the target runs CUDA's autocast policy and fused attention kernels (CUDA, ROCm/HIP)."""
        return self.kind in ("cuda", "rocm")

    @classmethod
    def of(cls, device: Any, kind: str) -> Target:
        """The target of ``estimate_memory(device=...)`` once its ``kind`` is known.

        A catalog name or :class:`~resource_guard.devices.DeviceSpec` gives the compute capability;
        ``"cuda"``/``"cuda:N"`` gives it only where that GPU is present (read through NVML, no CUDA
        context); else it stays unknown.
        """
        spec = device if hasattr(device, "compute_capability") else None
        if spec is None and isinstance(device, str) and kind == "cuda":
            plain = device.strip().lower()
            if plain.split(":")[0] != "cuda" or torch.cuda.is_available():
                try:
                    spec = resolve_device(device.strip())
                except ConfigurationError:
                    spec = None
        if spec is None:
            return cls(kind, kind)
        cap = getattr(spec, "compute_capability", None)
        parts = str(cap).split(".")[:2] if cap else []
        parsed = (
            (int(parts[0]), int(parts[1])) if len(parts) == 2 and all(p.isdigit() for p in parts) else None
        )
        return cls(kind, str(spec.name), parsed)

    def describe(self) -> str:
        """``"cuda sm80 (a100-40gb)"``, ``"cuda (sm80 assumed)"``, ``"cpu"``."""
        if self.kind != "cuda":
            return self.kind if self.name in ("", self.kind) else f"{self.kind} ({self.name})"
        if self.capability is None:
            return "cuda (sm80 assumed)" if self.name in ("", "cuda") else f"cuda ({self.name}, sm80 assumed)"
        sm = f"sm{self.capability[0]}{self.capability[1]}"
        return f"cuda {sm}" if self.name in ("", "cuda") else f"cuda {sm} ({self.name})"
