"""The Lightning door's phase timing: Lightning's action names it relies on, the split of a real fit,
and everything put back after it. If Lightning renames an action, the first test fails loudly."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from resource_guard import ResourceGuard
from resource_guard.frontdoors.lightning.phases import classify_action


class Net(L.LightningModule):
    def __init__(self, host_s: float = 0.0) -> None:
        super().__init__()
        self.layer, self.host_s = torch.nn.Linear(8, 1), host_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        time.sleep(self.host_s)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        time.sleep(0.01)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)


def _trainer(tmp_path: Path, callbacks: list[Any], **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        max_steps=12, accelerator="cpu", devices=1, callbacks=callbacks, default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


def test_lightning_still_names_the_boundaries_phase_timing_relies_on(tmp_path: Path) -> None:
    seen: set[str] = set()

    class Recorder(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            start = trainer.profiler.start

            def record(name: str) -> None:
                seen.add(name)
                start(name)

            trainer.profiler.start = record  # type: ignore[method-assign]

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)
    _trainer(tmp_path, [Recorder(), ckpt], limit_val_batches=0).fit(Net(), _data())
    phases = {classify_action(name) for name in seen}
    # each phase the Lightning door times must still be announced by some action of Lightning's
    assert {"data_wait", "forward", "backward", "optimizer", "checkpoint", "host"} <= phases, sorted(seen)


def test_a_fit_is_split_by_phase_and_the_gap_is_no_longer_data_wait(tmp_path: Path) -> None:
    rg = ResourceGuard(profile=False, log_dir=tmp_path / "rg")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    model = Net(host_s=0.01)
    trainer = _trainer(tmp_path, [rg, ckpt], val_check_interval=4, limit_val_batches=2)
    trainer.fit(model, _data(), _data())
    s = rg.report.stats
    assert s.phases is not None and s.step_time_s is not None
    assert sum(s.phases.values()) == pytest.approx(s.step_time_s, rel=1e-6)
    assert s.phases["host"] >= 0.01 and s.phases["evaluation"] > 0 and s.phases["checkpoint"] > 0
    assert s.phases["logging"] > 0
    # what Lightning did between steps (evaluation, saving, the module's hooks) is not data wait
    assert s.phases["data_wait"] < 0.2 * (s.phases["host"] + s.phases["evaluation"] + s.phases["checkpoint"])
    assert rg.report.finding("input-bound") is None
    # everything put back
    assert "log" not in vars(model) and "start" not in vars(trainer.profiler)
    assert all("log_metrics" not in vars(lg) for lg in trainer.loggers)


def test_classify_action_leaves_unknown_and_own_actions_alone() -> None:
    assert classify_action("[Callback]ResourceGuard.on_train_batch_end", "ResourceGuard") is None
    assert classify_action("[Callback]ModelCheckpoint{'monitor': None}.on_train_batch_end") == "checkpoint"
    assert classify_action("[_EvaluationLoop].val_next") is None
    assert classify_action("[LightningModule]Net.optimizer_step") == "optimizer"
