"""A causal LM trained as transformers' ``run_clm_no_trainer.py`` trains it: ``outputs = model(**batch)``,
``loss = outputs.loss``, its own gradient accumulation, ``AdamW`` over the decayed and undecayed groups, a
linear schedule. The model is built from a ``GPT2Config`` (no weights downloaded) and the tokens are made
with torch. Only the ``with guard`` line is added."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

ACCUMULATION = 2
BATCH, SEQ, VOCAB = 4, 64, 2048


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=SEQ, vocab_size=VOCAB)
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0  # bit-for-bit comparable runs
    model = GPT2LMHeadModel(config)
    no_decay = ("bias", "ln_")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]  # fmt: skip
    return model, torch.optim.AdamW(groups, lr=5e-4)


def loader(steps: int) -> Iterator[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps * ACCUMULATION):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=steps)
    model.train()
    loss_value = 0.0
    for step, batch in enumerate(loader(steps)):
        outputs = model(**batch)
        loss = outputs.loss / ACCUMULATION
        loss.backward()
        loss_value = loss.item()
        if (step + 1) % ACCUMULATION == 0:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return loss_value
