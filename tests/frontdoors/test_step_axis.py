"""One step axis: under Lightning and the Hugging Face Trainer a step is an optimizer step, the
framework's ``global_step``, in the report's count and in the ``resource_guard/*`` scalars' x-axis, so
that they line up with the user's own ``self.log`` / ``logging_steps`` curves (issue 37)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from resource_guard import ResourceGuard, ResourceGuardCallback


def _steps(log_dir: Path) -> dict[str, list[int]]:
    """Each scalar tag's steps, over every event file below ``log_dir``."""
    found: dict[str, list[int]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, []).extend(e.step for e in acc.Scalars(tag))
    return found


class LoggingModel(BoringModel):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])
        return out


def test_lightning_scalars_share_the_x_axis_of_self_log(tmp_path: Path) -> None:
    guard = ResourceGuard(precision="32-true", profile=False)
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_steps=6, accumulate_grad_batches=4, log_every_n_steps=1,
        callbacks=[guard], accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(LoggingModel())
    assert trainer.global_step == 6
    assert guard.report is not None and guard.report.stats.steps == 6  # not 24 micro-batches
    steps = _steps(Path(trainer.log_dir))
    ours = sorted({s for tag, v in steps.items() if tag.startswith("resource_guard/") for s in v})
    theirs = sorted(set(steps["train_loss"]))
    assert ours and max(ours) <= trainer.global_step  # micro-batches would have run to 24
    assert max(theirs) <= trainer.global_step
    assert abs(max(ours) - max(theirs)) <= 1  # one axis: the optimizer step


def test_hugging_face_scalars_and_report_count_optimizer_steps(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    data = [{"input_ids": torch.arange(16) % 64, "labels": torch.arange(16) % 64}] * 32
    args = TrainingArguments(
        str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=2, gradient_accumulation_steps=3,
        max_steps=4, logging_steps=1, report_to=["tensorboard"], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    guard = ResourceGuardCallback(profile=False)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[guard])
    trainer.train()
    assert trainer.state.global_step == 4
    report = guard.report
    assert report is not None and report.stats.steps == 4  # not 12 micro-batches
    steps = _steps(tmp_path / "out")
    ours = sorted({s for tag, v in steps.items() if tag.startswith("resource_guard/") for s in v})
    loss = sorted(set(steps.get("train/loss", [])))
    assert ours and max(ours) <= 4 and loss and max(loss) <= 4
