"""The Trainer door's phase timing: a real ``Trainer.train`` split by phase, evaluation and checkpoints
every few steps named as such (never data wait), the loader's ``__next__`` timed as the data wait, and
everything put back. If the Trainer stops iterating the loader it shows its callbacks, the data-wait test
fails loudly."""

from __future__ import annotations

import doctest
import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from resource_guard.frontdoors.hf import phases as hf_phases
from resource_guard.frontdoors.hf.phases import TrainerPhases, time_loader_next
from resource_guard.frontdoors.hf.trainer import ResourceGuardCallback
from resource_guard.observe.phases import PhaseClock

VOCAB = 64
PAUSE_S = 0.2  # large against a few-millisecond step, also on a loaded machine


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def _rows(count: int, length: int = 16) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": (torch.arange(length) * (1 + i % 3)) % VOCAB} for i in range(count)]


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count: int, wait_s: float = 0.0) -> None:
        self.rows, self.wait_s = _rows(count), wait_s

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(self.wait_s)
        row = self.rows[i]
        return {"input_ids": row["input_ids"], "labels": row["input_ids"].clone()}


class SlowSaveTrainer(Trainer):
    """Saving a checkpoint takes PAUSE_S longer (``save_model`` is the Trainer's public save)."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        time.sleep(PAUSE_S)
        super().save_model(output_dir, _internal_call)


def _slow_metric(_prediction: object) -> dict[str, float]:
    time.sleep(PAUSE_S)
    return {"slow": 1.0}


def _args(tmp_path: Path, **kwargs: object) -> TrainingArguments:
    base: dict[str, object] = {
        "use_cpu": True, "report_to": [], "save_strategy": "no", "max_steps": 8, "logging_steps": 1,
        "disable_tqdm": True, "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2,
    }  # fmt: skip
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kwargs})  # type: ignore[arg-type]


def test_docstring_examples_run() -> None:
    assert doctest.testmod(hf_phases).failed == 0


def test_evaluation_and_checkpoints_every_few_steps_are_named_not_data_wait(tmp_path: Path) -> None:
    args = _args(
        tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        save_only_model=True,
    )  # fmt: skip
    guard = ResourceGuardCallback(memory_limit="1GiB", profile=False, verbose=False)
    trainer = SlowSaveTrainer(
        model=_gpt2(), args=args, train_dataset=_Rows(32), eval_dataset=_Rows(2),
        compute_metrics=_slow_metric, callbacks=[guard],
    )  # fmt: skip
    trainer.train()
    s = guard.report.stats
    assert s.phases is not None and s.step_time_s is not None
    assert sum(s.phases.values()) == pytest.approx(s.step_time_s, rel=1e-6)
    # four evaluations and four saves of >= PAUSE_S each over 8 steps (the first one left out): at least
    # 3 PAUSE_S over 7 steps each
    assert s.phases["evaluation"] >= 3 * PAUSE_S / 7 and s.phases["checkpoint"] >= 3 * PAUSE_S / 7
    assert s.phases["forward"] > 0 and s.phases["backward"] > 0 and s.phases["optimizer"] > 0
    assert s.phases["logging"] > 0
    assert s.phases["data_wait"] < 0.1 * (s.phases["evaluation"] + s.phases["checkpoint"])
    ids = [f.id for f in guard.report.findings]
    assert "evaluation" in ids and "checkpoint-io" in ids and "input-bound" not in ids
    markdown = (tmp_path / "out" / "resource_guard" / "report.md").read_text()
    assert "evaluation" in markdown and "checkpoint" in markdown
    # everything put back: the loader's class, the optimizer's hooks
    assert guard._run.phases is None
    assert type(trainer.callback_handler.train_dataloader.base_dataloader) is torch.utils.data.DataLoader
    assert not trainer.optimizer.optimizer._optimizer_step_pre_hooks


def test_the_train_loaders_next_is_the_data_wait(tmp_path: Path) -> None:
    wait_s = 0.05  # per row: 100 ms a batch of 2, against tens of milliseconds of compute
    guard = ResourceGuardCallback(memory_limit="1GiB", profile=False, verbose=False)
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path), train_dataset=_Rows(32, wait_s), callbacks=[guard])
    trainer.train()
    s = guard.report.stats
    assert s.phases is not None and s.step_time_s is not None
    assert s.phases["data_wait"] >= 0.8 * 2 * wait_s  # the Trainer iterated the loader it showed us
    assert guard.report.finding("input-bound") is not None


def test_phases_from_the_events_with_a_fake_clock() -> None:
    ticks = iter(float(t) for t in range(100))
    clock = PhaseClock(now=0.0, clock=lambda: next(ticks))
    phases = TrainerPhases(clock)
    phases.forward_start(True)  # 1
    phases.forward_end(True)  # 2: forward 1 s
    phases.optimizer_start()  # 3: backward 1 s
    phases.step_end()  # 4: optimizer 1 s
    phases.logged()  # 5: logging 1 s
    phases.forward_start(False)  # 6: evaluation began at on_log (its loader's first batch)
    phases.forward_start(False)  # (no clock read) a second eval batch
    phases.logged()  # (no clock read) the evaluation's metrics log is evaluation
    phases.evaluated()  # 7: evaluation 2 s in all (5 -> 7)
    phases.saved()  # 8: checkpoint 1 s
    totals = clock.take(10.0)  # host from 7 to 10 (the ticks start at 0: each comment is one later)
    assert totals["forward"] == totals["backward"] == totals["optimizer"] == 1.0
    assert totals["logging"] == 1.0 and totals["evaluation"] == 2.0 and totals["checkpoint"] == 1.0
    assert totals["data_wait"] == 0.0 and totals["host"] == 3.0


def test_a_loader_that_cannot_be_wrapped_is_left_alone() -> None:
    clock = PhaseClock()
    assert time_loader_next([1, 2, 3], clock) is None  # a list: no instance dict
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    undo = time_loader_next(loader, clock)
    assert undo is not None and time_loader_next(loader, clock) is None  # not twice
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert clock.take(clock._mark + 0.0)["data_wait"] >= 0.0
    undo()
    undo()
    assert type(loader) is torch.utils.data.DataLoader
