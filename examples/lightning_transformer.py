"""A small transformer language model trained with Lightning on synthetic tokens, on the CPU, with the
:class:`~resource_guard.frontdoors.lightning.callback.ResourceGuard` callback planning the run.

Under a memory cap (``--memory-limit``) too small for the whole batch in one step, the callback keeps
the effective batch and picks a smaller micro-batch with gradient accumulation::

    python examples/lightning_transformer.py --batch-size 64 --memory-limit 16MiB --max-steps 4

The script prints the decisions as ``plan: micro_batch_size=... accumulation=... ...`` (rank zero).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import lightning.pytorch as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from resource_guard.frontdoors.lightning.callback import ResourceGuard


class TokenData(L.LightningDataModule):
    """Random token sequences; the train loader reads ``self.batch_size`` (the callback sets it)."""

    def __init__(
        self, vocab_size: int = 256, seq_len: int = 64, batch_size: int = 32, num_samples: int = 1024
    ):
        super().__init__()
        self.vocab_size, self.seq_len, self.num_samples = vocab_size, seq_len, num_samples
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(
            0, self.vocab_size, (self.num_samples, self.seq_len + 1), generator=generator
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.tokens), batch_size=self.batch_size, shuffle=True)


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and an MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TransformerLM(L.LightningModule):
    """A GPT-style language model: token + position embeddings, ``n_layers`` blocks, a tied head."""

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 64,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        lr: float = 3e-4,
        warmup_steps: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.embed.weight.T

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warmup = max(1, self.hparams.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main(argv: Sequence[str] | None = None) -> ResourceGuard:
    parser = argparse.ArgumentParser(
        description="Train a small transformer language model with Lightning on synthetic tokens, on the "
        "CPU, with the ResourceGuard callback planning the run: under a memory cap (--memory-limit) too "
        "small for the whole batch in one step, it keeps the effective batch and picks a smaller "
        "micro-batch with gradient accumulation. Prints the decisions as 'plan: micro_batch_size=... "
        "accumulation=... ...'.",
        epilog="example: python examples/lightning_transformer.py --batch-size 64 --memory-limit 16MiB "
        "--max-steps 4",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="the train loader's batch size")
    parser.add_argument("--target-batch-size", type=int, default=None, help="default: the loader's")
    parser.add_argument("--memory-limit", default="16MiB", help="plan under this cap ('none': no cap)")
    parser.add_argument("--max-steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--precision", default="auto", help="ResourceGuard(precision=...)")
    parser.add_argument("--log-dir", default=None, help="TensorBoard + report directory (default: none)")
    args = parser.parse_args(argv)
    L.seed_everything(0, verbose=False)
    limit = None if str(args.memory_limit).lower() == "none" else args.memory_limit
    guard = ResourceGuard(
        target_batch_size=args.target_batch_size,
        memory_limit=limit,
        precision=args.precision,
        monitor=args.log_dir is not None,
        profile=False,
        log_dir=args.log_dir,
    )
    logger = L.loggers.TensorBoardLogger(args.log_dir, name="lightning") if args.log_dir else False
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        callbacks=[guard],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TransformerLM(), TokenData(batch_size=args.batch_size))
    d = guard.decisions
    if d is not None and trainer.is_global_zero:
        print(
            f"plan: micro_batch_size={d.micro_batch_size} accumulation={d.accumulation_steps} "
            f"precision={d.precision} checkpointing={d.checkpointing} "
            f"target_batch_size={d.target_batch_size} optimizer_steps={trainer.global_step} "
            f"loss={float(trainer.callback_metrics['train_loss']):.3f}"
        )
    return guard


if __name__ == "__main__":
    main()
