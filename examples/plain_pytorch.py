"""Plain PyTorch with ``guard``: a small GPT-style model on synthetic tokens, on the CPU.

A memory cap (``--memory-limit``, default 160 MiB) stands in for a small GPU: the full batch of 32
does not fit under it, so the guard plans micro-batches with gradient accumulation that keep the
effective batch of 32, and says why. The run writes its TensorBoard events, report and plan into
``--log-dir``.

Run it:
    python examples/plain_pytorch.py --steps 4 --log-dir runs/plain
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from resource_guard import guard
from resource_guard.demo import TinyGPT


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    tokens, targets = batch
    return model(tokens, targets)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description="Plain PyTorch with guard: a small GPT-style model on synthetic tokens, on the CPU. "
        "A memory cap (--memory-limit) stands in for a small GPU: the full batch does not fit under it, "
        "so the guard plans micro-batches with gradient accumulation that keep the effective batch, and "
        "says why. The run writes its TensorBoard events, report and plan into --log-dir.",
        epilog="example: python examples/plain_pytorch.py --steps 4 --log-dir runs/plain",
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (effective batches)")
    parser.add_argument("--batch-size", type=int, default=32, help="the loader's batch size (default 32)")
    parser.add_argument("--memory-limit", default="160MiB", help="plan under this cap (default 160MiB)")
    parser.add_argument("--log-dir", default="runs/plain_pytorch", help="TensorBoard events and report")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    seq_len, vocab = 128, 2048
    model = TinyGPT(vocab_size=vocab, d_model=128, n_layers=2, n_heads=4, seq_len=seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(0, vocab, (args.batch_size * args.steps, seq_len + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size)

    with guard(
        model,
        optimizer,
        loss_fn=loss_fn,
        device="cpu",
        precision="32-true",
        memory_limit=args.memory_limit,
        log_dir=args.log_dir,
    ) as g:
        for batch in g.iterate(loader):
            with g.autocast():
                loss = loss_fn(model, batch)
            g.backward(loss)
    assert g.plan is not None
    print(g.plan.summary())
    print(f"optimizer steps: {g.optimizer_steps}, micro-steps: {g.micro_steps}, last loss {loss.item():.3f}")
    return {
        "micro_batch_size": g.plan.micro_batch_size,
        "accumulation_steps": g.plan.accumulation_steps,
        "optimizer_steps": g.optimizer_steps,
        "micro_steps": g.micro_steps,
    }


if __name__ == "__main__":
    main()
