"""A GPT written as nanoGPT's model.py writes it (``logits, loss = model(idx, targets)``), trained by a
loop modelled on its train.py: its own gradient accumulation, the next batch fetched between forward
and backward, gradient clipping, ``zero_grad(set_to_none=True)``. Only the ``with guard`` line is added."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 4096, 32, 64, 4, 2
BATCH, ACCUMULATION = 4, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(BLOCK, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = GPT()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def get_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (BATCH, BLOCK + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    g = torch.Generator().manual_seed(1337)
    X, Y = get_batch(g)
    for _ in range(steps):
        for _ in range(ACCUMULATION):
            logits, loss = model(X, Y)
            loss = loss / ACCUMULATION
            X, Y = get_batch(g)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item() * ACCUMULATION
