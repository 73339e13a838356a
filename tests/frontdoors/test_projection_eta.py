"""The front doors give the monitor the run's length, so the report projects the remaining steps (#13)."""

from __future__ import annotations

import json
import types

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from resource_guard.frontdoors.guard.context import guard
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.frontdoors.lightning.plan import total_batches as _total_batches


def _loader(rows: int = 32, batch: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g)), batch
    )


def test_total_batches_reads_lightnings_estimate():
    assert (
        _total_batches(types.SimpleNamespace(estimated_stepping_batches=10, accumulate_grad_batches=2)) == 10
    )  # a step is an optimizer step (Lightning's estimate already counts them): not x accumulation
    assert _total_batches(types.SimpleNamespace(estimated_stepping_batches=float("inf"))) is None

    class NoLength:
        @property
        def estimated_stepping_batches(self) -> int:
            raise RuntimeError("no len")

    assert _total_batches(NoLength()) is None


def test_guard_reports_the_steps_left_of_the_pass(tmp_path):
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0]), b[1])

    with guard(model, optimizer, loss_fn=loss_fn, log_dir=tmp_path, device="cpu", profile=False) as g:
        for x, y in g.iterate(_loader()):
            g.backward(nn.functional.mse_loss(model(x), y))
    left = json.loads((tmp_path / "report.json").read_text())["projection"]
    assert left["remaining_steps"] == 0 and left["step_s"] > 0  # the whole pass ran


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_reports_the_steps_left(tmp_path):
    callback = ResourceGuard(log_dir=tmp_path / "rg", profile=False)
    trainer = L.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), _loader())
    left = json.loads((tmp_path / "rg" / "report.json").read_text())["projection"]
    assert left["remaining_steps"] == 0 and left["eta_hours"] == 0.0
