"""Autocast regions a model opens inside its forward, honoured by the emulated CUDA autocast as on a GPU
(:mod:`resource_guard.estimate.emulate.autocast_regions`)."""

from __future__ import annotations

import inspect
import threading
import warnings
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import resource_guard.estimate.emulate.autocast_regions as regions
from autocast_cases import REGION_CASES, expected_dtype, make_inputs
from resource_guard import ResourceGuardWarning, estimate_memory
from resource_guard.estimate.emulate.autocast_regions import AutocastState, applied
from resource_guard.estimate.emulate.cuda_autocast import CudaAutocast
from resource_guard.estimate.emulate.target import Target
from resource_guard.estimate.trace.fake_world import TargetForward
from resource_guard.estimate.trace.tracer import CATEGORIES

LOW_DTYPES = [torch.float16, torch.bfloat16]


def _entry_points() -> tuple[object, ...]:
    amp = torch.amp.autocast_mode
    return (
        amp.autocast.__dict__["__init__"],
        amp.autocast.__dict__["__enter__"],
        amp.autocast.__dict__["__exit__"],
        torch.is_autocast_enabled,
        torch.get_autocast_dtype,
        amp._cast,
    )


ORIGINALS = _entry_points()


def test_the_wrapped_entry_points_are_the_ones_torch_calls():
    # the wrappers replace exactly these; if torch moves them, this fails before any estimate does
    amp = torch.amp.autocast_mode
    assert {"__init__", "__enter__", "__exit__"} <= set(amp.autocast.__dict__)
    assert torch.autocast is torch.amp.autocast is amp.autocast
    for cls in (torch.cuda.amp.autocast, torch.cpu.amp.autocast):  # the deprecated forms defer to it
        assert issubclass(cls, amp.autocast)
        assert "super().__enter__()" in inspect.getsource(cls.__enter__)
    assert "torch.get_autocast_dtype(device_type)" in inspect.getsource(amp.autocast.__init__)
    custom_fwd = inspect.getsource(amp.custom_fwd)
    assert "_cast(args, device_type, cast_inputs)" in custom_fwd
    assert "torch.is_autocast_enabled(device_type)" in custom_fwd
    checkpoint = inspect.getsource(torch.utils.checkpoint._get_autocast_kwargs)
    assert "torch.is_autocast_enabled(device_type)" in checkpoint


# -- op by op ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(REGION_CASES))
def test_a_region_the_model_opens_gives_the_cuda_dtypes(case, low):
    fn, expected = REGION_CASES[case]
    with CudaAutocast(low):
        out = fn(make_inputs(low))
    assert tuple(t.dtype for t in out) == tuple(expected_dtype(e, low) for e in expected)
    assert _entry_points() == ORIGINALS


def test_a_step_without_autocast_runs_a_region_that_enables_it():
    x, w = torch.randn(4, 8), nn.Parameter(torch.randn(8, 8))
    with CudaAutocast(None):
        assert F.linear(x, w).dtype == torch.float32
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            assert F.linear(x, w).dtype == torch.bfloat16
            assert F.softmax(x, -1).dtype == torch.float32
        assert F.linear(x, w).dtype == torch.float32


def test_the_region_is_restored_when_its_body_raises():
    x, w = torch.randn(4, 8), nn.Parameter(torch.randn(8, 8))
    with CudaAutocast(torch.float16):
        with pytest.raises(ValueError), torch.autocast(x.device.type, enabled=False):
            assert F.linear(x, w).dtype == torch.float32
            raise ValueError("in the region")
        assert F.linear(x, w).dtype == torch.float16
        assert torch.is_autocast_enabled(x.device.type) and torch.is_autocast_enabled("cuda")
    assert not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
    assert _entry_points() == ORIGINALS


def test_queries_by_device_type_answer_for_cuda_as_on_a_gpu():
    x = torch.randn(2)
    assert not torch.is_autocast_enabled(x.device.type)
    with CudaAutocast(torch.bfloat16):
        assert torch.is_autocast_enabled(x.device.type) and torch.is_autocast_enabled()
        assert torch.get_autocast_dtype(device_type=x.device.type) == torch.bfloat16
        with torch.autocast(x.device.type, enabled=False):
            assert not torch.is_autocast_enabled(x.device.type)
    assert (
        torch.get_autocast_dtype("cpu") == torch.bfloat16
        and torch.get_autocast_dtype("cuda") == torch.float16
    )


def test_other_threads_keep_torch_s_own_autocast():
    seen: list[tuple[bool, torch.dtype]] = []

    def other() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.randn(4, 8)
            seen.append((torch.is_autocast_enabled("cpu"), (h @ h.t()).dtype))

    with CudaAutocast(torch.float16):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen == [(True, torch.bfloat16)]  # the real CPU autocast, untouched by the routing


def test_no_cuda_unavailable_warning_from_a_region_asking_for_cuda():
    x, w = torch.randn(4, 8), nn.Parameter(torch.randn(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "CUDA is not available ... Disabling autocast"
        with CudaAutocast(torch.bfloat16), torch.autocast("cuda", dtype=torch.float16):
            assert F.linear(x, w).dtype == torch.float16


# -- the weight-cast cache, as aten/src/ATen/autocast_mode.cpp keeps it ---------------------------------
class _WeightCasts(TorchDispatchMode):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _program(x: torch.Tensor, w: nn.Parameter) -> None:
    F.linear(x, w)
    with torch.autocast(x.device.type, enabled=False):  # a nested region's exit keeps the cache
        F.linear(x, w)
    F.linear(x, w)
    with torch.autocast(x.device.type, cache_enabled=False):  # no caching inside
        F.linear(x, w)
        F.linear(x, w)
    F.linear(x, w)


@pytest.mark.parametrize("step_autocast", [True, False], ids=["mixed", "true"])
def test_weight_casts_are_cached_as_real_autocast_caches_them(step_autocast):
    # ``cached_cast`` is shared by every autocast device: the real CPU autocast is the oracle
    x, w = torch.randn(4, 8), nn.Parameter(torch.randn(8, 8))

    def run(outer: object) -> int:
        with _WeightCasts((8, 8)) as casts:
            if step_autocast:
                with outer:  # type: ignore[attr-defined]
                    _program(x, w)
            else:  # no step region: each of the program's own regions is outermost
                with outer:  # type: ignore[attr-defined]
                    for _ in range(2):
                        with torch.autocast(x.device.type, dtype=torch.bfloat16):
                            F.linear(x, w)
        return casts.count

    real = run(torch.autocast("cpu", dtype=torch.bfloat16) if step_autocast else nullcontext())
    emulated = run(CudaAutocast(torch.bfloat16 if step_autocast else None))
    assert emulated == real == (3 if step_autocast else 2)


def test_a_cached_copy_is_returned_whatever_the_nested_region_asks_as_real_autocast_does():
    x, w = torch.randn(4, 8), nn.Parameter(torch.randn(8, 8))
    errors = []
    for outer in (torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocast(torch.bfloat16)):
        with outer:
            F.linear(x, w)  # cached in bfloat16 ...
            with torch.autocast(x.device.type, dtype=torch.float16), pytest.raises(RuntimeError) as err:
                F.linear(x, w)  # ... and handed to a float16 matmul: CUDA raises too
            errors.append("same dtype" in str(err.value))
    assert errors == [True, True]


# -- the estimate counts what CUDA keeps ------------------------------------------------------------------
B, L, D = 2, 128, 32
BF16 = torch.bfloat16


class _Scores(nn.Module):
    """Scores computed in float32 inside ``enabled=False`` (``region``), or under the step's autocast.

    ``by_hand``: the same step with autocast written out as CUDA runs it (traced without autocast),
    its weight-cast cache included: the bfloat16 weights live until the forward ends.
    """

    def __init__(self, region: bool, by_hand: bool) -> None:
        super().__init__()
        self.region, self.by_hand = region, by_hand
        self.q, self.k = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.by_hand:
            cache = [self.q.weight.to(BF16), self.k.weight.to(BF16)]
            q, k = F.linear(x.to(BF16), cache[0]), F.linear(x.to(BF16), cache[1])
        else:
            q, k = self.q(x), self.k(x)
        if self.region:
            with nullcontext() if self.by_hand else torch.autocast(x.device.type, enabled=False):
                scores = torch.bmm(q.float(), k.float().transpose(1, 2))
                probs = scores.softmax(-1)
        elif self.by_hand:  # bmm casts to bfloat16, softmax runs in float32 (CUDA's lists)
            scores = torch.bmm(q.float().to(BF16), k.float().transpose(1, 2).to(BF16))
            probs = scores.softmax(-1, dtype=torch.float32)
        else:
            scores = torch.bmm(q.float(), k.float().transpose(1, 2))
            probs = scores.softmax(-1)
        return probs.sum(dtype=torch.float32) if self.by_hand else probs.sum()


def _bytes(region: bool, by_hand: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    model = _Scores(region, by_hand)
    est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(B, L, D),
                          lambda m, b: m(b), precision="32-true" if by_hand else "bf16-mixed",
                          device="a100-40gb")  # fmt: skip
    assert est.method == "traced", est.warnings
    forward = [sizes for phase, sizes in est.timeline if phase == "forward"]
    return forward[-1][CATEGORIES.index("activations")], est.peak_bytes


def test_the_estimate_counts_the_float32_a_disabled_region_keeps_exactly_as_written_by_hand():
    with_region = _bytes(region=True, by_hand=False)
    assert with_region == _bytes(region=True, by_hand=True)
    without = _bytes(region=False, by_hand=False)
    assert without == _bytes(region=False, by_hand=True)
    # bmm keeps its inputs: float32 copies of q and k inside the region, bfloat16 casts outside
    assert with_region[0] - without[0] == 2 * (4 - 2) * B * L * D


def test_the_wrappers_are_gone_after_an_estimate_whose_step_raises():
    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        region = torch.autocast(x.device.type, enabled=False)
        region.__enter__()  # never exited
        with torch.autocast("cuda", dtype=torch.float16):
            raise ValueError("the user's step fails")

    model = nn.Linear(8, 8)
    with pytest.warns(ResourceGuardWarning, match="ValueError"):
        est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8),
                              loss_fn, precision="bf16-mixed", device="a100-40gb")  # fmt: skip
    assert est.method != "traced"
    assert _entry_points() == ORIGINALS
    assert not torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16
    assert not torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()
    assert regions._users == 0 and regions._here.routing == 0 and regions._here.nesting == 0


class _CheckpointedRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        def block(y: torch.Tensor) -> torch.Tensor:
            return torch.bmm(y, y.transpose(1, 2)).softmax(-1).sum(-1)

        h = self.proj(x)
        with torch.autocast(x.device.type, enabled=False):  # recomputed as it ran: in float32
            out = checkpoint(block, h.float(), use_reentrant=False)
        return out.float().mean()


def test_a_block_checkpointed_inside_a_region_is_recomputed_in_its_state():
    seen: list[torch.dtype] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.bmm.default:
                seen.append(out.dtype)
            return out

    model = _CheckpointedRegion()
    est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(B, L, D),
                          lambda m, b: m(b), precision="16-mixed", device="a100-40gb")  # fmt: skip
    # non-reentrant checkpointing raises (and the estimate falls back) if a recomputed tensor's dtype
    # differs from the one saved in forward
    assert est.method == "traced", est.warnings
    record = TargetForward(Target("cuda"), "cuda", recompute_mode=CudaAutocast(torch.float16, cache=False))
    with CudaAutocast(torch.float16), applied(AutocastState(False, torch.float16, True)):
        run = record.recompute(lambda y: torch.bmm(y, y.transpose(1, 2)))
    with Record():
        run(torch.randn(2, 4, 4))  # in backward: the state of the forward, not the step's float16
    assert seen == [torch.float32]


# -- transformers models ---------------------------------------------------------------------------------
class _OutputDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: dict[str, list[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor):
            self.dtypes.setdefault(func.overloadpacket.__name__, []).append(first.dtype)
        return out


def test_transformers_upcast_attention_runs_its_scores_in_float32_as_on_cuda():
    # GPT-2's ``reorder_and_upcast_attn``: ``baddbmm`` in ``maybe_autocast(query.device.type, enabled=False)``
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  reorder_and_upcast_attn=True, attn_implementation="eager")  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    with _OutputDtypes() as seen, CudaAutocast(torch.float16):
        model(input_ids=ids, labels=ids).loss.backward()
    assert seen.dtypes["baddbmm"] == [torch.float32]  # a matmul CUDA autocast would run in float16
    assert set(seen.dtypes["addmm"]) == {torch.float16}


def test_transformers_norm_cast_by_hand_under_a_disabled_region_stays_low_as_on_cuda():
    # Nemotron's LayerNorm1P: inputs cast to ``torch.get_autocast_dtype(device_type)`` when
    # ``torch.is_autocast_enabled()``, then ``layer_norm`` in ``maybe_autocast(..., enabled=False)``
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    norm = NemotronLayerNorm1P(16)
    x = torch.randn(2, 8, 16)
    with _OutputDtypes() as seen, CudaAutocast(torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.bfloat16  # CUDA autocast alone would run layer_norm in float32
    assert seen.dtypes["native_layer_norm"] == [torch.bfloat16]
    del transformers


def test_llama_rotary_cos_sin_stay_float32_on_a_cuda_target():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False, attn_implementation="eager")  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    seen: list[torch.dtype] = []
    model.model.rotary_emb.register_forward_hook(lambda m, args, out: seen.extend(t.dtype for t in out))
    ids = torch.randint(0, 64, (2, 16))
    est = estimate_memory(model, torch.optim.AdamW, {"input_ids": ids, "labels": ids},
                          precision="bf16-mixed", device="a100-40gb")  # fmt: skip
    assert est.method == "traced", est.warnings
    assert seen and set(seen) == {torch.float32}  # cos and sin, as a GPU computes them


class _Scaled(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # backward runs under the forward's autocast state
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


def test_custom_bwd_regions_in_backward_are_routed_quietly():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(D, D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Scaled.apply(x.flatten(0, 1), self.w).float().pow(2).mean()

    model = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "CUDA is not available ... Disabling autocast"
        est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(B, L, D),
                              lambda m, b: m(b), precision="bf16-mixed", device="a100-40gb")  # fmt: skip
    assert est.method == "traced", est.warnings
    assert _entry_points() == ORIGINALS
