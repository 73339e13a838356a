"""A GPT-2 small (124M) training step, built from its config (no weights are downloaded).

Used as a pre-flight target::

    resource-guard preflight examples/gpt_small.py:build --device a100-40gb --batch-size 32 \
        --precision bf16-mixed

``build`` returns ``(model, optimizer, batch)``; the model computes its own loss from ``labels``.
"""

from __future__ import annotations

from typing import Any

import torch


def build(batch_size: int = 8, seq_len: int = 1024, n_layer: int = 12, n_embd: int = 768) -> tuple[Any, ...]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64), n_positions=seq_len)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):  # shapes only: nothing of the model's size is allocated
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return model, optimizer, {"input_ids": tokens, "labels": tokens}


if __name__ == "__main__":
    from resource_guard.estimate import estimate_memory

    est = estimate_memory(*build(), precision="bf16-mixed")
    fit = est.for_device("a100-40gb")
    print(
        f"peak {est.peak_bytes / 2**30:.2f} GiB; "
        f"on a100-40gb: {fit.device_total_bytes / 2**30:.2f} GiB, fits={fit.fits}"
    )
