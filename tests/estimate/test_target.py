"""The target device of an estimate: CUDA's autocast policy (as data, emulated on CPU fake tensors),
the SDPA kernel a GPU picks, and the target stated in every estimate's summary."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autocast_cases import CASES, expected_dtype, make_inputs
from resource_guard import ConfigurationError, estimate_memory
from resource_guard.estimate.emulate.attention import EFFICIENT, FLASH, MATH, select_backend
from resource_guard.estimate.emulate.cuda_autocast import CudaAutocast
from resource_guard.estimate.emulate.target import (
    APPEND_DTYPE,
    CUDA_BANNED,
    CUDA_FP32,
    CUDA_FP32_APPEND_DTYPE,
    CUDA_FP32_SET_OPT_DTYPE,
    CUDA_LOWER_PRECISION_FP,
    CUDA_PROMOTE,
    FP32,
    LOWER,
    PROMOTE,
    SET_DTYPE,
    Target,
    cuda_policy_of,
)
from resource_guard.estimate.trace.tracer import CATEGORIES

LOW_DTYPES = [torch.float16, torch.bfloat16]


# -- the policy as data ----------------------------------------------------------------------------
def test_the_lists_are_exactly_the_autocast_cuda_kernels_of_this_torch():
    lists = [
        CUDA_LOWER_PRECISION_FP,
        CUDA_FP32,
        CUDA_FP32_SET_OPT_DTYPE,
        CUDA_FP32_APPEND_DTYPE,
        CUDA_PROMOTE,
    ]
    union = frozenset().union(*lists, CUDA_BANNED)
    assert sum(len(x) for x in lists) + len(CUDA_BANNED) == len(union)  # no op in two lists
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    assert union == registered


# a sample of the PyTorch AMP docs' lists ("CUDA Ops that can autocast to float16 / float32", "promote")
DOCS_FP16 = [
    "addbmm",
    "addmm",
    "addmv",
    "addr",
    "baddbmm",
    "bmm",
    "conv1d",
    "conv2d",
    "linear",
    "matmul",
    "mm",
    "prelu",
]
DOCS_FP32 = [
    "acos",
    "exp",
    "layer_norm",
    "group_norm",
    "log",
    "pow.Tensor_Scalar",
    "mse_loss",
    "nll_loss",
    "l1_loss",
]
DOCS_FP32_REDUCTIONS = ["softmax.int", "log_softmax.int", "sum", "cumsum", "prod"]
DOCS_PROMOTE = [
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "index_put",
    "scatter_add",
    "tensordot",
]


@pytest.mark.parametrize(
    "names, policy",
    [(DOCS_FP16, LOWER), (DOCS_FP32, FP32), (DOCS_FP32_REDUCTIONS, SET_DTYPE), (DOCS_PROMOTE, PROMOTE)],
)
def test_a_sample_of_the_documented_ops_has_the_documented_policy(names, policy):
    assert {n: cuda_policy_of(f"aten::{n}") for n in names} == dict.fromkeys(names, policy)
    assert cuda_policy_of("aten::norm.Scalar") == APPEND_DTYPE
    assert cuda_policy_of("aten::gelu") is None and cuda_policy_of("aten::cat") is None


# -- the emulation, op by op -----------------------------------------------------------------------
@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_cuda_autocast_gives_the_cuda_dtype(case, low):
    fn, expected = CASES[case]
    inputs = make_inputs(low)
    with CudaAutocast(low):
        out = fn(inputs)
    assert out.dtype == expected_dtype(expected, low)


def test_cpu_autocast_would_not_give_the_cuda_dtypes():  # why the emulation exists
    h = torch.randn(4, 16).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu = (F.softmax(h, -1).dtype, F.layer_norm(h, (16,)).dtype)
    with CudaAutocast(torch.bfloat16):
        cuda = (F.softmax(h, -1).dtype, F.layer_norm(h, (16,)).dtype)
    assert cpu == (torch.bfloat16, torch.bfloat16) and cuda == (torch.float32, torch.float32)


class _Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_a_weight_is_cast_once_per_autocast_region_and_the_copy_released_at_its_end():
    weight = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)
    mode = CudaAutocast(torch.float16)
    with _Casts() as casts, mode:
        F.linear(F.linear(x, weight), weight)
        assert len(mode._cache) == 1
    assert casts.shapes.count((8, 8)) == 1  # the activation (4, 8) is cast, the weight once
    assert not mode._cache


def test_a_parameter_needing_no_grad_is_cast_every_time():  # CUDA caches only leaves that require grad
    weight = torch.randn(8, 8)
    with _Casts() as casts, CudaAutocast(torch.float16):
        F.linear(F.linear(torch.randn(4, 8), weight), weight)
    assert casts.shapes.count((8, 8)) == 2


def test_cross_entropy_keeps_half_log_probabilities_and_a_float32_copy_as_on_cuda():
    logits = torch.randn(32, 10, dtype=torch.float16, requires_grad=True)
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((func.__name__, out.dtype if isinstance(out, torch.Tensor) else out[0].dtype))
            return out

    with Log(), CudaAutocast(torch.float16):
        loss = F.cross_entropy(logits, torch.randint(0, 10, (32,)), label_smoothing=0.1)
    assert ("_log_softmax.default", torch.float16) in seen
    assert ("nll_loss_forward.default", torch.float32) in seen
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad is not None and logits.grad.dtype == torch.float16


def test_binary_cross_entropy_is_refused_as_cuda_autocast_refuses_it():
    p = torch.rand(4, dtype=torch.float16)
    with CudaAutocast(torch.float16), pytest.raises(ConfigurationError, match="with_logits"):
        F.binary_cross_entropy(p, p)


# -- the estimate for a CUDA target ----------------------------------------------------------------
B, L, D = 4, 256, 64


class _Attention(nn.Module):
    """Eager single-head attention whose saved tensors can be counted by hand (no hidden copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.bmm(self.q(x), self.k(x).transpose(1, 2))
        return torch.bmm(scores.softmax(-1), self.v(x)).float().sum()


def _activations_after_forward(device: str, precision: str = "16-mixed") -> tuple[int, str]:
    model = _Attention()
    est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(B, L, D),
                          lambda m, b: m(b), precision=precision, device=device)  # fmt: skip
    assert est.method == "traced", est.warnings
    forward = [sizes for phase, sizes in est.timeline if phase == "forward"]
    return forward[-1][CATEGORIES.index("activations")], est.assumed_target


def test_a_cuda_target_counts_the_float32_softmax_cuda_autocast_makes():
    n, probs = B * L * D, B * L * L
    cuda, summary = _activations_after_forward("a100-40gb")
    # saved: 3 fp16 casts of x (one per projection; x is no leaf, so not cached), the fp16 q, k, v,
    # the fp32 softmax output and its fp16 cast for the second bmm, the fp32 scalar loss
    assert cuda == 3 * 2 * n + 3 * 2 * n + (4 + 2) * probs + 4
    cpu, _ = _activations_after_forward("cpu")
    # CPU autocast runs softmax in fp16 (and its weight-cast cache may still hold the 3 fp16 weights)
    assert (
        3 * 2 * n + 3 * 2 * n + 2 * probs + 4 <= cpu <= 3 * 2 * n + 3 * 2 * n + 2 * probs + 4 + 3 * 2 * D * D
    )
    assert summary == "as on cuda sm80 (a100-40gb), 16-mixed, autocast policy: cuda"


def _saved_dtypes(fn, *args):
    saved: list[torch.dtype] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        fn(*args)
    return saved


@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_dropout_keeps_a_bool_mask_as_the_cuda_kernel_does(dtype):
    x = torch.randn(16, 32, requires_grad=True)
    assert _saved_dtypes(F.dropout, x, 0.1, True) == [torch.float32]  # the CPU path keeps its noise
    with CudaAutocast(dtype):
        assert _saved_dtypes(F.dropout, x, 0.1, True) == [torch.bool]
        assert _saved_dtypes(nn.Dropout(0.5).train(), x) == [torch.bool]
        assert _saved_dtypes(F.dropout, x, 0.1, False) == []  # eval: the input itself
        assert _saved_dtypes(F.dropout, x, 0.0, True) == []
        y = F.dropout(x, 0.1, True)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_a_cuda_target_counts_one_byte_an_element_for_a_dropout_mask():
    model = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.1), nn.Linear(D, D))
    batch = torch.randn(B * L, D)

    def activations(device: str) -> int:
        est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                              lambda m, b: m(b).sum(), device=device)  # fmt: skip
        forward = [sizes for phase, sizes in est.timeline if phase == "forward"]
        return forward[-1][CATEGORIES.index("activations")]

    n = B * L * D
    # kept: the dropout's output (the second linear's input), the model's output (alive through backward,
    # as a loop's variable: keep_outputs), the loss, and for the dropout's backward a bool mask on CUDA, a
    # float32 noise tensor on the CPU
    assert activations("cuda") == 4 * n + 4 * n + 1 * n + 4
    assert activations("cpu") - activations("cuda") == 3 * n


def test_every_estimate_states_the_target_it_assumed():
    model = nn.Linear(8, 8)
    batch = torch.randn(4, 8)
    cases = {
        "cpu": "as on cpu, bf16-mixed, autocast policy: cpu",
        "cuda": "as on cuda (sm80 assumed), bf16-mixed, autocast policy: cuda",
        "t4": "as on cuda sm75 (t4), bf16-mixed, autocast policy: cuda",
    }
    for device, summary in cases.items():
        est = estimate_memory(model, torch.optim.SGD, batch, lambda m, b: m(b).sum(), precision="bf16-mixed",
                              device=device)  # fmt: skip
        assert est.assumed_target == summary
        assert est.to_dict()["assumed_target"] == summary


@pytest.mark.parametrize(
    "device, capability",
    [("a100-40gb", (8, 0)), ("h100-80gb", (9, 0)), ("v100-16gb", (7, 0)), ("cuda", None), ("cpu", None)],
)
def test_the_target_capability_comes_from_the_catalog(device, capability):
    kind = "cpu" if device == "cpu" else "cuda"
    assert Target.of(device, kind).capability == capability


# -- attention kernels per target ------------------------------------------------------------------
A100, V100, T4, RTX4090 = (
    Target("cuda", "", (8, 0)),
    Target("cuda", "", (7, 0)),
    Target("cuda", "", (7, 5)),
    Target("cuda", "", (8, 9)),
)


def _qkv(dtype=torch.float16, head_dim=64, heads=4, seq=128, grad=True):
    return [torch.empty(2, heads, seq, head_dim, dtype=dtype, requires_grad=grad) for _ in range(3)]


@pytest.mark.parametrize(
    "target, dtype, head_dim, mask, expected",
    [
        (A100, torch.float16, 64, False, FLASH),
        (A100, torch.bfloat16, 128, False, FLASH),
        (A100, torch.float32, 64, False, EFFICIENT),  # flash is fp16/bf16 only
        (A100, torch.float16, 64, True, EFFICIENT),  # flash takes no mask
        (A100, torch.float16, 512, False, EFFICIENT),  # flash: head dim <= 256
        (A100, torch.float16, 60, False, FLASH),
        (A100, torch.float16, 60, True, MATH),  # efficient needs head dims aligned to 8 (fp16)
        (V100, torch.float16, 64, False, EFFICIENT),  # no flash before sm80
        (T4, torch.bfloat16, 64, False, MATH),  # no bf16 fused kernel before sm80
        (RTX4090, torch.float16, 208, False, EFFICIENT),  # sm89 backward: flash head dim <= 192
        (Target("cpu"), torch.float16, 64, False, MATH),
    ],
)
def test_the_sdpa_backend_is_chosen_per_target(target, dtype, head_dim, mask, expected):
    q, k, v = _qkv(dtype, head_dim)
    attn_mask = torch.ones(128, 128, dtype=torch.bool) if mask else None
    assert select_backend(target, q, k, v, attn_mask) == expected


class _NoDropout:
    """``torch.ops.aten`` with ``native_dropout`` as the identity, to compare with dropout-free math."""

    def __getattr__(self, name: str):
        if name == "native_dropout":
            return lambda x, p, train: (x, torch.ones_like(x, dtype=torch.bool))
        return getattr(torch.ops.aten, name)


@pytest.mark.parametrize("mask", [None, "float", "bool", "causal"])
@pytest.mark.parametrize("scale", [None, 0.3, -0.2])
def test_math_attention_with_dropout_is_the_math_composite_op_for_op(monkeypatch, mask, scale):
    from resource_guard.estimate.emulate import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64) for _ in range(3))
    bias = {"float": torch.randn(5, 5, dtype=torch.float64), "bool": torch.rand(5, 5) > 0.3}.get(mask or "")
    causal = mask == "causal"
    converted = attention._as_bias(bias, q.dtype)  # as scaled_dot_product_attention hands it to the kernel
    expected = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, converted, 0.0, causal, scale=scale
    )[0]
    monkeypatch.setattr(attention, "_aten", _NoDropout())
    got = attention._math_with_cuda_dropout(q, k, v, converted, 0.5, causal, scale)
    torch.testing.assert_close(got, expected)


def test_math_attention_on_a_cuda_target_keeps_a_bool_dropout_mask():
    from resource_guard.estimate.emulate.attention import run_backend

    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    kept: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_backend(MATH, q, k, v, dropout_p=0.1).sum().backward()
    probs = [dtype for shape, dtype in kept if shape == (2, 4, 16, 16)]
    assert torch.bool in probs and probs.count(torch.float32) == 1  # the softmax output, no noise


def test_causal_flash_needs_square_attention():
    q, k, v = _qkv()
    k_long, v_long = _qkv(seq=256)[1:]
    assert select_backend(A100, q, k_long, v_long, is_causal=True) == EFFICIENT
    assert select_backend(A100, q, k, v, is_causal=True) == FLASH


class _SdpaBlock(nn.Module):
    def __init__(self, heads: int = 4, dim: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).float().pow(2).mean()


@pytest.mark.parametrize(
    "device, precision, backend",
    [
        ("a100-40gb", "bf16-mixed", "flash"),
        ("v100-16gb", "16-mixed", "efficient"),
        ("t4", "bf16-mixed", "math"),
    ],
)
def test_the_estimate_traces_the_kernel_the_target_runs(device, precision, backend):
    model, seq = _SdpaBlock(), 2048
    est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, seq, 64),
                          lambda m, b: m(b), precision=precision, device=device)  # fmt: skip
    assert est.method == "traced", est.warnings
    assert est.assumed_target.endswith(f"attention: {backend}×1")
    act = [sizes[CATEGORIES.index("activations")] for phase, sizes in est.timeline if phase == "forward"][-1]
    probs = 2 * 4 * seq * seq  # elements of the (B, H, L, L) attention matrix
    if backend == "math":  # keeps the (B, H, L, L) float32 probabilities (fp16/bf16 inputs are upcast)
        assert act > 4 * probs
    else:  # keeps a float32 log-sum-exp per query row, never the probabilities
        assert act < probs


def test_eager_attention_stays_eager():
    est = estimate_memory(_Attention(), torch.optim.SGD, torch.randn(B, L, D), lambda m, b: m(b),
                          precision="16-mixed", device="a100-40gb")  # fmt: skip
    assert "attention:" not in est.assumed_target


# -- the GPU truth harness: its prediction half runs anywhere ----------------------------------------
@pytest.fixture
def harness(monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "gpu_truth.py"
    spec = importlib.util.spec_from_file_location("gpu_truth", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_truth", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_gpu_truth_harness_predicts_without_a_gpu(harness, monkeypatch, capsys):
    ids = harness._ids(2, 64, 256)

    def decoder(attention: str):
        return lambda: (harness.Decoder(256, 64, 2, 4, attention, attention == "eager"), (ids,))

    sdpa, eager = decoder("sdpa"), decoder("eager")
    tiny = [
        harness.Row("decoder-sdpa", "bf16-mixed", "adamw", sdpa),
        harness.Row("decoder-eager/ckpt", "16-mixed", "adafactor", eager),
        harness.Row("lstm", "32-true", "sgd", lambda: (harness.LstmLM(256, 32, 1), (ids[:, :16],))),
    ]
    monkeypatch.setattr(harness, "ROWS", tiny)
    assert harness.main(["--predict-only", "--device", "a100-40gb"]) == 0
    out = capsys.readouterr().out
    for row in tiny:
        line = next(x for x in out.splitlines() if x.startswith(harness._key(row) + " "))
        predicted = [float(v.replace(",", "")) for v in line.split()[1:] if v[0].isdigit()]
        assert len(predicted) == 3 and 0 < predicted[0] <= predicted[1] <= predicted[2]
    assert "as on cuda sm80 (a100-40gb), bf16-mixed, autocast policy: cuda, attention: flash×2" in out
    eager_line = next(x for x in out.splitlines() if f"{harness._key(tiny[1])}: predicted" in x)
    assert "autocast policy: cuda" in eager_line and "attention:" not in eager_line


def test_the_gpu_truth_harness_says_so_and_exits_cleanly_without_cuda(harness, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert harness.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


# -- activation checkpointing recomputes under the target's policy ---------------------------------
class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(_Attention() for _ in range(2))
        self.shift = nn.Parameter(torch.zeros(D))  # reentrant checkpointing needs an input needing grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = x + self.shift
        for block in self.blocks:
            x = x + checkpoint(lambda y, b=block: b.v(y) * b(y), x, use_reentrant=self.reentrant)
        return x.float().pow(2).mean()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_blocks_are_recomputed_under_the_cuda_policy(reentrant):
    import torch.utils.checkpoint as ckpt

    originals = (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction)  # these must exist
    model = _Checkpointed(reentrant)
    est = estimate_memory(model, torch.optim.AdamW, torch.randn(2, 64, D), lambda m, b: m(b),
                          precision="16-mixed", device="a100-40gb")  # fmt: skip
    assert est.method == "traced", est.warnings  # recomputed dtypes match the forward's
    assert (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction) == originals
