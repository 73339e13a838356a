"""Evaluation loaders whose batches do not fit run as micro-batches that do (issue 28): validation and
test metrics logged per epoch, and the predictions (one per loader batch), equal those of the unsplit
run on uncapped memory; no evaluation batch above the cap runs; a cap below one row still stops."""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from resource_guard import DoesNotFitError, ResourceGuardWarning
from resource_guard.devices import resolve_device
from resource_guard.estimate.eval_step import estimate_eval_memory
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.frontdoors.lightning.eval_split import EvalSplitLoader, EvalSplitSampler, regroup

DIM, TRAIN, EVAL = 256, 32, 1024
ROWS = 2 * EVAL + 300  # the last evaluation batch (300 rows) is smaller: the epoch mean weights it less
HEADROOM = 0.1


class MLP(L.LightningModule):
    """Records the rows of each evaluation step that runs (not the pre-flight's traces)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(DIM, DIM), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(DIM, 1))
        self.eval_rows: list[int] = []

    def _seen(self, x: torch.Tensor) -> None:
        if self._trainer is not None:
            self.eval_rows.append(x.shape[0])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self._seen(x)
        out = self.net(x)
        self.log("val_loss", nn.functional.mse_loss(out, y), on_epoch=True)
        self.log("val_mean", out.mean(), on_epoch=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self._seen(x)
        self.log("test_loss", nn.functional.l1_loss(self.net(x), y), on_epoch=True)

    def predict_step(self, batch, batch_idx):
        x = batch[0]
        self._seen(x)
        out = self.net(x)
        return {"out": out, "pair": (out * 2, x[:, :3])}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data(rows: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(rows, DIM, generator=g), torch.randn(rows, 1, generator=g))


def _eval_loader() -> DataLoader:
    return DataLoader(_data(ROWS, 1), batch_size=EVAL)


@pytest.fixture(scope="module")
def cap() -> int:
    """A memory cap between the evaluation step's peaks at EVAL // 2 and EVAL rows (derived)."""
    cpu = resolve_device("cpu")
    batch = _data(EVAL, 1)[:]

    def peak(n: int) -> int:
        step = lambda m, b: nn.functional.mse_loss(m.net(b[0]), b[1])  # noqa: E731
        est = estimate_eval_memory(MLP(), (batch[0][:n], batch[1][:n]), step)
        return est.for_device(cpu, headroom=HEADROOM).device_total_bytes

    low, high = peak(EVAL // 2), peak(EVAL)
    assert low < high
    return int((low + high) / 2 / (1 - HEADROOM))


def _trainer(*callbacks, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(callbacks=list(callbacks), **(options | kwargs))


def _guard(memory_limit: int) -> ResourceGuard:
    # fp32 as the uncapped reference runs (and the cap is derived): precision="auto" is bf16-mixed on a
    # CPU with native bf16, whose results differ from the reference's beyond fp32 tolerance
    return ResourceGuard(memory_limit=memory_limit, headroom=HEADROOM, precision="32-true", monitor=False)


def _evaluate(trainer: L.Trainer, net: MLP, loader_fn=_eval_loader) -> tuple[dict, dict, list]:
    val = trainer.validate(net, loader_fn(), verbose=False)[0]
    test = trainer.test(net, loader_fn(), verbose=False)[0]
    predictions = trainer.predict(net, loader_fn())
    return val, test, predictions


def test_validate_test_predict_split_equal_the_unsplit_run(cap):
    expected = _evaluate(_trainer(), MLP())
    net = MLP()
    guard = _guard(cap)
    trainer = _trainer(guard)
    got = _evaluate(trainer, net)

    assert net.eval_rows and max(net.eval_rows) < EVAL  # split: no batch of EVAL rows ran
    assert sum(net.eval_rows) == 3 * ROWS  # every row once, in each of validate, test and predict
    torch.testing.assert_close(got[0], expected[0])  # the epoch means of uneven pieces and batches
    torch.testing.assert_close(got[1], expected[1])
    assert len(got[2]) == len(_eval_loader()) == len(expected[2])  # one prediction per loader batch
    torch.testing.assert_close(got[2], expected[2])
    assert [p["out"].shape[0] for p in got[2]] == [EVAL, EVAL, ROWS - 2 * EVAL]
    # the largest fitting batch the pre-flight named bounds every piece, and the reason is given
    sizes = [c.largest_fitting_batch_size for c in guard._evals.checks if not c.fits]
    assert sizes and max(net.eval_rows) <= min(sizes)
    assert any("runs as micro-batches of at most" in n for n in guard._eval_notes)
    # a second validate on the same Trainer (its pre-flight already done) is split again
    net.eval_rows.clear()
    again = trainer.validate(net, _eval_loader(), verbose=False)[0]
    assert max(net.eval_rows) < EVAL and sum(net.eval_rows) == ROWS
    torch.testing.assert_close(again, expected[0])


def test_fit_validation_split_equals_the_unsplit_run(cap):
    train = lambda: DataLoader(_data(4 * TRAIN, 0), batch_size=TRAIN)  # noqa: E731
    plain, capped = MLP(), MLP()
    reference = _trainer(max_epochs=2)
    reference.fit(plain, train(), _eval_loader())
    trainer = _trainer(_guard(cap), max_epochs=2, num_sanity_val_steps=1)
    trainer.fit(capped, train(), _eval_loader())

    assert capped.eval_rows and max(capped.eval_rows) < EVAL
    # two validations of every row, plus one sanity-check micro-batch
    assert sum(capped.eval_rows) == 2 * ROWS + capped.eval_rows[0]
    for name in ("val_loss", "val_mean"):
        torch.testing.assert_close(trainer.callback_metrics[name], reference.callback_metrics[name])
    for a, b in zip(plain.parameters(), capped.parameters(), strict=True):
        torch.testing.assert_close(a, b)


class ReadyBatches(IterableDataset):
    """Ready-made batches (no batch sampler to split): cut along dim 0."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = _data(ROWS, 1)[:]
        for lo in range(0, ROWS, EVAL):
            yield x[lo : lo + EVAL], y[lo : lo + EVAL]


def test_ready_batches_are_cut_along_dim_0(cap):
    ready = lambda: DataLoader(ReadyBatches(), batch_size=None)  # noqa: E731
    expected = _evaluate(_trainer(), MLP(), ready)
    net = MLP()
    got = _evaluate(_trainer(_guard(cap)), net, ready)
    assert net.eval_rows and max(net.eval_rows) < EVAL and sum(net.eval_rows) == 3 * ROWS
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    assert len(got[2]) == 3
    torch.testing.assert_close(got[2], expected[2])
    # an integer limit counts loader batches: the first batch, all of its micro-batches
    first, limited = MLP(), MLP()
    want = _trainer(limit_val_batches=1).validate(first, ready(), verbose=False)
    have = _trainer(_guard(cap), limit_val_batches=1).validate(limited, ready(), verbose=False)
    assert sum(limited.eval_rows) == EVAL and len(limited.eval_rows) > 1
    torch.testing.assert_close(have, want)


def test_a_cap_below_one_row_still_stops():
    net = MLP()
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    with pytest.raises(DoesNotFitError, match="Not even batch size 1 fits"):
        _trainer(_guard(params)).predict(net, _eval_loader())
    assert net.eval_rows == []


def test_split_sampler_pieces_are_at_most_the_micro_batch_and_counted():
    from torch.utils.data import BatchSampler, SequentialSampler

    batches = BatchSampler(SequentialSampler(range(23)), batch_size=10, drop_last=False)
    sampler = EvalSplitSampler(batches, micro_batch_size=4)
    pieces = list(sampler)
    assert [len(p) for p in pieces] == [4, 3, 3, 4, 3, 3, 3]
    assert sum(pieces, []) == list(range(23)) and sampler.counts == [3, 3, 1] and len(sampler) == 7
    odd = EvalSplitSampler([[0, 1, 2], [3, 4, 5, 6, 7]], micro_batch_size=2)  # not a BatchSampler
    assert len(odd) == len(list(odd)) == 5
    loader = EvalSplitLoader(DataLoader(TensorDataset(torch.arange(23)), batch_size=10), 4)
    assert len(loader) == 7 and [b[0].shape[0] for b in loader] == [4, 3, 3, 4, 3, 3, 3]


def test_regroup_joins_tensors_containers_and_row_lists():
    a, b = torch.arange(6).view(3, 2), torch.arange(6, 10).view(2, 2)
    torch.testing.assert_close(regroup([a, b]), torch.cat([a, b]))
    joined = regroup([{"t": (a, [a]), "ids": ["x"] * 3}, {"t": (b, [b]), "ids": ["y"] * 2}])
    torch.testing.assert_close(joined["t"][0], torch.cat([a, b]))
    torch.testing.assert_close(joined["t"][1][0], torch.cat([a, b]))
    assert joined["ids"] == ["x"] * 3 + ["y"] * 2
    with pytest.warns(ResourceGuardWarning, match="cannot be joined"):
        assert regroup([1.0, 2.0]) == [1.0, 2.0]


def test_an_epoch_prediction_writer_after_the_callback_gets_one_prediction_per_batch(cap):
    from lightning.pytorch.callbacks import BasePredictionWriter

    class Writer(BasePredictionWriter):
        def __init__(self) -> None:
            super().__init__(write_interval="epoch")
            self.written: list = []

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            self.written = list(predictions)

    writer, net = Writer(), MLP()
    returned = _trainer(_guard(cap), writer).predict(net, _eval_loader())
    assert max(net.eval_rows) < EVAL  # split
    assert len(writer.written) == len(returned) == len(_eval_loader())
    torch.testing.assert_close(writer.written, returned)
