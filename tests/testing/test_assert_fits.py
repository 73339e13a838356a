"""``assert_fits``: a GPT-2 small step fits a T4, a GPT-2 XL step (built on ``meta``) does not."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from resource_guard import ConfigurationError, estimate_memory, plan, resolve_device
from resource_guard.testing import assert_fits

transformers = pytest.importorskip("transformers")


def _gpt2(meta: bool = False, **config: int) -> nn.Module:
    cfg = transformers.GPT2Config(**config)
    cfg._attn_implementation = "sdpa"
    if meta:
        with torch.device("meta"):  # shapes only: 1.5B parameters cost nothing
            return transformers.GPT2LMHeadModel(cfg)
    return transformers.GPT2LMHeadModel(cfg)


def _tokens(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": tokens, "labels": tokens}


def test_a_small_gpt2_fits_a_t4() -> None:
    model = _gpt2(n_layer=2, n_embd=128, n_head=2, n_positions=256, vocab_size=1024)
    batch = _tokens(8, 256, 1024)
    fit = assert_fits(model, torch.optim.AdamW, batch, device="t4", precision="16-mixed")
    assert fit.verdict == "fits" and fit.device.name == "t4"
    # the same figure as the estimate's own fit: assert_fits adds no model of its own
    est = estimate_memory(model, torch.optim.AdamW, batch, precision="16-mixed", device="t4")
    assert fit.device_total_bytes == est.for_device("t4").device_total_bytes


def test_gpt2_xl_does_not_fit_a_t4_and_the_message_says_why() -> None:
    model = _gpt2(meta=True, n_layer=48, n_embd=1600, n_head=25)  # GPT-2 XL, 1.56B parameters
    batch = _tokens(1, 1024, model.config.vocab_size)
    with pytest.raises(AssertionError) as info:
        assert_fits(model, torch.optim.AdamW, batch, device="t4", precision="16-mixed")
    msg = str(info.value)
    head = msg.splitlines()[0]
    assert "t4" in head and "16-mixed" in head and "batch 1" in head
    needed, usable = (int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+) bytes", head)[:2])
    # AdamW's fp32 state alone is 2 × 4 bytes × 1.56B parameters: far above a T4's 16 GiB
    assert needed > 1.5 * usable and usable == int(16 * 2**30 * 0.9)
    assert "GiB" in head
    assert re.search(r"largest category: (optimizer_state|activations|parameters)", msg)
    tips = msg.split("what would make it fit:\n", 1)[1]
    assert "gradient accumulation" not in tips  # one sample: nothing to accumulate
    assert re.search(r"FSDP full-shard over \d+ × t4", tips) and "a100-80gb" in tips


def test_accumulation_is_offered_when_a_smaller_micro_batch_fits() -> None:
    model = _gpt2(n_layer=2, n_embd=128, n_head=2, n_positions=256, vocab_size=1024)
    batch = _tokens(16, 256, 1024)
    totals = [
        estimate_memory(model, torch.optim.AdamW, {k: v[:n] for k, v in batch.items()}, device="cpu")
        .for_device("cpu")
        .device_total_bytes
        for n in (1, 16)
    ]
    # usable memory halfway between the step at 1 sample and at 16: some micro-batch in between fits
    small = resolve_device("cpu").with_memory(int(sum(totals) / 2 / 0.9))
    with pytest.raises(AssertionError) as info:
        assert_fits(model, torch.optim.AdamW, batch, device=small)
    micro, steps = re.search(
        r"micro-batch (\d+) × (\d+) gradient accumulation steps fits", str(info.value)
    ).groups()
    assert int(micro) * int(steps) == 16 and 1 <= int(micro) < 16


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"headroom": 1.5}, "`assert_fits(headroom=1.5)`"),
        ({"world_size": 0}, "`assert_fits(world_size=0)`"),
        ({"strategy": "zero3"}, "`assert_fits(strategy='zero3')`"),
        ({"strategy": "single", "world_size": 2}, "`assert_fits(strategy='single', world_size=2)`"),
        ({"precision": "fp8"}, "`assert_fits(precision='fp8')`"),
        ({"device": "no-such-gpu"}, "`assert_fits(device='no-such-gpu')`"),
    ],
)
def test_bad_arguments_are_refused_before_any_trace(kwargs: dict, quoted: str) -> None:
    model = nn.Linear(4, 1)
    args = {"device": "t4", **kwargs}
    with pytest.raises(ConfigurationError) as info:
        assert_fits(model, torch.optim.SGD, torch.randn(2, 4), lambda m, b: m(b).sum(), **args)
    assert quoted in str(info.value)


def test_at_scale_the_verdict_is_per_rank() -> None:
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    args = (model, torch.optim.AdamW, torch.randn(4, 512), lambda m, b: m(b).sum())
    single = assert_fits(*args, device="t4")
    at_scale = {"device": "t4", "world_size": 4, "strategy": "fsdp", "precision": "16-mixed"}
    fsdp = assert_fits(*args, **at_scale)
    # the planner sizes the same step (full batch per rank, FSDP over 4) to the byte
    planned = plan(*args, **at_scale, checkpointing=False)
    assert (planned.micro_batch_size, planned.accumulation_steps) == (4, 1)
    assert fsdp.device_total_bytes == planned.fit.device_total_bytes
    assert fsdp.device_total_bytes < single.device_total_bytes  # parameters and state sharded 4 ways


class _Unique(nn.Module):
    """A step with a data-dependent shape (``unique``), traced only as an analytic upper bound."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.sum() + torch.unique(y.detach()).float().sum() * 0.0


def test_a_failure_on_an_analytic_bound_says_it_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from resource_guard.estimate.trace import recovery

    monkeypatch.setattr(recovery, "REAL_BUDGET_BYTES", 0)  # `unique` cannot be recovered: analytic
    tiny = resolve_device("cpu").with_memory(2**10)
    with pytest.raises(AssertionError, match=r"estimate method: analytic upper bound"):
        assert_fits(_Unique(), torch.optim.SGD, torch.randn(8, 64), device=tiny)
