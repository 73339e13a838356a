"""The embedded default model: a small GPT-style decoder in plain torch.nn, with synthetic tokens.

``resource-guard preflight`` with no target estimates this; tests and examples reuse it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["TinyGPT", "build", "run_demo"]


class TinyGPT(nn.Module):
    """A decoder-only transformer language model (pre-norm blocks, causal attention, tied head).

    Example:
        >>> model = TinyGPT(vocab_size=100, d_model=32, n_layers=1, n_heads=2, seq_len=16)
        >>> model(torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))).shape
        torch.Size([])
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 256,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos: nn.Embedding = nn.Embedding(seq_len, d_model)
        self.blocks: nn.ModuleList = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model,
                n_heads,
                4 * d_model,
                dropout=0.0,
                batch_first=True,
                norm_first=True,
                activation="gelu",
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied weights
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's scale: unit-variance logits at init
        nn.init.normal_(self.pos.weight, std=0.02)
        self.register_buffer(
            "causal_mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.embed(tokens) + self.pos.weight[:seq]
        mask = self.get_buffer("causal_mask")[:seq, :seq]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(batch_size: int = 16, seq_len: int = 256, vocab_size: int = 8192, seed: int = 0) -> tuple[Any, ...]:
    """Model, AdamW optimizer and one batch ``(tokens, targets)`` of synthetic tokens."""
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyGPT(vocab_size=vocab_size, seq_len=seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    return model, optimizer, (tokens[:, :-1], tokens[:, 1:])


def run_demo(
    steps: int = 12,
    *,
    batch_size: int = 16,
    seq_len: int = 128,
    log_dir: str = "runs/demo",
    memory_limit: str | int | None = "256MiB",
    on_plan: Callable[[Any], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> Any:
    """Train :class:`TinyGPT` on synthetic tokens under :func:`resource_guard.guard` on this machine.

    The embedded default of ``resource-guard demo``: plans (under ``memory_limit``, which stands in for
    a small GPU), trains ``steps`` effective batches, and writes TensorBoard events, the bottleneck
    report (``report.md``/``report.json``), the memory picture and ``guard.json`` into ``log_dir``.
    Returns the finished :class:`~resource_guard.frontdoors.guard.context.Guard` (``g.plan``, ``g.report``).
    ``on_plan(plan)`` is called once the run is planned, before its first step; ``on_step(k)`` after
    each optimizer step.
    """
    from torch.utils.data import DataLoader, TensorDataset

    from resource_guard.frontdoors.guard.context import guard

    model, optimizer, _ = build(batch_size=batch_size, seq_len=seq_len)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, model.embed.num_embeddings, (batch_size * steps, seq_len + 1), generator=generator
    )
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return m(*batch)

    stepped = 0
    with guard(model, optimizer, loss_fn=loss_fn, memory_limit=memory_limit, log_dir=log_dir) as g:
        for batch in g.iterate(loader):
            if on_plan is not None and g.plan is not None:
                on_plan(g.plan)
                on_plan = None
            with g.autocast():
                loss = loss_fn(model, batch)
            if g.backward(loss):
                stepped += 1
                if on_step is not None:
                    on_step(stepped)
    return g
