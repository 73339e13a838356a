"""FSDP's own mixed precision per rank, SHARD_GRAD_OP and HSDP, and the per-rank properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from resource_guard import ConfigurationError, DeviceSpec
from resource_guard.estimate import estimate_memory
from resource_guard.estimate.allocation.allocator import rank_overhead
from resource_guard.estimate.fsdp.sharding import autocast_copy_bytes, fsdp_precision, trace_spec
from resource_guard.planning.strategy import (
    overhead_envelope,
    phase_peaks,
    rank_fit,
    rank_memory,
    unit_param_bytes,
)

GPU = DeviceSpec("gpu", "cuda", memory_bytes=2**34, compute_capability="9.0")


class Stack(nn.Module):
    def __init__(self, dim: int = 128, depth: int = 4, vocab: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(depth)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), ids.flatten())


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids)


MODEL = Stack()
POLICY = fsdp_precision("bf16-mixed", "params")
UNITS = unit_param_bytes(MODEL, POLICY)


def _estimate(micro: int, policy_name: str = "params"):
    spec = trace_spec(fsdp_precision("bf16-mixed", policy_name))
    return estimate_memory(
        MODEL, torch.optim.AdamW, torch.randint(0, 512, (micro, 16)), _loss, precision=spec, device="cuda"
    )


ESTIMATES = {m: _estimate(m) for m in (1, 2, 3, 4, 6, 8)}
OVERHEADS = {m: rank_overhead(e) for m, e in ESTIMATES.items()}


def test_policies_name_the_dtypes_lightning_uses():
    p = fsdp_precision("bf16-mixed")
    assert (p.param_dtype, p.reduce_dtype, p.master_dtype, p.autocast_dtype) == (torch.bfloat16,) * 2 + (
        torch.float32,
        torch.bfloat16,
    )
    assert fsdp_precision("bf16-mixed", "params-fp32-reduce").reduce_dtype == torch.float32
    assert fsdp_precision("bf16-mixed", "autocast").param_dtype == torch.float32
    true = fsdp_precision("bf16-true")
    assert true.policy == "none" and true.master_dtype == torch.bfloat16 and not true.gathers_low_precision
    assert "gathered params bf16, reduce bf16" in p.describe()
    with pytest.raises(ConfigurationError, match="fsdp_mixed_precision"):
        fsdp_precision("bf16-mixed", "pure")


def test_lightning_fsdp_bf16_mixed_gathers_bf16_parameters():
    plugins = pytest.importorskip("lightning.fabric.plugins.precision.fsdp")
    for name in ("bf16-mixed", "16-mixed", "bf16-true"):
        config = plugins.FSDPPrecision(name).mixed_precision_config
        ours = fsdp_precision(name)
        assert (config.param_dtype, config.reduce_dtype) == (ours.param_dtype, ours.reduce_dtype)


def test_the_bf16_param_trace_has_bf16_weights_and_activations():
    est = ESTIMATES[4]
    params = sum(p.numel() for p in MODEL.parameters())
    assert est.breakdown["parameters"] == 2 * params
    assert UNITS[0] == max(UNITS) and sum(UNITS) == 2 * params


def test_a_rank_holds_fp32_shards_and_bf16_units():
    est = ESTIMATES[4]
    params = sum(p.numel() for p in MODEL.parameters())
    peaks = phase_peaks(est)
    rank = rank_memory(est, "fsdp", 8, units=UNITS, policy=POLICY, peaks=peaks)
    assert rank.model_state_bytes == pytest.approx(
        16 * params / 8, rel=0.001
    )  # fp32 params, grads, 2 moments
    gathered = UNITS[0] + UNITS[1]
    grads = 4 * params // 8  # the gradient shards: none at the start of the backward, all at the optimizer
    assert rank.per_rank_bytes >= rank.model_state_bytes - grads + peaks.backward + gathered + UNITS[0]
    assert rank.per_rank_bytes <= rank.model_state_bytes + peaks.backward + gathered + UNITS[0]
    assert rank.precision_policy is POLICY and "gathered params bf16" in rank.notes[0]
    fp32_reduce = rank_memory(
        est, "fsdp", 8, units=UNITS, policy=fsdp_precision("bf16-mixed", "params-fp32-reduce")
    )
    assert (
        fp32_reduce.per_rank_bytes - rank.per_rank_bytes == 2 * UNITS[0]
    )  # the unit's gradient cast to fp32


def test_autocast_over_fp32_params_costs_the_weight_copies_the_bf16_policy_saves():
    auto = _estimate(4, "autocast")
    fp32_units = unit_param_bytes(MODEL, "bf16-mixed")
    policy = fsdp_precision("bf16-mixed", "autocast")
    slow = rank_memory(auto, "fsdp", 8, units=fp32_units, policy=policy)
    fast = rank_memory(ESTIMATES[4], "fsdp", 8, units=UNITS, policy=POLICY)
    copies = autocast_copy_bytes(MODEL)
    assert copies == 2 * sum(m.weight.numel() for m in MODEL.modules() if isinstance(m, nn.Linear))
    assert slow.per_rank_bytes - fast.per_rank_bytes >= 0.5 * copies


def test_shard_grad_op_keeps_every_unit_and_hsdp_shards_within_the_node():
    est = ESTIMATES[4]
    full = rank_memory(est, "fsdp", 16, units=UNITS, policy=POLICY)
    zero2 = rank_memory(est, "fsdp_grad_op", 16, units=UNITS, policy=POLICY)
    assert zero2.per_rank_bytes - full.per_rank_bytes == sum(UNITS) - UNITS[0] - UNITS[1]
    hsdp = rank_memory(est, "hsdp", 16, units=UNITS, policy=POLICY, gpus_per_node=8)
    assert hsdp.per_rank_bytes == rank_memory(est, "fsdp", 8, units=UNITS, policy=POLICY).per_rank_bytes
    assert hsdp.per_rank_bytes > full.per_rank_bytes


def _device_total(micro: int, strategy: str, world: int) -> int:
    est = ESTIMATES[micro]
    rank = rank_memory(est, strategy, world, units=UNITS, policy=POLICY if strategy != "ddp" else None)
    fit = rank_fit(est.for_device(GPU), est, rank, overhead=overhead_envelope(OVERHEADS, micro))
    return fit.device_total_bytes


@settings(max_examples=60, deadline=None)
@given(
    strategy=st.sampled_from(["ddp", "fsdp", "fsdp_grad_op", "hsdp"]),
    worlds=st.tuples(st.integers(1, 1024), st.integers(1, 1024)).map(sorted),
    micros=st.tuples(st.sampled_from(sorted(ESTIMATES)), st.sampled_from(sorted(ESTIMATES))).map(sorted),
)
def test_per_rank_never_grows_with_ranks_nor_shrinks_with_the_micro_batch(strategy, worlds, micros):
    (few, many), (small, large) = worlds, micros
    est = ESTIMATES[small]
    live = [rank_memory(est, strategy, n, units=UNITS, policy=POLICY).per_rank_bytes for n in (few, many)]
    assert live[1] <= live[0]
    assert _device_total(small, strategy, many) <= _device_total(small, strategy, few)
    assert _device_total(large, strategy, few) >= _device_total(small, strategy, few)
