"""Re-batching the train loader in a Lightning run (issue 28): every everyday form of train data runs at
the plan's micro-batch under a memory cap that forces a split, and trains exactly as the same run at
the full batch on uncapped memory."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
)
from transformers import BatchEncoding

from resource_guard import estimate_memory
from resource_guard.errors import ConfigurationError
from resource_guard.frontdoors.lightning import apply as ap
from resource_guard.frontdoors.lightning import internals as li
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.frontdoors.lightning.rebatch import LossWeights, SplitBatchSampler, parts_for

DIM = 32
BATCH = 256
ROWS = 2 * BATCH + 101  # the epoch's last batch (101 rows) splits unevenly: 51 + 50
EPOCHS = 2


class MLP(L.LightningModule):
    """Activation-dominated, so a cap between the peaks at 128 and 256 rows forces micro-batch 128.
    Records what each training step saw."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(6):
            layers += [nn.Linear(DIM, DIM), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(DIM, 1))
        self.seen: list[int] = []
        self.ids: list[list[str]] = []
        self.types: set[type] = set()

    def training_step(self, batch, batch_idx):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, Mapping) else batch
        if self._trainer is not None:  # not while the plan traces a detached copy
            self.seen.append(x.shape[0])
            self.types.add(type(batch))
            if isinstance(batch, Mapping) and "ids" in batch:
                self.ids.append(list(batch["ids"]))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)  # plain SGD: a mis-weighted gradient shows


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, 1, generator=g)


@pytest.fixture(scope="module")
def cap() -> int:
    """A memory cap between the step's peak at BATCH // 2 and at BATCH rows (derived, not hard-coded)."""
    x, y = data()
    peaks = [
        estimate_memory(
            MLP(), lambda p: torch.optim.SGD(p, lr=0.05), (x[:n], y[:n]), lambda m, b: m.training_step(b, 0)
        ).peak_bytes
        for n in (BATCH // 2, BATCH)
    ]
    assert peaks[0] < peaks[1]
    return sum(peaks) // 2


# ---------------------------------------------------------------------------------------------------
# the forms of train data


class Rows(IterableDataset):
    """An iterable dataset of single rows (the DataLoader collates them)."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = data()
        yield from zip(x, y)


class Encodings(IterableDataset):
    """An iterable dataset of ready-made HF `BatchEncoding` batches (the DataLoader does not batch)."""

    def __iter__(self) -> Iterator[BatchEncoding]:
        x, y = data()
        for i in range(0, ROWS, BATCH):
            yield BatchEncoding({"x": x[i : i + BATCH], "y": y[i : i + BATCH]})


class Shuffled(Sampler[list[int]]):
    """A user's batch sampler (not a `BatchSampler`): shuffled batches of BATCH indices, seeded from the
    global RNG as `RandomSampler` is."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n).tolist()
        for i in range(0, self.n, BATCH):
            yield order[i : i + BATCH]

    def __len__(self) -> int:
        return -(-self.n // BATCH)


def to_dict(rows):
    return {
        "x": torch.stack([r[0] for r in rows]),
        "y": torch.stack([r[1] for r in rows]),
        "ids": [f"row{float(r[1]):.4f}" for r in rows],  # a per-row list of strings
    }


class NoBatchSize(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*data()), batch_size=BATCH, shuffle=True)


def form(name: str):
    """``(fit's keyword arguments)`` for one form of train data, made fresh."""
    ds = TensorDataset(*data())
    if name == "loader passed to fit":
        return {"train_dataloaders": DataLoader(ds, batch_size=BATCH, shuffle=True)}
    if name == "datamodule without batch_size":
        return {"datamodule": NoBatchSize()}
    if name == "batch_sampler":
        return {"train_dataloaders": DataLoader(ds, batch_sampler=Shuffled(ROWS))}
    if name == "IterableDataset":
        return {"train_dataloaders": DataLoader(Rows(), batch_size=BATCH)}
    if name == "dict batches, custom collate":
        return {"train_dataloaders": DataLoader(ds, batch_size=BATCH, shuffle=True, collate_fn=to_dict)}
    if name == "BatchEncoding":
        return {"train_dataloaders": DataLoader(Encodings(), batch_size=None)}
    if name == "loader with workers":  # the sampler runs ahead of the batches: weights stay in order
        loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)
        return {"train_dataloaders": loader}
    if name == "sequential loader":
        return {"train_dataloaders": DataLoader(ds, batch_size=BATCH)}
    raise AssertionError(name)


FORMS = (
    "loader passed to fit",
    "datamodule without batch_size",
    "batch_sampler",
    "IterableDataset",
    "dict batches, custom collate",
    "BatchEncoding",
    pytest.param("loader with workers", marks=pytest.mark.slow),
)


def fit(
    name: str, guard: ResourceGuard | None, ckpt_path: str | None = None, callbacks=(), **options
) -> tuple[MLP, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = MLP()
    settings = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    settings.update(options)
    trainer = L.Trainer(callbacks=[*([guard] if guard else []), *callbacks], **settings)
    trainer.fit(model, ckpt_path=ckpt_path, **form(name))
    return model, trainer


def capped(cap: int, **kwargs) -> ResourceGuard:
    return ResourceGuard(
        memory_limit=cap, headroom=0.0, precision="32-true", checkpointing=False, monitor=False, **kwargs
    )


@pytest.mark.parametrize("name", FORMS)
def test_every_form_runs_at_the_plans_micro_batch_and_trains_as_the_full_batch(name, cap):
    full, full_trainer = fit(name, None)
    assert max(full.seen) == BATCH  # uncapped: whole loader batches

    guard = capped(cap)
    model, trainer = fit(name, guard)

    assert guard.decisions is not None
    micro = guard.decisions.micro_batch_size
    assert (micro, guard.decisions.accumulation_steps) == (BATCH // 2, 2)  # the cap forced a split
    assert max(model.seen) <= micro  # no batch above the cap ran
    assert sum(model.seen) == sum(full.seen) == ROWS * EPOCHS  # every sample, once per epoch
    assert len(model.seen) == 2 * len(full.seen)
    assert trainer.global_step == full_trainer.global_step == EPOCHS * 3  # one step per effective batch
    for mine, theirs in zip(model.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    # the Trainer is as the user made it again
    assert trainer.accumulate_grad_batches == 1
    assert not any(isinstance(c, LossWeights) for c in trainer.callbacks)
    assert type(trainer.fit_loop._data_source).__name__ == "_DataLoaderSource"
    if name == "dict batches, custom collate":
        assert [len(ids) for ids in model.ids] == model.seen  # collate ran per micro-batch
        assert sorted(i for ids in model.ids for i in ids) == sorted(i for ids in full.ids for i in ids)
    if name == "BatchEncoding":
        assert model.types == {BatchEncoding}


def test_a_batch_size_attribute_the_loader_ignores_falls_back_to_re_batching(cap):
    class Ignores(NoBatchSize):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = BATCH  # read by nothing: train_dataloader() has its own

    data_module = Ignores()
    guard = capped(cap)
    L.seed_everything(0, verbose=False)
    model = MLP()
    trainer = L.Trainer(
        callbacks=[guard], accelerator="cpu", devices=1, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data_module)
    assert guard.decisions is not None and max(model.seen) == guard.decisions.micro_batch_size == BATCH // 2
    assert data_module.batch_size == BATCH  # set, found ignored, put back


def test_a_cap_that_fits_the_loader_batch_changes_nothing(cap):
    guard = capped(cap * 4)
    model, trainer = fit("loader passed to fit", guard)
    assert guard.decisions is not None and guard.decisions.micro_batch_size == BATCH
    assert max(model.seen) == BATCH and trainer.global_step == EPOCHS * 3


def test_limit_train_batches_counts_loader_batches(cap):
    guard = capped(cap)
    model, trainer = fit("loader passed to fit", guard, limit_train_batches=2, max_epochs=1)
    assert model.seen == [BATCH // 2] * 4  # two loader batches, as micro-batches
    assert trainer.global_step == 2
    assert trainer.limit_train_batches == 2  # put back


def test_monitor_counts_optimizer_steps_as_global_step(cap, tmp_path):
    guard = ResourceGuard(
        memory_limit=cap,
        headroom=0.0,
        precision="32-true",
        checkpointing=False,
        profile=False,
        log_dir=tmp_path,
    )
    model, trainer = fit("IterableDataset", guard, max_epochs=1)
    assert guard.report is not None
    # six micro-batches, two a step: the report's steps are the optimizer's, Lightning's global_step
    assert len(model.seen) == 6
    assert guard.report.stats.steps == trainer.global_step == 3


@pytest.mark.slow
def test_resume_restores_the_same_split(cap, tmp_path):
    straight, _ = fit("sequential loader", capped(cap))
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit("sequential loader", capped(cap), max_epochs=1, enable_checkpointing=True, callbacks=[saving])
    guard = capped(cap)
    model, trainer = fit("sequential loader", guard, ckpt_path=str(tmp_path / "last.ckpt"))
    assert guard.plan is None  # the stored decisions, re-applied without planning
    assert guard.decisions is not None and guard.decisions.micro_batch_size == BATCH // 2
    assert max(model.seen) == BATCH // 2 and sum(model.seen) == ROWS  # the second epoch, split
    assert trainer.global_step == EPOCHS * 3
    for mine, theirs in zip(model.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_refusals_name_the_remedy():
    class Auto:
        automatic_optimization = True

    class Manual:
        automatic_optimization = False

    def decisions(micro: int, acc: int) -> ap.Decisions:
        return ap.Decisions(micro, acc, "32-true", False, micro * acc, 1)

    assert parts_for(Auto(), 256, decisions(64, 4)) == 4
    assert parts_for(Auto(), 256, decisions(64, 8)) == 4  # a target of two loader batches
    with pytest.raises(ConfigurationError, match="whole micro-batches of 96"):
        parts_for(Auto(), 256, decisions(96, 2))
    with pytest.raises(ConfigurationError, match="whole micro-batches of 512"):
        parts_for(Auto(), 256, decisions(512, 1))
    with pytest.raises(ConfigurationError, match="not a multiple"):
        parts_for(Auto(), 256, decisions(64, 6))
    with pytest.raises(ConfigurationError, match="cannot be told"):
        parts_for(Auto(), None, decisions(64, 4))
    with pytest.raises(ConfigurationError, match="manual optimization"):
        parts_for(Manual(), 256, decisions(64, 4))


def test_a_batch_that_cannot_be_split_names_the_leaf(cap):
    class Ragged(IterableDataset):
        def __iter__(self):
            x, y = data()
            for i in range(0, ROWS, BATCH):  # the second batch's mask is not per row
                mask = torch.ones(7 if i else min(BATCH, ROWS - i))
                yield {"x": x[i : i + BATCH], "y": y[i : i + BATCH], "mask": mask}

    guard = capped(cap)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        callbacks=[guard], accelerator="cpu", devices=1, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"batch\['mask'\] has 7"):
        trainer.fit(MLP(), DataLoader(Ragged(), batch_size=None))


# ---------------------------------------------------------------------------------------------------
# the batch sampler


@given(
    rows=st.integers(1, 300),
    batch=st.integers(1, 64),
    parts=st.integers(1, 8),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
)
def test_split_batch_sampler_keeps_order_and_its_length_is_exact(rows, batch, parts, drop_last, shuffle):
    sampler = RandomSampler(range(rows)) if shuffle else SequentialSampler(range(rows))
    inner = BatchSampler(sampler, batch, drop_last)
    torch.manual_seed(0)
    want = list(inner)
    split = SplitBatchSampler(inner, parts)
    torch.manual_seed(0)
    got = list(split)
    assert len(got) == len(split)
    assert [i for piece in got for i in piece] == [i for b in want for i in b]  # same samples, same order
    weights, at = list(split.pieces), 0
    for b in want:
        pieces = got[at : at + min(parts, len(b))]
        assert max(len(p) for p in pieces) - min(len(p) for p in pieces) <= 1  # near-equal
        assert sum(len(p) for p in pieces) == len(b)
        for w, p in zip(weights[at : at + len(pieces)], pieces, strict=True):
            # Lightning divides each loss by `parts`: weighted, each piece counts its share of the batch
            assert w / parts == pytest.approx(len(p) / len(b))
        at += len(pieces)
    assert at == len(got)


def test_split_batch_sampler_exposes_the_sampler_for_set_epoch():
    inner = BatchSampler(RandomSampler(range(10)), 4, False)
    split = SplitBatchSampler(inner, 2)
    assert split.sampler is inner.sampler
    with pytest.raises(ConfigurationError, match="parts=0"):
        SplitBatchSampler(inner, 0)


def test_lightning_internals_of_rebatching_are_where_we_expect():
    """Fails loudly when a Lightning release moves what lightning_rebatch relies on."""
    assert {"transform_train_source", "process_train_loader"} <= set(li.LIGHTNING_INTERNALS)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    loader = DataLoader(TensorDataset(torch.zeros(4, DIM)))
    trainer.fit_loop._data_source.instance = loader
    original = trainer.fit_loop._data_source
    undo = li.transform_train_source(trainer, lambda got: ("seen", got))
    assert trainer.fit_loop._data_source.dataloader() == ("seen", loader)
    assert trainer.fit_loop._data_source.is_module() is False
    undo()
    assert trainer.fit_loop._data_source is original


@pytest.mark.slow
def test_the_docs_example_splits_a_loader_given_to_fit(capsys):
    text = (Path(__file__).resolve().parents[2] / "docs" / "lightning.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (example,) = [b for b in blocks if "batch_size=4096" in b]  # a loader given to fit that does not fit
    exec(compile(example, "docs/lightning.md", "exec"), {})
    assert capsys.readouterr().out.split()[-2:] == ["1024", "2"]


# ---------------------------------------------------------------------------------------------------
# a declared worst case: the split is chosen for the longest sequence before step 0

SEQ_ROWS, SEQ_BATCH, LONGEST = 150, 32, 64


class Tokens(L.LightningModule):
    """A token model whose loss is a mean over rows of each row's masked mean: padding-invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, DIM)
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(DIM, DIM), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(DIM, 1))
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        if self._trainer is not None:
            self.seen.append(tuple(batch["ids"].shape))
        h = self.net(self.emb(batch["ids"]))[..., 0]
        per_row = (h * batch["mask"]).sum(1) / batch["mask"].sum(1)
        return nn.functional.mse_loss(per_row, batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def sequences() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, LONGEST + 1, (SEQ_ROWS,), generator=g)
    return [(torch.randint(0, 100, (int(n),), generator=g), torch.randn((), generator=g)) for n in lengths]


class ByLength(Sampler[list[int]]):
    """Length buckets, shortest first: the first batch is far shorter than the longest."""

    def __init__(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(0, len(self.order), SEQ_BATCH):
            yield self.order[i : i + SEQ_BATCH]

    def __len__(self) -> int:
        return -(-len(self.order) // SEQ_BATCH)


def pad(rows):
    longest = max(len(r[0]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest)
    for i, (tokens, _) in enumerate(rows):
        ids[i, : len(tokens)], mask[i, : len(tokens)] = tokens, 1.0
    return {"ids": ids, "mask": mask, "y": torch.stack([r[1] for r in rows])}


@pytest.mark.slow
def test_a_declared_longest_sequence_chooses_the_split_before_step_zero():
    rows = sequences()

    def run(guard):
        L.seed_everything(0, verbose=False)
        model = Tokens()
        trainer = L.Trainer(
            callbacks=[guard] if guard else [], accelerator="cpu", devices=1, max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, DataLoader(rows, batch_sampler=ByLength(rows), collate_fn=pad))
        return model, trainer

    def peak(n: int) -> int:
        batch = pad(rows[:n])
        batch["ids"] = torch.randint(0, 100, (n, LONGEST))
        batch["mask"] = torch.ones(n, LONGEST)
        step = lambda m, b: m.training_step(b, 0)  # noqa: E731
        return estimate_memory(Tokens(), lambda p: torch.optim.SGD(p, lr=0.05), batch, step).peak_bytes

    full, full_trainer = run(None)
    assert full.seen[0][1] < LONGEST // 2  # the first batch is short: planning on it alone would not split
    guard = capped((peak(SEQ_BATCH // 2) + peak(SEQ_BATCH)) // 2, max_seq_len=LONGEST)
    model, trainer = run(guard)
    assert guard.decisions is not None and guard.decisions.micro_batch_size == SEQ_BATCH // 2
    assert max(rows for rows, _ in model.seen) <= SEQ_BATCH // 2
    assert sum(rows for rows, _ in model.seen) == SEQ_ROWS
    assert trainer.global_step == full_trainer.global_step
    for mine, theirs in zip(model.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
