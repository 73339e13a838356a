"""`ResourceGuard` calls the module's step hooks as Lightning's loops call them: `batch_idx` only where
the signature takes it (Lightning's own check), `dataloader_idx` only with several loaders. Lightning's
GAN example (`training_step(self, batch)`, manual optimization) is traced, not bounded analytically."""

from __future__ import annotations

import warnings

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from resource_guard.errors import ResourceGuardWarning
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.frontdoors.lightning.hooks import eval_step_args, training_step_args

LATENT, SHAPE = 16, (1, 8, 8)


class Generator(nn.Module):
    def __init__(self, latent_dim: int, img_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.img_shape = img_shape
        self.model = nn.Sequential(
            nn.Linear(latent_dim, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 64), nn.Tanh()
        )

    def forward(self, z):
        return self.model(z).view(z.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(64, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1))

    def forward(self, img):
        return self.model(img.view(img.size(0), -1))


class GAN(L.LightningModule):
    """Lightning's `domain_templates/generative_adversarial_net.py`, its `training_step` as written there
    (no `batch_idx`), the networks smaller."""

    def __init__(self, latent_dim: int = LATENT, lr: float = 0.0002, b1: float = 0.5, b2: float = 0.999):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=SHAPE)
        self.discriminator = Discriminator(img_shape=SHAPE)
        self.calls = 0

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        self.calls += 1
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)
        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return [opt_g, opt_d], []


def images(rows: int = 24) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(rows, *SHAPE, generator=gen), torch.zeros(rows, dtype=torch.long))
    return DataLoader(data, batch_size=8)


class Regressor(L.LightningModule):
    """Automatic optimization, each step hook with the signature ``kind`` names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = nn.Linear(64, 1)
        self.seen: list[tuple[str, int]] = []

    def _loss(self, batch):
        return F.mse_loss(self.net(batch[0].flatten(1)), batch[1].float()[:, None])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BatchOnly(Regressor):
    def training_step(self, batch):
        return self._loss(batch)

    def validation_step(self, batch):
        self.seen.append(("validation", 1))
        return self._loss(batch)


class VarArgs(Regressor):
    def training_step(self, *args):
        self.seen.append(("training", len(args)))
        return self._loss(args[0])

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.seen.append(("validation", dataloader_idx))
        return self._loss(batch)


def fit(model, tmp_path, val=None, **kwargs):
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=tmp_path,
        callbacks=[guard := ResourceGuard(log_dir=tmp_path / "rg", profile=False, **kwargs)],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceGuardWarning)  # no fallback, no "tracing failed"
        trainer.fit(model, images(), val)
    return guard


def test_lightnings_gan_example_is_traced_and_trains(tmp_path):
    model = GAN()
    guard = fit(model, tmp_path)
    assert guard.plan is not None and guard.plan.estimate.method == "traced"
    assert guard.plan.estimate.breakdown["optimizer_state"] > 0  # both Adams' state counted
    assert model.calls == 3  # the estimate ran on a copy: the real module counts only the real steps
    assert guard.report is not None and (tmp_path / "rg" / "report.md").is_file()


def test_a_step_without_batch_idx_is_traced_and_so_is_its_validation(tmp_path):
    model = BatchOnly("batch")
    guard = fit(model, tmp_path, val=images(8))
    assert guard.plan is not None and guard.plan.estimate.method == "traced"
    loops = {c.loop: c for c in guard._evals.checks}
    assert loops["validation"].estimate.method == "traced"


def test_several_validation_loaders_get_their_dataloader_idx(tmp_path):
    model = VarArgs("varargs")
    guard = fit(model, tmp_path, val=[images(8), images(16)])
    assert guard.plan is not None and guard.plan.estimate.method == "traced"
    assert ("training", 2) in model.seen  # `*args` takes batch_idx, as Lightning decides
    assert {c.loop for c in guard._evals.checks} >= {"validation (dataloader 0)", "validation (dataloader 1)"}


class _Hooks:
    def one(self, batch): ...
    def two(self, batch, i): ...
    def named(self, batch, *, batch_idx=0): ...
    def star(self, *args): ...
    def three(self, batch, batch_idx, dataloader_idx=0): ...


@pytest.mark.parametrize(
    ("hook", "training", "evaluation"),
    [
        ("one", ("b",), ("b", 1)),  # eval with one argument: dataloader_idx follows the batch
        ("two", ("b", 0), ("b", 0, 1)),
        ("star", ("b", 0), ("b", 0, 1)),
        ("three", ("b", 0), ("b", 0, 1)),
    ],
)
def test_the_arguments_are_lightnings(hook, training, evaluation):
    fx = getattr(_Hooks(), hook)
    assert training_step_args(fx, "b") == training
    assert eval_step_args(fx, "b", 0, 1) == evaluation
    assert eval_step_args(fx, "b", 0, None) == training
