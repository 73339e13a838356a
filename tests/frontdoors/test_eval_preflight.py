"""Evaluation pre-flight in both front doors: an evaluation batch bigger than training's that does not
fit stops before any step (Lightning: before the sanity check); one that fits leaves the run unchanged;
what Lightning holds during validation is what the estimate assumes."""

from __future__ import annotations

import copy

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from resource_guard import ConfigurationError, DoesNotFitError, guard
from resource_guard.devices import resolve_device
from resource_guard.estimate.eval_step import estimate_eval_memory
from resource_guard.frontdoors.eval_preflight import EvalCheck, preflight_eval
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.frontdoors.lightning.eval import gradients_kept_in_fit

VOCAB, DIM = 2000, 64
CAP = "20MiB"  # a training batch of 8 fits (12 MiB); an evaluation batch of 2048 does not (~38 MiB)
SMALL, LARGE = 64, 2048


def _data(rows: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(rows, DIM, generator=g), torch.randint(0, VOCAB, (rows,), generator=g))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 256), nn.ReLU(), nn.Linear(256, VOCAB))


def _ce(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _forwards(model: nn.Module) -> list[bool]:
    """Records, per real forward (not the estimator's, on fake tensors), whether it ran in training mode."""
    seen: list[bool] = []
    model.register_forward_hook(lambda m, i, o: seen.append(m.training) if type(o) is torch.Tensor else None)
    return seen


# ---------------------------------------------------------------------------------------------------
# the shared pre-flight


def test_preflight_names_the_loop_batch_peak_usable_and_a_batch_that_fits():
    model, cpu = _mlp(), resolve_device("cpu").with_memory(8 * 2**20)
    batch = _data(LARGE)[:]
    with pytest.raises(DoesNotFitError) as caught:
        preflight_eval(model, batch, _ce, loop="validation", device=cpu)
    check = caught.value.report
    assert isinstance(check, EvalCheck) and not check.fits
    message = str(caught.value)
    assert "validation step" in message and f"batch size {LARGE}" in message
    assert f"{check.predicted_peak_bytes / 2**20:,.1f} MiB" in message
    assert f"{check.usable_bytes / 2**20:,.1f} MiB usable" in message
    largest = check.largest_fitting_batch_size
    assert largest is not None and 0 < largest < LARGE and f"batch_size={largest}" in message
    # the remedy holds: that batch size fits, one more does not (within the search's few traces)
    fits = estimate_eval_memory(model, _data(largest)[:], _ce, device="cpu").for_device(cpu, headroom=0.1)
    assert fits.fits
    assert check.to_dict()["largest_fitting_batch_size"] == largest


def test_preflight_says_when_not_even_one_sample_fits():
    model = _mlp()
    tiny = resolve_device("cpu").with_memory(2**20)  # less than the parameters
    with pytest.raises(DoesNotFitError, match="Not even batch size 1 fits"):
        preflight_eval(model, _data(16)[:], _ce, loop="test", device=tiny)


# ---------------------------------------------------------------------------------------------------
# guard


def _guard_run(eval_rows: int | None, declared: bool, **kwargs):
    model, train = _mlp(), DataLoader(_data(32), batch_size=8)
    opt = torch.optim.AdamW(model.parameters())
    val = DataLoader(_data(eval_rows or 1, seed=1), batch_size=eval_rows or 1)
    sample = next(iter(val)) if declared and eval_rows else None
    evaluated: list[tuple[bool, bool, int]] = []
    options = dict(loss_fn=_ce, device="cpu", memory_limit=CAP, monitor=False, eval_sample_batch=sample)
    with guard(model, opt, **(options | kwargs)) as g:
        for batch in g.iterate(train):
            g.backward(_ce(model, batch))
        if eval_rows and not declared:
            for x, y in g.evaluate(val):
                evaluated.append((torch.is_grad_enabled(), model.training, x.shape[0]))
                _ce(model, (x, y))
    return model, g, evaluated


def test_guard_declared_eval_batch_that_does_not_fit_stops_before_step_0():
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters())
    sample = next(iter(DataLoader(_data(LARGE), batch_size=LARGE)))
    seen = _forwards(model)
    with (
        pytest.raises(DoesNotFitError, match=rf"evaluation step does not fit: batch size {LARGE}") as caught,
        guard(
            model, opt, loss_fn=_ce, device="cpu", memory_limit=CAP, monitor=False, eval_sample_batch=sample
        ) as g,  # fmt: skip
    ):
        for batch in g.iterate(DataLoader(_data(32), batch_size=8)):
            g.backward(_ce(model, batch))
    assert caught.value.report.batch_size == LARGE
    assert seen == [] and g.optimizer_steps == 0 and not opt.state
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_guard_evaluate_stops_before_a_batch_that_does_not_fit_and_restores_the_modes():
    model, train = _mlp(), DataLoader(_data(16), batch_size=8)
    opt = torch.optim.AdamW(model.parameters())
    with guard(model, opt, loss_fn=_ce, device="cpu", memory_limit=CAP, monitor=False) as g:
        for batch in g.iterate(train):
            g.backward(_ce(model, batch))
        seen = _forwards(model)
        with pytest.raises(DoesNotFitError, match=r"evaluation step does not fit.*largest evaluation batch"):
            for _ in g.evaluate(DataLoader(_data(LARGE), batch_size=LARGE)):
                pytest.fail("an evaluation batch ran")
        assert seen == [] and model.training and torch.is_grad_enabled()


def test_guard_evaluation_that_fits_leaves_training_unchanged_and_is_reported(tmp_path):
    plain, _, _ = _guard_run(None, declared=False)
    declared, g1, _ = _guard_run(SMALL, declared=True)
    looped, g2, evaluated = _guard_run(SMALL, declared=False, log_dir=tmp_path)
    for other in (declared, looped):
        pairs = zip(plain.state_dict().values(), other.state_dict().values())
        assert all(torch.equal(a, b) for a, b in pairs)
    # eval mode under no_grad inside the loop; train mode and grad mode back after it
    assert evaluated == [(False, False, SMALL)]
    assert looped.training and torch.is_grad_enabled()
    for g in (g1, g2):
        assert any(r.startswith(f"evaluation step, batch size {SMALL}") for r in g.plan.reasons)
        assert f"evaluation step, batch size {SMALL}" in g.plan.summary()


def test_guard_evaluation_line_reaches_the_report(tmp_path):
    model, train = _mlp(), DataLoader(_data(16), batch_size=8)
    with guard(model, torch.optim.AdamW(model.parameters()), loss_fn=_ce, device="cpu", memory_limit=CAP,
               log_dir=tmp_path, profile=False) as g:  # fmt: skip
        for batch in g.iterate(train):
            g.backward(_ce(model, batch))
        for batch in g.evaluate(DataLoader(_data(SMALL), batch_size=SMALL)):
            _ce(model, batch)
    assert any(n.startswith(f"evaluation step, batch size {SMALL}") for n in g.report.stats.notes)
    assert f"evaluation step, batch size {SMALL}" in (tmp_path / "report.md").read_text()


def test_guard_evaluate_is_pre_flighted_once_per_shape_and_restores_modes_on_break():
    model, train = _mlp(), DataLoader(_data(16), batch_size=8)
    with guard(model, torch.optim.AdamW(model.parameters()), loss_fn=_ce, device="cpu", monitor=False) as g:
        for batch in g.iterate(train):
            g.backward(_ce(model, batch))
        val = DataLoader(_data(4 * SMALL), batch_size=SMALL)
        for _ in range(2):
            for _batch in g.evaluate(val):
                assert not model.training
                break
            assert model.training and torch.is_grad_enabled()
        assert len(g._evals.checks) == 1


def test_guard_evaluate_needs_a_plan():
    model = _mlp()
    with guard(model, torch.optim.AdamW(model.parameters()), device="cpu", monitor=False) as g:
        with pytest.raises(ConfigurationError, match=r"g\.evaluate\(loader\)` needs the run planned"):
            next(iter(g.evaluate([_data(4)[:]])))


# ---------------------------------------------------------------------------------------------------
# Lightning


class Net(L.LightningModule):
    def __init__(self, eval_batch: int) -> None:
        super().__init__()
        self.net = _mlp()
        self.batch_size, self.eval_batch = 8, eval_batch
        self.calls = {"train": 0, "validation": 0, "test": 0}
        self.resident: list[tuple[bool, int, bool]] = []  # (sanity check, gradients held, state exists)
        self.val_rows: list[int] = []  # the rows of each validation step that ran

    def _step(self, batch, kind: str):
        if self._trainer is not None:  # not while estimating (on a detached copy)
            self.calls[kind] += 1
        return _ce(self.net, batch)

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        if self._trainer is not None and batch_idx == 0:
            opt = self.trainer.optimizers[0] if self.trainer.optimizers else None
            grads = sum(p.grad is not None for p in self.parameters())
            self.resident.append((self.trainer.sanity_checking, grads, bool(opt and opt.state)))
        if self._trainer is not None:
            self.val_rows.append(batch[0].shape[0])
        self.log("val_loss", self._step(batch, "validation"))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._step(batch, "test"))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

    def train_dataloader(self):
        return DataLoader(_data(64), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(_data(self.eval_batch * 2, seed=1), batch_size=self.eval_batch)

    def test_dataloader(self):
        return self.val_dataloader()


def _trainer(*callbacks, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=4, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return L.Trainer(callbacks=list(callbacks), **(options | kwargs))


def _callback(**kwargs) -> ResourceGuard:
    return ResourceGuard(**(dict(memory_limit=CAP, precision="32-true", monitor=False) | kwargs))


@pytest.mark.parametrize("sanity_steps", [2, 0])
def test_lightning_splits_validation_that_does_not_fit_before_the_sanity_check(sanity_steps):
    """Decided before the sanity check: every validation step (the sanity check's too) runs a
    micro-batch of at most the largest batch that fits (tests/frontdoors/test_lightning_eval_split.py
    checks that the results are those of the whole batches)."""
    net, callback = Net(LARGE), _callback()
    _trainer(callback, num_sanity_val_steps=sanity_steps).fit(net)
    (check,) = [c for c in callback._evals.checks if not c.fits]
    assert check.loop == "validation" and check.batch_size == LARGE
    largest = check.largest_fitting_batch_size
    assert largest is not None and 0 < largest < LARGE
    assert "optimizer state" in check.estimate.assumed_target  # as validation after a step holds
    pieces = -(-LARGE // largest)  # limit_val_batches=1: one loader batch, as micro-batches
    seen = net.val_rows
    assert seen[-pieces:] and sum(seen[-pieces:]) == LARGE and max(seen) <= largest
    assert net.calls["validation"] == pieces + min(sanity_steps, pieces)
    assert any(f"batches of {LARGE} rows do not fit" in r for r in callback.plan.reasons)


def test_lightning_validation_that_fits_leaves_the_run_unchanged(caplog):
    torch.manual_seed(0)
    alone = Net(SMALL)
    _trainer().fit(alone)
    guarded, callback = Net(SMALL), _callback()
    with caplog.at_level("INFO"):
        _trainer(callback).fit(guarded)
    assert guarded.calls == alone.calls and alone.calls["validation"] == 2  # the sanity check, epoch end
    assert all(torch.equal(a, b) for a, b in zip(alone.state_dict().values(), guarded.state_dict().values()))
    assert any(r.startswith(f"validation step, batch size {SMALL}") for r in callback.plan.reasons)
    assert f"validation step, batch size {SMALL}" in caplog.text


def test_lightning_validation_line_reaches_the_report(tmp_path):
    callback = ResourceGuard(memory_limit=CAP, precision="32-true", profile=False, log_dir=tmp_path)
    _trainer(callback).fit(Net(SMALL))
    line = f"validation step, batch size {SMALL}"
    assert any(n.startswith(line) for n in callback.report.stats.notes)
    assert line in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_lightning_validate_and_test_alone(stage):
    net, loop, callback = Net(LARGE), stage.replace("validate", "validation"), _callback()
    getattr(_trainer(callback), stage)(net, verbose=False)
    (check,) = callback._evals.checks
    assert check.loop == loop and not check.fits and 0 < check.largest_fitting_batch_size < LARGE
    pieces = -(-LARGE // check.largest_fitting_batch_size)
    batches = 1 if stage == "validate" else 2  # limit_val_batches=1 counts loader batches
    assert net.calls == {"train": 0, "validation": 0, "test": 0} | {loop: batches * pieces}
    small = Net(SMALL)
    getattr(_trainer(_callback()), stage)(small, verbose=False)
    assert small.calls[loop] > 0


def test_lightning_without_fail_fast_warns_and_validates():
    net = Net(SMALL)  # below the parameters: not even one row fits
    with pytest.warns(match="Not even batch size 1 fits"):
        _trainer(_callback(fail_fast=False, memory_limit="1MiB")).validate(net, verbose=False)
    assert net.calls["validation"] >= 1


@pytest.mark.parametrize(
    ("accumulate", "val_check_interval", "kept"),
    [(1, 1.0, False), (2, 1.0, False), (2, 3, True), (2, 4, False)],
)
def test_gradients_during_fit_validation_are_what_lightning_holds(accumulate, val_check_interval, kept):
    """Lightning frees the gradients before it validates at an optimizer step's end
    (`on_validation_model_zero_grad`); mid-accumulation it keeps them. The pre-flight's rule says so."""
    net = Net(SMALL)
    callback = _callback()
    trainer = _trainer(
        callback, accumulate_grad_batches=accumulate, val_check_interval=val_check_interval,
        limit_train_batches=8, num_sanity_val_steps=1,
    )  # fmt: skip
    trainer.fit(net)
    after_steps = [grads for sanity, grads, state in net.resident if not sanity]
    assert after_steps and all(state for sanity, _, state in net.resident if not sanity)
    assert any(after_steps) == kept
    assert gradients_kept_in_fit(trainer, net) == kept
    line = next(r for r in callback.plan.reasons if r.startswith("validation step"))
    assert ("gradients" in line) == kept


# ---------------------------------------------------------------------------------------------------
# DDP: the ranks agree


DDP_SCRIPT = """
import json, os, sys
from pathlib import Path
import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from resource_guard.frontdoors.lightning.callback import ResourceGuard

OUT, RANK = Path(sys.argv[1]), int(os.environ.get("LOCAL_RANK", "0"))

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 2000))
        self.calls = 0
    def _loss(self, b):
        if self._trainer is not None:
            self.calls += 1
        return nn.functional.cross_entropy(self.net(b[0].reshape(-1, 64)), b[1].reshape(-1))
    def training_step(self, b, i):
        return self._loss(b)
    def validation_step(self, b, i):
        self._loss(b)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
    def _data(self, rows, size):
        data = TensorDataset(torch.randn(rows, 64), torch.randint(0, 2000, (rows,)))
        return DataLoader(data, batch_size=size)
    def train_dataloader(self):
        return self._data(64, 8)
    def val_dataloader(self):  # rank 1's evaluation rows (5000 samples each) are each too big for the cap
        if RANK == 1:
            data = TensorDataset(torch.randn(8, 5000, 64), torch.randint(0, 2000, (8, 5000)))
            return DataLoader(data, batch_size=4)
        return self._data(64, 64)

net = Net()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                    callbacks=[ResourceGuard(memory_limit="20MiB", precision="32-true", monitor=False)],
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
result = {"rank": RANK}
try:
    trainer.fit(net)
except Exception as error:
    result.update(error_type=type(error).__name__, error=str(error))
result["calls"] = net.calls
(OUT / f".rank{RANK}.part").write_text(json.dumps(result))
(OUT / f".rank{RANK}.part").replace(OUT / f"rank{RANK}.json")
"""


@pytest.mark.slow
def test_ddp_ranks_stop_together_when_one_ranks_validation_does_not_fit(tmp_path):
    from lightning_ddp_launch import run_lightning_ddp

    _, _, ranks = run_lightning_ddp(tmp_path, DDP_SCRIPT)
    r0, r1 = ranks
    assert r0["error_type"] == r1["error_type"] == "DoesNotFitError"
    assert r0["error"] == r1["error"] and "pre-flight failed on rank 1" in r0["error"]
    assert "validation step does not fit: batch size 4" in r0["error"]
    assert "Not even batch size 1" in r0["error"]
    assert r0["calls"] == r1["calls"] == 0, "no training or validation step on any rank"
