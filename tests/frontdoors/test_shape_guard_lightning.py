"""The run-time shape guard of the Lightning ``ResourceGuard``: the same causal LM, 8×16 then 8×513.

Lightning cannot split a batch: the callback stops before the long batch with ``DoesNotFitError``, or
avoids it by planning for the run's largest batch when that is knowable (here a dataset attribute).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from resource_guard import DoesNotFitError, ResourceGuard
from resource_guard.frontdoors.shape_guard import ShapeReport
from shape_scenario import LONG, ROWS, SHORT, cap_between, tiny_gpt2, tokens

L = pytest.importorskip("lightning.pytorch")


class Lengths(Dataset):
    """Samples of ``lengths[i]`` tokens; batches of equal lengths when the batch size divides 8.

    ``declare``: the dataset has a length column (a ``lengths`` attribute), as bucketing datasets do.
    """

    def __init__(self, lengths: list[int], declare: bool = False) -> None:
        self._lengths = lengths
        if declare:
            self.lengths = torch.tensor(lengths)

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = tokens(1, self._lengths[i], seed=i)
        return {k: v[0] for k, v in row.items()}


class Data(L.LightningDataModule):
    def __init__(self, lengths: list[int], declare: bool = False) -> None:
        super().__init__()
        self.batch_size = ROWS
        self.dataset = Lengths(lengths, declare)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


class CausalLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_gpt2()
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self._trainer is not None:
            self.seen.append(tuple(batch["input_ids"].shape))
        return self.net(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(
    lengths: list[int], declare: bool = False, **kwargs: Any
) -> tuple[CausalLM, ResourceGuard, Any, BaseException | None]:
    guard = ResourceGuard(
        memory_limit=cap_between(), precision="32-true", checkpointing=False, monitor=False, profile=False,
        **kwargs,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, callbacks=[guard], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = CausalLM()
    try:
        trainer.fit(model, Data(lengths, declare))
    except DoesNotFitError as error:
        return model, guard, trainer, error
    return model, guard, trainer, None


@pytest.mark.slow  # real training steps at 8×513 (~10 s on 2 busy cores)
def test_the_callback_stops_before_a_batch_that_would_not_fit():
    model, guard, trainer, error = fit([SHORT] * 2 * ROWS + [LONG] * ROWS + [SHORT] * ROWS)
    assert error is not None, "stopped with DoesNotFitError"
    assert model.seen == [(ROWS, SHORT)] * 2 and trainer.global_step == 2, "the long batch never ran"
    assert guard._shapes.stops == 1
    message, report = str(error), error.report
    assert isinstance(report, ShapeReport)
    assert report.shape.shape == "8×513 int64, 8×513 int64" and not report.shape.fits
    assert report.shape.predicted_peak_bytes > report.shape.usable_bytes
    assert report.largest_fitting_shape == "8×16 int64, 8×16 int64"
    assert 1 <= report.shape.fitting_micro_batch_size < ROWS
    assert report.token_budget == report.shape.fitting_micro_batch_size * LONG
    assert "8×513" in message and "MiB per micro-batch" in message and "token-budget sampler" in message


@pytest.mark.slow  # real training steps at 8×513 (~10 s on 2 busy cores)
def test_a_longest_sequence_the_dataset_declares_is_planned_for_and_the_stop_avoided():
    model, guard, trainer, error = fit([SHORT] * 2 * ROWS + [LONG] * ROWS, declare=True)
    assert error is None
    d = guard.decisions
    assert d.micro_batch_size < ROWS and d.micro_batch_size * d.accumulation_steps == ROWS
    assert (d.micro_batch_size, LONG) in model.seen
    assert trainer.global_step == 3, "the same three optimizer steps, each of 8 samples"
    assert guard._shapes.stops == 0


def test_a_run_whose_shapes_all_fit_is_unchanged_under_the_callback():
    model, guard, trainer, error = fit([SHORT] * 3 * ROWS)
    assert error is None
    assert guard.decisions.micro_batch_size == ROWS and guard.decisions.accumulation_steps == 1
    assert model.seen == [(ROWS, SHORT)] * 3 and trainer.global_step == 3
    assert guard._shapes.model.traces == 0, "one shape, the plan's: every check a cache hit"
