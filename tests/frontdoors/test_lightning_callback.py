"""The Lightning `ResourceGuard` callback: planning on a real batch, applying the plan through the
Trainer, failing fast, checkpoints, logging, monitoring and the callback contract."""

from __future__ import annotations

import logging
import threading
import types
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import resource_guard.planning.planner as plan_module
from resource_guard.devices import play_cpu, resolve_device
from resource_guard.errors import ConfigurationError, DoesNotFitError, ResourceGuardWarning
from resource_guard.estimate.allocation.allocator import DeviceFit
from resource_guard.frontdoors.lightning import apply as ap
from resource_guard.frontdoors.lightning import internals as li
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.frontdoors.lightning.plan import plan_locally
from resource_guard.frontdoors.run import agree
from resource_guard.observe.profiling import ProfileWindow

DIM = 16
ROWS = 64


# ---------------------------------------------------------------------------------------------------
# a tiny model and datamodule; the model counts its training steps and the batch sizes it saw


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(ROWS, DIM, generator=generator)
        self.y = torch.randn(ROWS, 1, generator=generator)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=True)


class Net(L.LightningModule):
    def __init__(self, log: bool = False, fail_at: int | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(DIM, 1)
        self.do_log, self.fail_at = log, fail_at
        self.steps = 0
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        if self._trainer is not None:  # not while estimating (on a detached copy)
            self.steps += 1
            self.seen.append(batch[0].shape[0])
            self.accumulate_seen = self.trainer.accumulate_grad_batches
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("boom in training_step")
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        if self.do_log:
            self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return [optimizer], [schedule]


class StepCounter(Net):
    """`training_step` counts every call, also those made while estimating (on a detached copy)."""

    calls = 0

    def training_step(self, batch, batch_idx):
        StepCounter.calls += 1
        return super().training_step(batch, batch_idx)


def trainer(*callbacks, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return L.Trainer(callbacks=list(callbacks), **options)


@pytest.fixture
def fake_plan(monkeypatch):
    """Replace the planner by one that returns a fixed plan (and records its calls)."""
    calls: list[dict] = []

    def install(
        micro: int | None = None,
        accumulation: int = 1,
        precision: str | None = None,
        checkpointing: bool = False,
        fails: bool = False,
    ) -> list[dict]:
        def fake(model, optimizer, batch, loss_fn=None, **kwargs):
            calls.append(
                {"model": model, "optimizer": optimizer, "batch": batch, "loss_fn": loss_fn, **kwargs}
            )
            if fails:
                raise DoesNotFitError("nothing fits (fake)", report={"fake": True})
            target = kwargs["target_batch_size"]
            m = micro or target // (accumulation * kwargs["world_size"])
            prec = precision or (kwargs["precision"] if kwargs["precision"] != "auto" else "32-true")
            estimate = types.SimpleNamespace(
                method="traced",
                peak_bytes=1 << 20,
                breakdown={"parameters": 1 << 20},
                precision=prec,
                timeline=(),
            )
            device = resolve_device("cpu")
            fit = DeviceFit(
                device=device, capacity_bytes=1 << 30, allocated_peak_bytes=1 << 20,
                reserved_peak_bytes=1 << 20, context_bytes=0, workspace_bytes=0,
                device_total_bytes=1 << 20, usable_bytes=1 << 29, fits=True, headroom_bytes=1 << 29,
            )  # fmt: skip
            return types.SimpleNamespace(
                micro_batch_size=m,
                accumulation_steps=accumulation,
                precision=prec,
                checkpointing=checkpointing,
                device=device,
                estimate=estimate,
                fit=fit,
                reasons=("fake plan",),
            )

        monkeypatch.setattr(plan_module, "plan", fake)
        return calls

    return install


# ---------------------------------------------------------------------------------------------------
# constructor


def test_constructible_with_defaults_and_no_side_effects():
    before = set(threading.enumerate())
    guard = ResourceGuard()
    assert guard.plan is None and guard.decisions is None and guard.report is None
    assert guard.state_dict() == {}
    assert not set(threading.enumerate()) - before  # (another test's thread may end meanwhile)


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"headroom": 1.2}, "ResourceGuard(headroom=1.2)"),
        ({"headroom": -0.1}, "ResourceGuard(headroom=-0.1)"),
        ({"target_batch_size": 0}, "ResourceGuard(target_batch_size=0)"),
        ({"target_batch_size": 3.5}, "ResourceGuard(target_batch_size=3.5)"),
        ({"precision": "fp8"}, "ResourceGuard(precision='fp8')"),
        ({"checkpointing": "yes"}, "ResourceGuard(checkpointing='yes')"),
        ({"accumulation": 0}, "ResourceGuard(accumulation=0)"),
        ({"memory_limit": "lots"}, "ResourceGuard(memory_limit='lots')"),
        ({"memory_limit": -5}, "ResourceGuard(memory_limit=-5)"),
        ({"fail_fast": "no"}, "ResourceGuard(fail_fast='no')"),
        ({"profile": 3}, "ResourceGuard(profile=3)"),
        ({"device": ""}, "ResourceGuard(device='')"),
    ],
)
def test_constructor_rejects_bad_arguments_quoting_the_call(kwargs, quoted):
    with pytest.raises(ConfigurationError) as info:
        ResourceGuard(**kwargs)
    assert quoted in str(info.value)


def test_lightning_internals_are_where_we_expect():
    """Fails loudly when a Lightning release moves a private attribute resource_guard relies on."""
    assert set(li.LIGHTNING_INTERNALS) == {
        "data_from_module",
        "drop_train_dataloader",
        "before_batch_transfer",
        "transform_train_source",  # tests/frontdoors/test_lightning_rebatch.py
        "process_train_loader",
        "skip_inherited_step_hooks",  # tests/frontdoors/test_hot_path.py
        "eval_combined_loader",  # these four: tests/frontdoors/test_lightning_eval_split.py and below
        "eval_batch_counts",
        "restart_eval_iterator",
        "predict_outputs",
    }
    assert set(li.LIGHTNING_INTERNALS) <= set(li.__all__)
    t = trainer()
    model, data = Net(), Data()
    t.fit_loop._data_source.instance = data  # what `fit(model, datamodule)` does
    assert hasattr(t.fit_loop, "_combined_loader"), "fit_loop._combined_loader moved"
    assert callable(getattr(t.fit_loop._data_source, "is_module", None)), "fit_loop._data_source moved"
    assert li.data_from_module(t) is True
    t.fit_loop._data_source.instance = DataLoader(TensorDataset(torch.zeros(4, DIM)))
    assert li.data_from_module(t) is False
    assert callable(getattr(model, "_on_before_batch_transfer", None)), "_on_before_batch_transfer moved"
    assert li.before_batch_transfer(model, [torch.zeros(2)])[0].shape == (2,)
    t.fit_loop._combined_loader = object()
    li.drop_train_dataloader(t)
    assert t.fit_loop._combined_loader is None


# ---------------------------------------------------------------------------------------------------
# applying a plan


def test_applies_micro_batch_and_accumulation_then_restores(fake_plan):
    calls = fake_plan(accumulation=4)
    guard = ResourceGuard(monitor=False)
    model, data = Net(), Data(batch_size=16)
    t = trainer(guard, max_steps=2)
    t.fit(model, data)
    assert len(calls) == 1 and calls[0]["target_batch_size"] == 16 and calls[0]["world_size"] == 1
    d = guard.decisions
    assert (d.micro_batch_size, d.accumulation_steps, d.target_batch_size) == (4, 4, 16)
    assert model.seen == [4] * 8, "2 optimizer steps of 4 micro-batches of 4"
    assert model.accumulate_seen == 4 and t.global_step == 2
    # fit is over: the Trainer and the datamodule are as the user configured them
    assert t.accumulate_grad_batches == 1 and data.batch_size == 16


def test_plans_on_the_real_batch_with_the_modules_training_step(fake_plan):
    calls = fake_plan()
    model = Net(log=True)
    t = trainer(ResourceGuard(monitor=False))
    t.fit(model, Data(batch_size=8))
    call = calls[0]
    assert call["model"] is model and call["optimizer"] is t.optimizers[0]
    assert call["batch"][0].shape == (8, DIM)
    assert call["loss_fn"] is ap.training_step_loss
    assert call["device"] == "cpu" and call["strategy"] == "single"


def test_target_batch_size_changes_the_loader_batch(fake_plan):
    fake_plan(micro=8, accumulation=4)
    guard = ResourceGuard(target_batch_size=32, monitor=False)
    model = Net()
    trainer(guard, max_steps=1).fit(model, Data(batch_size=16))
    assert model.seen == [8, 8, 8, 8]


def test_precision_plugin_is_swapped_for_the_plan_and_restored(fake_plan):
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    fake_plan(precision="bf16-mixed")
    seen = []

    class Spy(Net):
        def training_step(self, batch, batch_idx):
            seen.append((type(self.trainer.precision_plugin), torch.is_autocast_enabled("cpu")))
            return super().training_step(batch, batch_idx)

    t = trainer(ResourceGuard(precision="auto", monitor=False), max_steps=1)
    t.fit(Spy(), Data())
    assert seen[-1] == (MixedPrecision, True)
    assert type(t.precision_plugin) is Precision


def test_checkpointing_is_applied_during_fit_and_removed_after(fake_plan):
    fake_plan(checkpointing=True)
    seen = []

    class Spy(Net):
        def training_step(self, batch, batch_idx):
            seen.append("forward" in self.blocks[0].__dict__)
            return super().training_step(batch, batch_idx)

    model = Spy()
    trainer(ResourceGuard(monitor=False), max_steps=1).fit(model, Data())
    assert seen and all(seen)
    assert "forward" not in model.blocks[0].__dict__


def test_the_traced_training_step_frees_the_modules_outputs_as_lightning_does():
    """Lightning keeps only what `training_step` returns: the module's outputs are its locals, gone before
    backward; a plain loop's `output = model(x)` keeps them (estimate_memory's default)."""
    from resource_guard import estimate_memory

    module, batch = Net(), (torch.randn(64, DIM), torch.randn(64, 1))
    optimizer = torch.optim.AdamW(module.parameters())
    traced = estimate_memory(module, optimizer, batch, ap.training_step_loss, device="cpu")
    dropped = estimate_memory(
        module, optimizer, batch, ap.training_step_loss, device="cpu", keep_outputs=False
    )
    as_loop = estimate_memory(module, optimizer, batch, lambda m, b: m.training_step(b, 0), device="cpu")
    assert traced.peak_bytes == dropped.peak_bytes < as_loop.peak_bytes


def test_respects_trainer_accumulation_and_says_so(fake_plan, caplog):
    calls = fake_plan()
    guard = ResourceGuard(monitor=False)
    model = Net()
    with caplog.at_level(logging.INFO):
        trainer(guard, accumulate_grad_batches=2, max_steps=1).fit(model, Data(batch_size=8))
    assert calls[0]["target_batch_size"] == 8, "planned per optimizer micro-step under the fixed accumulation"
    assert guard.decisions.accumulation_steps == 2 and guard.decisions.target_batch_size == 16
    assert "Trainer(accumulate_grad_batches=2)" in caplog.text


def test_fixed_accumulation_that_cannot_fit_fails_fast(fake_plan):
    fake_plan(micro=2, accumulation=4)  # the planner would need 4× more accumulation
    with pytest.raises(DoesNotFitError, match="accumulate_grad_batches=2"):
        trainer(ResourceGuard(monitor=False), accumulate_grad_batches=2).fit(Net(), Data(batch_size=8))


def test_respects_trainer_precision(fake_plan):
    calls = fake_plan()
    trainer(ResourceGuard(monitor=False), precision="bf16-mixed", max_steps=1).fit(Net(), Data())
    trainer(ResourceGuard(precision="auto", monitor=False), precision="bf16-mixed", max_steps=1).fit(
        Net(), Data()
    )
    assert [c["precision"] for c in calls] == ["bf16-mixed", "bf16-mixed"]


def _losses(*callbacks, **kwargs) -> list[float]:
    losses: list[float] = []

    class Recorded(Net):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if self._trainer is not None:  # not the pre-flight's step on a detached copy
                losses.append(float(out["loss"]))
            return out

    torch.manual_seed(0)
    trainer(*callbacks, max_steps=3, **kwargs).fit(Recorded(), Data())
    return losses


@pytest.mark.parametrize("isa", ["avx512_core_bf16", "avx2"])
def test_the_default_keeps_the_trainers_precision_and_the_losses(isa, caplog):
    """Numerics by consent: on a CPU with native bf16 too, the run keeps Lightning's default 32-true and
    trains to the same losses as without the callback; ``precision="auto"`` opts in to the planner's
    choice, bf16-mixed there."""
    with play_cpu(isa):
        baseline = _losses()
        guard = ResourceGuard(monitor=False)
        with caplog.at_level(logging.INFO):
            guarded = _losses(guard)
        chosen = ResourceGuard(precision="auto", monitor=False)
        trainer(chosen, max_steps=1).fit(Net(), Data())
    assert guard.decisions.precision == "32-true" and guarded == baseline
    assert "precision fixed by the Trainer's precision (32-true, Lightning's default" in caplog.text
    assert chosen.decisions.precision == ("bf16-mixed" if isa == "avx512_core_bf16" else "32-true")


def test_conflicting_settings_are_refused_with_the_remedy():
    with pytest.raises(ConfigurationError, match="either remove `accumulate_grad_batches`"):
        trainer(ResourceGuard(accumulation=3, monitor=False), accumulate_grad_batches=2).fit(Net(), Data())
    with pytest.raises(ConfigurationError, match="set the precision in one place"):
        trainer(ResourceGuard(precision="32-true", monitor=False), precision="bf16-mixed").fit(Net(), Data())
    with pytest.raises(ConfigurationError, match="pass `Trainer\\(precision='bf16-true'\\)`"):
        trainer(ResourceGuard(precision="bf16-true", monitor=False)).fit(Net(), Data())


def test_dataloaders_passed_to_fit_are_re_batched_when_the_micro_batch_is_smaller(fake_plan):
    """More forms in tests/frontdoors/test_lightning_rebatch.py."""
    fake_plan(accumulation=2)
    loader = DataLoader(TensorDataset(torch.randn(32, DIM), torch.randn(32, 1)), batch_size=16)
    model = Net()
    trainer(ResourceGuard(monitor=False)).fit(model, train_dataloaders=loader)
    assert model.seen == [8, 8, 8, 8] and model.accumulate_seen == 2


def test_refuses_dataloaders_passed_to_fit_when_the_micro_batch_is_larger(fake_plan):
    fake_plan(micro=32)
    loader = DataLoader(TensorDataset(torch.randn(32, DIM), torch.randn(32, 1)), batch_size=16)
    model = StepCounter()
    StepCounter.calls = 0
    with pytest.raises(ConfigurationError, match="cannot run as whole micro-batches of 32"):
        trainer(ResourceGuard(monitor=False)).fit(model, train_dataloaders=loader)
    assert model.steps == 0


def test_dataloaders_passed_to_fit_are_fine_when_the_batch_size_stays(fake_plan):
    fake_plan()
    loader = DataLoader(TensorDataset(torch.randn(32, DIM), torch.randn(32, 1)), batch_size=16)
    model = Net()
    trainer(ResourceGuard(monitor=False)).fit(model, train_dataloaders=loader)
    assert model.seen == [16, 16]


def test_a_module_without_batch_size_is_re_batched(fake_plan):
    """More forms in tests/frontdoors/test_lightning_rebatch.py."""
    fake_plan(accumulation=2)

    class NoBatchSize(Net):
        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(32, DIM), torch.randn(32, 1)), batch_size=16)

    model = NoBatchSize()
    trainer(ResourceGuard(monitor=False)).fit(model)
    assert model.seen == [8, 8, 8, 8] and model.accumulate_seen == 2


def test_manual_optimization_is_planned_not_refused(fake_plan):
    """More in tests/frontdoors/test_lightning_manual.py."""
    calls = fake_plan()

    class Manual(Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    # a training_step that steps no optimizer: Lightning counts no step, so the batches are limited
    trainer(ResourceGuard(monitor=False), max_steps=-1, max_epochs=1, limit_train_batches=1).fit(
        Manual(), Data()
    )
    assert calls and isinstance(calls[0]["optimizer"], list)


def test_several_optimizers_under_automatic_optimization_plan_the_one_the_loop_steps(fake_plan):
    """Lightning 2 itself refuses several optimizers under automatic optimization; a custom strategy
    could still hand over several: its automatic loop steps the first, which is what is planned."""
    calls = fake_plan()
    guard = ResourceGuard(monitor=False)
    t, model = trainer(guard, max_steps=1), Net()
    t.fit(model, Data())
    t.strategy.optimizers = [
        torch.optim.SGD(model.blocks.parameters()),
        torch.optim.SGD(model.head.parameters()),
    ]
    plan_locally(guard, t, model, [torch.zeros(2, DIM), torch.zeros(2, 1)], 2, None)
    assert calls[-1]["optimizer"] is t.strategy.optimizers[0]


def test_unknown_device_is_refused_in_setup_before_any_estimate():
    StepCounter.calls = 0
    with pytest.raises(ConfigurationError, match="nope"):
        trainer(ResourceGuard(device="nope", monitor=False)).fit(StepCounter(), Data())
    assert StepCounter.calls == 0


def test_plans_for_a_catalog_device(fake_plan):
    calls = fake_plan(precision="16-mixed")
    guard = ResourceGuard(device="t4", precision="auto", monitor=False)
    trainer(guard, max_steps=1).fit(Net(), Data())
    assert calls[0]["device"] == "t4" and guard.decisions.precision == "16-mixed"


# ---------------------------------------------------------------------------------------------------
# the real planner


@pytest.mark.slow
def test_memory_cap_forces_accumulation_keeping_the_effective_batch():
    guard = ResourceGuard(monitor=False, memory_limit=_cap_between(Net, 4, 64), precision="32-true")
    model = Net()
    trainer(guard, max_steps=1).fit(model, Data(batch_size=64))
    d = guard.decisions
    assert d.accumulation_steps > 1
    assert d.micro_batch_size * d.accumulation_steps * d.world_size == d.target_batch_size == 64
    assert set(model.seen) == {d.micro_batch_size} and len(model.seen) == d.accumulation_steps
    assert guard.plan is not None and guard.plan.micro_batch_size == d.micro_batch_size


def test_fail_fast_raises_before_any_training_step():
    StepCounter.calls = 0
    model = StepCounter()
    guard = ResourceGuard(memory_limit=1024, monitor=False)
    with pytest.raises(DoesNotFitError) as info:
        trainer(guard).fit(model, Data())
    assert model.steps == 0, "no real training step ran"
    assert info.value.report is not None
    assert guard.decisions is None


def test_without_fail_fast_a_warning_and_the_run_continues_unchanged():
    model = Net()
    guard = ResourceGuard(memory_limit=1024, monitor=False, fail_fast=False)
    with pytest.warns(ResourceGuardWarning, match="continues unchanged"):
        trainer(guard, max_steps=2).fit(model, Data(batch_size=16))
    assert model.seen == [16, 16] and guard.decisions is None


def test_self_log_in_training_step_traces_without_warning():
    guard = ResourceGuard(monitor=False, precision="32-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(guard, max_steps=1).fit(Net(log=True), Data())
    assert guard.plan is not None and guard.plan.estimate.method == "traced"
    assert not [w for w in caught if "self.log()" in str(w.message)]
    assert not [w for w in caught if issubclass(w.category, ResourceGuardWarning)]


def test_plan_is_logged_to_console_and_tensorboard(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = L.loggers.TensorBoardLogger(str(tmp_path), name="tb")
    guard = ResourceGuard(monitor=False, precision="32-true")
    with caplog.at_level(logging.INFO):
        trainer(guard, logger=logger, max_steps=1).fit(Net(), Data())
    assert "ResourceGuard plan" in caplog.text and "pre-flight" in caplog.text
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    assert "resource_guard/plan/text_summary" in events.Tags()["tensors"]
    text = events.Tensors("resource_guard/plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "micro-batch" in text and "parameters" in text and "| config (micro×accum)" in text


# ---------------------------------------------------------------------------------------------------
# checkpoints


def test_state_dict_round_trip_and_malformed_state():
    d = ap.Decisions(4, 2, "bf16-mixed", True, 8, 1)
    guard = ResourceGuard()
    guard.decisions = d
    other = ResourceGuard()
    other.load_state_dict(guard.state_dict())
    assert other._restored == d
    with pytest.raises(ConfigurationError, match="malformed"):
        other.load_state_dict({"decisions": {"micro_batch_size": 4}})


def test_resumed_run_reapplies_the_decisions_without_planning(tmp_path, fake_plan):
    calls = fake_plan(accumulation=4)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = ResourceGuard(monitor=False)
    trainer(first, checkpoint, max_steps=2, enable_checkpointing=True).fit(Net(), Data(batch_size=16))
    assert len(calls) == 1
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["ResourceGuard"]
    assert saved == {"decisions": first.decisions.to_dict()}

    second, model = ResourceGuard(monitor=False), Net()
    trainer(second, max_steps=3).fit(model, Data(batch_size=16), ckpt_path=tmp_path / "last.ckpt")
    assert len(calls) == 1, "no new plan"
    assert second.decisions == first.decisions and second.plan is None
    assert model.seen == [4] * 4 and model.accumulate_seen == 4


# ---------------------------------------------------------------------------------------------------
# contract


def test_two_fit_calls_on_one_trainer(fake_plan):
    calls = fake_plan(accumulation=2)
    guard = ResourceGuard(monitor=False)
    t = trainer(guard, max_steps=1)
    data = Data(batch_size=16)
    t.fit(Net(), data)
    t.fit_loop.epoch_loop.max_steps = 2
    model = Net()
    t.fit(model, data)
    assert len(calls) == 2, "each fit plans from the user's own configuration"
    assert calls[1]["target_batch_size"] == 16
    assert model.seen == [8, 8] and t.accumulate_grad_batches == 1 and data.batch_size == 16


def test_teardown_twice_is_safe(tmp_path, fake_plan):
    fake_plan(accumulation=2)
    guard = ResourceGuard(profile=False)
    t, model = trainer(guard, max_steps=1, default_root_dir=tmp_path), Net()
    t.fit(model, Data())
    guard.teardown(t, model, "fit")
    guard.teardown(t, model, "fit")
    guard.on_exception(t, model, RuntimeError("late"))
    assert t.accumulate_grad_batches == 1


def test_exception_in_training_step_leaves_no_thread_or_profiler(tmp_path, fake_plan):
    fake_plan(accumulation=2)
    before = {th.ident for th in threading.enumerate()}
    profiling = []

    class Spy(Net):
        def training_step(self, batch, batch_idx):
            profiling.append(torch._C._autograd._profiler_enabled())
            return super().training_step(batch, batch_idx)

    window = ProfileWindow(skip_first=0, wait=0, warmup=1, active=5)
    guard = ResourceGuard(log_dir=tmp_path / "rg", profile=window)
    t, data = trainer(guard, max_steps=20, default_root_dir=tmp_path), Data(batch_size=16)
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(Spy(fail_at=3), data)
    assert any(profiling), "the profiler window was open when training_step failed"
    assert {th.ident for th in threading.enumerate() if th.is_alive()} <= before
    assert not torch._C._autograd._profiler_enabled()
    assert t.accumulate_grad_batches == 1 and data.batch_size == 16, "restored after the exception"


def test_monitoring_writes_a_report(tmp_path, fake_plan):
    fake_plan()
    guard = ResourceGuard(log_dir=tmp_path / "rg", profile=False)
    trainer(guard, max_steps=3).fit(Net(), Data())
    assert guard.report is not None and guard.report.stats.steps == 3
    assert (tmp_path / "rg" / "report.json").exists()


def test_monitor_off_starts_nothing(fake_plan):
    fake_plan()
    before = {th.ident for th in threading.enumerate()}
    guard = ResourceGuard(monitor=False)
    trainer(guard, max_steps=2).fit(Net(), Data())
    assert guard.report is None
    assert {th.ident for th in threading.enumerate() if th.is_alive()} <= before


def test_a_plan_that_changes_nothing_leaves_training_identical(fake_plan):
    """Peeking at the first batch does not shift the data order or any random state."""
    fake_plan()

    def run(callbacks):
        L.seed_everything(7, verbose=False)
        model = Net()
        trainer(*callbacks, max_steps=3).fit(model, Data())
        return [p.detach().clone() for p in model.parameters()]

    plain = run([])
    guarded = run([ResourceGuard(monitor=False)])
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded))


# ---------------------------------------------------------------------------------------------------
# helpers


def _cap_between(model_cls, small: int, large: int) -> int:
    """A memory cap under which a batch of ``small`` fits and one of ``large`` does not (estimated)."""
    from resource_guard.estimate import estimate_memory

    def peak(n: int) -> int:
        model = model_cls()
        optimizer = torch.optim.AdamW(model.parameters())
        batch = [torch.randn(n, DIM), torch.randn(n, 1)]
        return estimate_memory(model, optimizer, batch, ap.training_step_loss, device="cpu").peak_bytes

    lo, hi = peak(small), peak(large)
    assert hi > lo
    return int((lo + hi) / 2 / 0.9)


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_transformer_example_picks_accumulation_under_a_cap(monkeypatch, capsys):
    """`examples/lightning_transformer.py` run as a script (in this interpreter: Lightning is imported)."""
    import runpy

    argv = ["lightning_transformer.py", "--max-steps", "1", "--memory-limit", "16MiB", "--batch-size", "64"]
    monkeypatch.setattr("sys.argv", argv)
    runpy.run_path(str(ROOT / "examples" / "lightning_transformer.py"), run_name="__main__")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("plan:"))
    fields = dict(item.split("=") for item in line.split()[1:])
    micro, accumulation = int(fields["micro_batch_size"]), int(fields["accumulation"])
    assert accumulation > 1 and micro * accumulation == int(fields["target_batch_size"]) == 64
    assert fields["optimizer_steps"] == "1"


@pytest.mark.slow
def test_lightning_cli_config_adds_the_callback(tmp_path):
    """`python examples/lightning_cli.py fit --config configs/lightning_cli.yaml` in a subprocess."""
    import subprocess
    import sys

    command = [
        sys.executable, str(ROOT / "examples" / "lightning_cli.py"), "fit",
        "--config", str(ROOT / "configs" / "lightning_cli.yaml"),
        "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "ResourceGuard plan" in output and "memory capped at 16.0 MiB" in output
    assert "accumulation 1 " not in output.split("ResourceGuard plan")[1].splitlines()[0]
    assert (tmp_path / "resource_guard" / "report.json").exists(), (
        "the monitor ran, writing under the run dir"
    )


# ---------------------------------------------------------------------------------------------------
# the agreement across ranks, with a fake strategy standing in for the collectives


class FakeStrategy:
    """all_gather / broadcast over a fixed set of per-rank rows (what DDP would gather)."""

    def __init__(self, rows: list[list[int]], payloads: dict[int, bytes] | None = None) -> None:
        self.rows, self.payloads = rows, payloads or {}
        self.root_device = torch.device("cpu")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.rows, dtype=torch.int64)

    def broadcast(self, obj, src=0):
        return self.payloads.get(src, obj)


@settings(max_examples=60, deadline=None)
@given(
    per_rank=st.sampled_from([4, 6, 8, 12, 16, 24, 32]),
    world=st.integers(1, 4),
    data=st.data(),
)
def test_agreement_picks_the_smallest_micro_batch_and_keeps_the_target(per_rank, world, data):
    from resource_guard.step.batching import divisors

    micros = [data.draw(st.sampled_from(divisors(per_rank))) for _ in range(world)]
    ckpts = [data.draw(st.booleans()) for _ in range(world)]
    target = per_rank * world
    rows = [[0, m, per_rank // m, int(c), 0, target] for m, c in zip(micros, ckpts)]
    me = data.draw(st.integers(0, world - 1))
    mine = ap.Decisions(micros[me], per_rank // micros[me], "32-true", ckpts[me], target, world)
    fake = types.SimpleNamespace(strategy=FakeStrategy(rows), global_rank=me, world_size=world)
    agreed = agree(ap.decisions_row(mine), None, ap.StrategyCollective(fake), key=ap.most_conservative)
    assert agreed.error is None and agreed.row is not None
    chosen, source = ap.decisions_from_row(agreed.row, world), agreed.source_rank
    assert chosen.micro_batch_size == min(micros) == micros[source]
    assert chosen.micro_batch_size * chosen.accumulation_steps * chosen.world_size == target
    if ckpts[source] is False:
        assert not any(c for m, c in zip(micros, ckpts) if m == min(micros))


def test_agreement_gives_every_rank_the_failing_ranks_error():
    import pickle

    report = {"needed": 123}
    rows = [[0, 8, 1, 0, 0, 16], [1, 0, 0, 0, 0, 0]]
    payloads = {1: pickle.dumps(("nothing fits rank 1", report))}
    fake = types.SimpleNamespace(strategy=FakeStrategy(rows, payloads), global_rank=0, world_size=2)
    ok = ap.decisions_row(ap.Decisions(8, 1, "32-true", False, 16, 2))
    agreed = agree(ok, None, ap.StrategyCollective(fake), key=ap.most_conservative)
    error, source = agreed.error, agreed.source_rank
    assert agreed.row is None and source == 1
    assert isinstance(error, DoesNotFitError) and error.report == report
    assert str(error) == "pre-flight failed on rank 1 (every rank stops): nothing fits rank 1"


def test_training_step_reading_the_trainer_falls_back_to_the_analytic_estimate():
    class ReadsTrainer(Net):
        def training_step(self, batch, batch_idx):
            self.trainer.global_step  # noqa: B018 - a read, as user code does
            return super().training_step(batch, batch_idx)

    guard = ResourceGuard(monitor=False, precision="32-true")
    with pytest.warns(ResourceGuardWarning, match="not attached to a `Trainer`"):
        trainer(guard, max_steps=1).fit(ReadsTrainer(), Data())
    assert guard.plan is not None and guard.plan.estimate.method == "analytic"


def test_the_monitor_gets_the_model_flops_of_a_training_step(tmp_path):
    from resource_guard.observe.throughput import count_flops

    guard = ResourceGuard(precision="32-true", profile=False, log_dir=str(tmp_path))
    model = Net()
    trainer(guard, max_steps=3).fit(model, Data(batch_size=16))
    micro = guard.decisions.micro_batch_size
    x, y = torch.randn(micro, DIM), torch.randn(micro, 1)
    expected = count_flops(Net(), (x, y), ap.training_step_loss)
    assert expected and guard.report is not None
    assert guard.report.to_dict()["summary"]["flops_per_step"] == pytest.approx(expected)
