"""`ResourceGuard` under manual optimization (`automatic_optimization = False`) and with every form of
`configure_optimizers`: the module's own `training_step` estimated with every optimizer's state, the
plan applied, the run monitored and reported, and the callback's contract (as Lightning tests its own)."""

from __future__ import annotations

import copy
import json
import types
import warnings

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from cpu_reference import reference_checked, skip_unless_cpu_runs
from resource_guard.errors import ConfigurationError, DoesNotFitError
from resource_guard.estimate import estimate_memory, measure_user_step
from resource_guard.frontdoors.lightning import manual as lightning_manual
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.observe.profiling import ProfileWindow

LATENT, DATA, WIDTH, ROWS = 16, 32, 64, 48


class ManualNet(L.LightningModule):
    """One optimizer stepped by hand, with a scheduler, `self.log` and gradient clipping."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(DATA, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
        self.steps = 0
        self.seen: list[int] = []

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(ROWS, DATA, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data, data[:, :1]), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        if self._trainer is not None:  # not while estimating (on a detached copy)
            self.steps += 1
            self.seen.append(batch[0].shape[0])
        opt = self.optimizers()
        opt.zero_grad()
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()
        self.log("loss", loss)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


class Gan(L.LightningModule):
    """Lightning 2's GAN: two optimizers, `toggle_optimizer`, `manual_backward`. ``form`` picks how
    `configure_optimizers` returns them."""

    def __init__(self, batch_size: int = 8, form: str = "list") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size, self.form = batch_size, form
        self.generator = nn.Sequential(nn.Linear(LATENT, WIDTH), nn.ReLU(), nn.Linear(WIDTH, DATA))
        self.discriminator = nn.Sequential(nn.Linear(DATA, WIDTH), nn.LeakyReLU(0.2), nn.Linear(WIDTH, 1))
        self.steps = 0

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(ROWS, DATA, generator=gen), torch.randn(ROWS, LATENT, generator=gen)),
            batch_size=self.batch_size,
        )

    def training_step(self, batch, batch_idx):
        if self._trainer is not None:
            self.steps += 1
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        self.toggle_optimizer(opt_g)
        fake = self.generator(noise)
        loss_g = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        with opt_d.toggle_model():
            loss_d = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
            loss_d = loss_d + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
            self.manual_backward(loss_d)
            opt_d.step()
            opt_d.zero_grad()
        if self._trainer is not None:
            self.log_dict({"loss_g": loss_g, "loss_d": loss_d})

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-4)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-4)
        if self.form == "tuple":
            return opt_g, opt_d
        if self.form == "dicts":
            return (
                {"optimizer": opt_g, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt_g, 1)},
                {"optimizer": opt_d, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt_d, 1)},
            )
        if self.form == "lists":
            return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_d, 1)]
        return [opt_g, opt_d]


def trainer(*callbacks, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return L.Trainer(callbacks=list(callbacks), **options)


def state_bytes(optimizers) -> int:
    return sum(
        v.untyped_storage().nbytes()
        for o in optimizers
        for s in o.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


# ---------------------------------------------------------------------------------------------------
# done when: train under ResourceGuard() with a report; nothing fits: stop before step 0


@pytest.mark.parametrize("module_cls", [ManualNet, Gan])
def test_manual_optimization_trains_under_resource_guard_with_a_report(tmp_path, module_cls):
    guard = ResourceGuard(log_dir=tmp_path, profile=False)
    model = module_cls()
    trainer(guard).fit(model)
    assert model.steps == 3
    assert guard.decisions is not None and guard.decisions.accumulation_steps == 1
    assert guard.decisions.micro_batch_size == 8
    assert (tmp_path / "report.md").is_file() and (tmp_path / "report.json").is_file()
    assert guard.report is not None
    assert guard.plan.estimate.traced  # the module's own step, not the analytic bound
    optimizers = model.trainer.optimizers
    assert guard.plan.estimate.breakdown["optimizer_state"] == state_bytes(optimizers)  # every one's state


@pytest.mark.parametrize("module_cls", [ManualNet, Gan])
def test_nothing_fits_stops_before_step_zero(module_cls):
    model = module_cls()
    # the fp32 parameters alone: no precision the plan may pick (bf16-mixed on a bf16 CPU, fp32 on
    # another) fits parameters, gradients and optimizer state there
    limit = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(DoesNotFitError):
        trainer(ResourceGuard(memory_limit=limit, monitor=False)).fit(model)
    assert model.steps == 0


def test_a_batch_that_only_fits_smaller_is_refused_not_accumulated():
    # precision pinned: under bf16-mixed (auto on a bf16 CPU) the weight copies, not the batch, dominate
    # this small net, and at 97% of the peak not even micro-batch 1 fits
    model = ManualNet(batch_size=16)
    probe = ResourceGuard(precision="32-true", monitor=False)
    trainer(probe, max_steps=1).fit(ManualNet(batch_size=16))
    peak = probe.plan.fit.device_total_bytes
    capped = ResourceGuard(precision="32-true", memory_limit=int(peak * 0.97), headroom=0.0, monitor=False)
    with pytest.raises(DoesNotFitError, match="accumulate in `training_step`"):
        trainer(capped).fit(model)
    assert model.steps == 0


def test_the_plan_says_what_manual_optimization_leaves_alone(caplog):
    guard = ResourceGuard(monitor=False)
    with caplog.at_level("INFO"):
        trainer(guard, max_steps=1).fit(ManualNet())
    assert "accumulation left alone: it is the module's own code" in caplog.text


def test_target_batch_size_sets_the_loaders_batch_size():
    guard = ResourceGuard(target_batch_size=16, monitor=False)
    model = ManualNet(batch_size=8)
    trainer(guard).fit(model)
    assert model.seen == [16, 16, 16] and model.batch_size == 8  # restored after fit


class PrecisionSeen(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.precision = trainer.precision


def test_precision_is_applied_to_manual_steps_and_restored():
    seen, guard = PrecisionSeen(), ResourceGuard(precision="bf16-mixed", monitor=False)
    fit = trainer(guard, seen)
    fit.fit(Gan())
    assert seen.precision == "bf16-mixed" and guard.plan.estimate.precision == "bf16-mixed"
    assert fit.precision == "32-true"  # the user's plugin is back after fit


def test_accumulation_argument_is_refused_under_manual_optimization():
    with pytest.raises(ConfigurationError, match=r"accumulation=2.*training_step"):
        trainer(ResourceGuard(accumulation=2, monitor=False)).fit(ManualNet())


# ---------------------------------------------------------------------------------------------------
# the trace has no side effect on the real Trainer, module, optimizers or schedulers


class Recorder(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.global_step = trainer.global_step
        self.state = [dict(o.state) for o in trainer.optimizers]
        self.epochs = [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs]
        self.logged = dict(trainer.callback_metrics)
        self.steps = pl_module.steps
        self.grads = [p.grad for p in pl_module.parameters()]


def test_the_trace_leaves_the_trainer_module_optimizers_and_schedulers_alone():
    recorder = Recorder()
    model = Gan(form="dicts")
    trainer(ResourceGuard(monitor=False), recorder, max_steps=2).fit(model)
    assert recorder.global_step == 0 and recorder.steps == 0
    assert recorder.state == [{}, {}] and recorder.epochs == [0, 0]
    assert recorder.logged == {} and all(g is None for g in recorder.grads)


# ---------------------------------------------------------------------------------------------------
# every form of configure_optimizers


@pytest.mark.parametrize("form", ["list", "tuple", "dicts", "lists"])
def test_every_manual_form_is_estimated_with_every_optimizers_state(form):
    guard = ResourceGuard(monitor=False)
    model = Gan(form=form)
    trainer(guard, limit_train_batches=1).fit(model)
    assert guard.plan.estimate.breakdown["optimizer_state"] == state_bytes(model.trainer.optimizers)


class AutoNet(L.LightningModule):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.batch_size = form, 8
        self.net = nn.Sequential(nn.Linear(DATA, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(ROWS, DATA, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data, data[:, :1]), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        if self.form == "none":
            return None
        opt = torch.optim.Adam(self.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        return {
            "single": opt,
            "list": [opt],
            "tuple": (opt,),
            "dict": {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}},
            "lists": ([opt], [sched]),
        }[self.form]


@pytest.mark.parametrize("form", ["single", "list", "tuple", "dict", "lists", "none"])
def test_every_automatic_form_is_estimated_with_its_optimizers_state(form):
    guard = ResourceGuard(monitor=False)
    model = AutoNet(form)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned `None`.*")
        trainer(guard, limit_train_batches=1).fit(model)
    breakdown = guard.plan.estimate.breakdown
    params = sum(p.numel() * 4 for p in model.parameters())
    if form == "none":  # nothing steps or zeroes: no state, the gradients stay allocated
        assert breakdown["optimizer_state"] == 0
        assert breakdown["gradients"] + breakdown["other"] >= params
    else:
        assert breakdown["optimizer_state"] == state_bytes(model.trainer.optimizers) > 2 * params - 1


# ---------------------------------------------------------------------------------------------------
# the GAN's estimate against a real CPU step of the same training_step


@pytest.mark.cpu_reference
def test_gan_training_step_estimate_matches_a_real_cpu_step():
    model = Gan(batch_size=32)
    model.train()
    optimizers = list(model.configure_optimizers())
    stub = types.SimpleNamespace(
        lr_scheduler_configs=[], gradient_clip_val=None, gradient_clip_algorithm=None
    )
    step = lightning_manual.manual_step(stub, model)  # type: ignore[arg-type]
    batch = next(iter(model.train_dataloader()))
    est = estimate_memory(model, optimizers, batch, step, device="cpu")
    skip_unless_cpu_runs(est)
    real = copy.deepcopy(model)
    real_opts = [
        type(o)(m.parameters(), lr=2e-4) for o, m in zip(optimizers, (real.generator, real.discriminator))
    ]
    with reference_checked(est):
        truth = measure_user_step(real, real_opts, batch, step)
    assert est.traced
    assert abs(est.peak_bytes / truth.peak_bytes - 1) <= 0.03, (est.peak_bytes, truth.peak_bytes)


# ---------------------------------------------------------------------------------------------------
# contract


def test_two_fits_with_one_callback_and_closing_twice_are_safe(tmp_path):
    guard = ResourceGuard(log_dir=tmp_path, profile=False)
    model = Gan()
    for _ in range(2):
        trainer(guard, limit_train_batches=2).fit(model)
    assert model.steps == 4
    guard.teardown(model.trainer, model, "fit")
    guard.teardown(model.trainer, model, "fit")
    assert (tmp_path / "report.md").is_file()


def test_the_profiler_window_records_manual_steps(tmp_path):
    window = ProfileWindow(skip_first=0, wait=0, warmup=1, active=2)
    guard = ResourceGuard(log_dir=tmp_path, profile=window, precision="32-true")
    trainer(guard).fit(Gan())
    assert list(tmp_path.rglob("*.pt.trace.json.gz")), "no trace of the profiled manual steps"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["steps"] == 3 and report["summary"]["profile"]["steps"] == 2


SHAPES = {
    "manual, one optimizer and a scheduler dict": lambda: ManualNet(),
    "GAN, a list": lambda: Gan(form="list"),
    "GAN, dicts with schedulers": lambda: Gan(form="dicts"),
    "automatic, ([optimizer], [scheduler])": lambda: AutoNet("lists"),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_contract_checkpoint_and_resume_reapply_the_decisions(tmp_path, shape):
    from lightning.pytorch.callbacks import ModelCheckpoint

    first = ResourceGuard(monitor=False, precision="32-true")
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(first, checkpoint, limit_train_batches=2, enable_checkpointing=True).fit(SHAPES[shape]())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["ResourceGuard"]
    assert saved == {"decisions": first.decisions.to_dict()}
    second = ResourceGuard(monitor=False, precision="32-true")
    trainer(second, max_epochs=2, limit_train_batches=2).fit(
        SHAPES[shape](), ckpt_path=tmp_path / "last.ckpt"
    )
    assert second.plan is None and second.decisions == first.decisions  # re-applied, not re-planned


def test_mfu_gets_the_flops_of_the_manual_step(tmp_path):
    """The GAN step's matmuls, by hand (f = 2·B·in·out): G's two layers forward; D three times forward;
    the generator's backward through frozen D (input gradients) into G (G1: weights only); the
    discriminator's two backwards (D2 input and weights, D1 weights)."""
    guard = ResourceGuard(log_dir=tmp_path, profile=False, precision="32-true")
    trainer(guard).fit(Gan())

    def f(i: int, o: int) -> int:
        return 2 * 8 * i * o

    expected = 2 * f(LATENT, WIDTH) + 3 * f(WIDTH, DATA) + 6 * f(DATA, WIDTH) + 8 * f(WIDTH, 1)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["flops_per_step"] == expected


class StepHooks(L.Callback):
    def __init__(self) -> None:
        self.starts = self.ends = 0

    def on_train_batch_start(self, *args) -> None:
        self.starts += 1

    def on_train_batch_end(self, *args) -> None:
        self.ends += 1


def test_step_hooks_fire_and_the_monitor_counts_batches_not_optimizer_steps(tmp_path):
    hooks, guard = StepHooks(), ResourceGuard(log_dir=tmp_path, profile=False)
    model = Gan()
    fit = trainer(guard, hooks, limit_train_batches=3)
    monitored: list[int] = []
    original = guard.on_train_batch_end

    def spy(*args, **kwargs):
        original(*args, **kwargs)
        if guard._run.monitor is not None:
            monitored.append(guard._run.monitor.steps)

    guard.on_train_batch_end = spy  # type: ignore[method-assign]
    fit.fit(model)
    assert hooks.starts == hooks.ends == 3
    assert fit.global_step == 6  # Lightning counts each optimizer's step
    assert monitored == [1, 2, 3]


def test_the_shadowed_methods_are_lightnings_public_ones():
    """The trace answers these LightningModule methods on the copy; if Lightning renames one, fail here."""
    for name in ("optimizers", "lr_schedulers", "manual_backward", "toggle_optimizer", "untoggle_optimizer"):
        assert callable(getattr(L.LightningModule, name)), name
    assert callable(L.LightningModule.clip_gradients)
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    wrapped = LightningOptimizer(opt)
    assert isinstance(wrapped, torch.optim.SGD) and wrapped.optimizer is opt
    assert wrapped.param_groups is opt.param_groups  # read through to the wrapped optimizer
