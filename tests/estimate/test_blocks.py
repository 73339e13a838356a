"""Estimating a deep model from two shallow traces agrees with the full trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from resource_guard import ConfigurationError
from resource_guard.estimate import estimate_memory
from resource_guard.estimate.allocation.allocator import rank_overhead
from resource_guard.estimate.blocks import BlockEstimate, estimate_by_blocks, sampleable
from resource_guard.step.precision import PrecisionSpec

BF16_PARAMS = PrecisionSpec("bf16-mixed", torch.bfloat16, torch.bfloat16, False)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        x = x + self.out(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        )
        return x + self.down(F.gelu(self.up(x)))


class Decoder(nn.Module):
    def __init__(self, depth: int, d: int = 64, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1).float(), ids.flatten())


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids)


BLOCKS = [f"layers.{i}" for i in range(9)]


@pytest.mark.parametrize(
    "precision", ["32-true", "bf16-mixed", BF16_PARAMS], ids=["fp32", "autocast", "bf16-params"]
)
@pytest.mark.parametrize("checkpointed", [False, True])
def test_extrapolation_matches_the_full_trace(precision, checkpointed: bool) -> None:
    torch.manual_seed(0)
    model = Decoder(9)
    if checkpointed:
        from resource_guard.planning.checkpointing import apply_checkpointing  # test-only, layers allow it

        handle = apply_checkpointing(model)
    ids = torch.randint(0, 256, (4, 32))
    kwargs = {"precision": precision, "device": "cuda"}
    full = estimate_memory(model, torch.optim.AdamW, ids, _loss, **kwargs)
    est = estimate_by_blocks(model, torch.optim.AdamW, ids, _loss, blocks=BLOCKS, **kwargs)
    if checkpointed:
        handle.remove()
    assert isinstance(est, BlockEstimate) and est.blocks_sampled == (1, 2) and est.blocks_total == 9
    assert est.parameter_count == full.parameter_count == sum(p.numel() for p in model.parameters())
    assert est.peak_bytes == pytest.approx(full.peak_bytes, rel=0.01)
    assert est.phase_peak_bytes["forward"] == pytest.approx(full.phase_peak_bytes["forward"], rel=0.01)
    for category in ("parameters", "optimizer_state"):
        assert est.breakdown[category] == full.breakdown[category]
    rounding, fragmentation = rank_overhead(full)
    assert est.allocator_overhead is not None
    assert abs(est.allocator_overhead[1] - fragmentation) <= max(0.05 * fragmentation, 2**21)
    assert "extrapolated from traces of 1 and 2 of 9" in est.warnings[-1]


def test_the_model_is_left_whole_and_small_models_or_optimizer_instances_trace_in_full() -> None:
    model = Decoder(9)
    ids = torch.randint(0, 256, (2, 8))
    estimate_by_blocks(model, torch.optim.SGD, ids, _loss, blocks=BLOCKS)
    assert len(model.layers) == 9 and list(model.layers._modules) == [str(i) for i in range(9)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not isinstance(estimate_by_blocks(model, opt, ids, _loss, blocks=BLOCKS), BlockEstimate)
    small = Decoder(3)
    assert not isinstance(
        estimate_by_blocks(small, torch.optim.SGD, ids, _loss, blocks=BLOCKS[:3]), BlockEstimate
    )


def test_blocks_must_be_one_container_in_order() -> None:
    model = Decoder(9)
    assert sampleable(model, BLOCKS) and not sampleable(model, BLOCKS[::-1]) and not sampleable(model, ())
    ids = torch.randint(0, 256, (2, 8))
    with pytest.raises(ConfigurationError, match="every child, in order"):
        estimate_by_blocks(model, torch.optim.SGD, ids, _loss, blocks=BLOCKS[1:])
    with pytest.raises(ConfigurationError, match="samples"):
        estimate_by_blocks(model, torch.optim.SGD, ids, _loss, blocks=BLOCKS, samples=(3, 2))
