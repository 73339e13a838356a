"""Per-rank memory of DDP and FSDP full-shard, and how many devices a step needs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from resource_guard import ConfigurationError, DeviceSpec
from resource_guard.estimate import estimate_memory
from resource_guard.estimate.allocation.allocator import rank_overhead
from resource_guard.planning.strategy import gpus_needed, rank_fit, rank_memory, unit_param_bytes

F32 = 4
GiB = 2**30


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


class Stack(nn.Module):
    """Embedding (root unit) → ``depth`` same-class linear blocks (one unit each) → head (root)."""

    def __init__(self, vocab: int = 512, dim: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


@pytest.fixture(scope="module")
def adamw_estimate():
    model = Stack()
    est = estimate_memory(model, torch.optim.AdamW, torch.randint(0, 512, (8, 16)), _loss, device="cuda")
    return model, est


def test_units_are_the_blocks_and_the_root_largest_first():
    model = Stack(vocab=512, dim=128, depth=3)
    block = (128 * 128 + 128) * F32
    root = (512 * 128 + 128) * F32
    assert unit_param_bytes(model, "32-true") == (root, block, block, block)
    assert unit_param_bytes(model, "bf16-true") == (root // 2, block // 2, block // 2, block // 2)
    assert unit_param_bytes(model, "bf16-mixed") == unit_param_bytes(model, "32-true")  # fp32 params


def test_single_is_the_estimate(adamw_estimate):
    _, est = adamw_estimate
    assert rank_memory(est, "single", 1).per_rank_bytes == est.peak_bytes


def test_ddp_adds_one_copy_of_every_gradient_in_buckets(adamw_estimate):
    model, est = adamw_estimate
    grads = sum(p.numel() for p in model.parameters()) * F32
    ddp = rank_memory(est, "ddp", 8)
    assert ddp.bucket_bytes == grads
    assert ddp.per_rank_bytes == est.peak_bytes + grads  # buckets live for the whole step
    assert rank_memory(est, "ddp", 2).per_rank_bytes == ddp.per_rank_bytes  # no saving from more ranks


def test_ddp_gradient_as_bucket_view_costs_nothing_at_an_optimizer_peak(adamw_estimate):
    _, est = adamw_estimate
    assert est.peak_phase == "optimizer" and est.breakdown["gradients"] > 0
    view = rank_memory(est, "ddp", 4, gradient_as_bucket_view=True)
    assert est.peak_bytes <= view.per_rank_bytes < rank_memory(est, "ddp", 4).per_rank_bytes


def test_fsdp_shards_model_state_and_keeps_two_units_gathered(adamw_estimate):
    model, est = adamw_estimate
    units = unit_param_bytes(model, "32-true")
    one = rank_memory(est, "fsdp", 1, units=units)
    assert one.per_rank_bytes == est.peak_bytes  # one rank holds everything, gathers nothing
    sizes = [rank_memory(est, "fsdp", n, units=units).per_rank_bytes for n in (1, 2, 4, 8, 64, 1024)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[1] < sizes[0]
    many = rank_memory(est, "fsdp", 1024, units=units)
    # at the backward peak a rank holds the two largest units' parameters and the largest one's gradient
    assert many.per_rank_bytes >= 2 * units[0] + units[1]
    state = est.breakdown["parameters"] + est.breakdown["optimizer_state"]
    assert many.model_state_bytes < state / 500
    assert many.unit_bytes == units[0]


def test_rank_fit_is_the_rank_bytes_plus_the_allocator_overhead_of_the_churn(adamw_estimate):
    model, est = adamw_estimate
    device = DeviceSpec("tiny", "cuda", memory_bytes=600 * 2**20, compute_capability="8.0")
    fit = est.for_device(device, headroom=0.1)
    ddp = rank_memory(est, "ddp", 2)
    shifted = rank_fit(fit, est, ddp)
    rounding, fragmentation = rank_overhead(est)
    assert shifted.allocated_peak_bytes == ddp.per_rank_bytes + rounding + fit.workspace_bytes
    assert shifted.device_total_bytes == shifted.allocated_peak_bytes + fragmentation + fit.context_bytes
    assert shifted.fits == (shifted.device_total_bytes <= fit.usable_bytes)
    assert shifted.usable_bytes == fit.usable_bytes
    assert any("ddp over 2 ranks" in n for n in shifted.notes)


def test_gpus_needed_is_the_smallest_fsdp_count_that_fits():
    model = Stack(vocab=4096, dim=512, depth=24)  # 8.4M parameters: 4 × 32 MiB with AdamW and gradients
    est = estimate_memory(model, torch.optim.AdamW, torch.randint(0, 4096, (1, 16)), _loss, device="cuda")
    units = unit_param_bytes(model, "32-true")
    device = DeviceSpec("small", "cuda", memory_bytes=600 * 2**20, compute_capability="8.0")
    answer = gpus_needed(est, device, units=units, headroom=0.1)
    assert answer is not None and answer.strategy == "fsdp" and answer.count > 1
    fit = est.for_device(device, headroom=0.1)

    def fits(n: int) -> bool:
        return rank_fit(fit, est, rank_memory(est, "fsdp", n, units=units)).fits

    assert fits(answer.count) and not fits(answer.count - 1)
    big = DeviceSpec("big", "cuda", memory_bytes=80 * GiB, compute_capability="9.0")
    assert gpus_needed(est, big, units=units).count == 1  # type: ignore[union-attr]
    hopeless = DeviceSpec("hopeless", "cuda", memory_bytes=460 * 2**20, compute_capability="8.0")
    assert gpus_needed(est, hopeless, units=units) is None  # the CUDA context alone nearly fills it


def test_arguments_are_checked(adamw_estimate):
    _, est = adamw_estimate
    with pytest.raises(ConfigurationError, match="strategy"):
        rank_memory(est, "zero3", 2)
    with pytest.raises(ConfigurationError, match="world_size"):
        rank_memory(est, "ddp", 0)
    with pytest.raises(ConfigurationError, match="units"):
        rank_memory(est, "fsdp", 2)
