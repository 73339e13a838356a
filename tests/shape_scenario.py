"""The shape-guard scenario shared by the front doors' tests: a tiny GPT-2 (from a config, no
weights) whose loader yields 8×16 batches, then 8×513, under a ``memory_limit`` between the two."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from resource_guard.planning.planner import plan

__all__ = ["LONG", "ROWS", "SHORT", "VOCAB", "cap_between", "peaks", "tiny_gpt2", "tokens"]

transformers = pytest.importorskip("transformers")

VOCAB, ROWS, SHORT, LONG = 256, 8, 16, 513


def tiny_gpt2() -> torch.nn.Module:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=1024, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def tokens(rows: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


@functools.cache
def peaks() -> tuple[int, int]:
    """The planner's device totals of one 8×16 and one 8×513 step (on the CPU, no cap)."""
    out = []
    for length in (SHORT, LONG):
        model = tiny_gpt2()
        made = plan(model, torch.optim.AdamW, tokens(ROWS, length), device="cpu", precision="32-true",
                    checkpointing=False)  # fmt: skip
        assert made.micro_batch_size == ROWS
        out.append(made.fit.device_total_bytes)
    return out[0], out[1]


def cap_between() -> int:
    small, large = peaks()
    return int((small + large) / 2 / 0.9)  # the usable share (10% headroom) lies between the two
