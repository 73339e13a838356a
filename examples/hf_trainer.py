"""Fine-tune a small GPT-2 with the Hugging Face ``Trainer`` under a memory cap, with resource_guard.

``plan_training_args`` turns the ``TrainingArguments`` you wrote into ones that fit (per-device batch ×
accumulation keeps your effective batch; precision and gradient checkpointing where they help), and
``ResourceGuardCallback`` checks the Trainer's real step before step 0, every batch before it runs, the
evaluation, and writes the bottleneck report to ``<output_dir>/resource_guard`` and TensorBoard.

Runs on a CPU in seconds (a GPT-2 built from a config: no download)::

    python examples/hf_trainer.py            # writes ./hf_trainer_out
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from resource_guard import ResourceGuardCallback, plan_training_args

MEMORY_LIMIT = "12MiB"  # as if the device had only this much: the full batch of 32 does not fit


def build() -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """A small GPT-2 and a toy corpus: each row repeats one short pattern, so the loss falls quickly."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64)
    model = GPT2LMHeadModel(config)
    rows = []
    for i in range(64):
        ids = (torch.arange(32) * (1 + i % 3)) % 128
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return model, rows


def main(output_dir: str = "hf_trainer_out") -> Trainer:
    model, data = build()
    args = TrainingArguments(
        output_dir,
        use_cpu=True,
        per_device_train_batch_size=32,  # the effective batch: 32 per optimizer step
        learning_rate=3e-3,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        report_to=["tensorboard"],
    )
    # the per-device batch, accumulation, precision and checkpointing that fit under the cap
    args = plan_training_args(model, args, data, memory_limit=MEMORY_LIMIT)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=[ResourceGuardCallback(memory_limit=MEMORY_LIMIT, profile=False)],
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
