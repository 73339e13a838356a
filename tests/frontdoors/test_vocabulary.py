"""One vocabulary across the doors: `guard`, the Lightning `ResourceGuard` and the Trainer's
`ResourceGuardCallback` take `memory_limit`, `precision`, `target_batch_size`, `max_seq_len`, `log_dir`,
`profile` and `monitor` with one meaning, and accept or refuse each value in the same words."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from resource_guard import guard
from resource_guard.errors import ConfigurationError
from resource_guard.frontdoors.hf.trainer import ResourceGuardCallback
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.frontdoors.vocabulary import SHARED
from resource_guard.observe.profiling import ProfileWindow

DOORS = {
    "guard": lambda **kw: guard(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1), **kw),
    "ResourceGuard": lambda **kw: ResourceGuard(**kw),
    "ResourceGuardCallback": lambda **kw: ResourceGuardCallback(**kw),
}

BAD = [
    ("memory_limit", "lots"),
    ("memory_limit", -5),
    ("precision", "fp8"),
    ("precision", 3.5),
    ("target_batch_size", 0),
    ("target_batch_size", 2.5),
    ("max_seq_len", 0),
    ("log_dir", 3),
    ("profile", 3),
    ("monitor", "yes"),
]


def refusal(door: str, name: str, value) -> str:
    with pytest.raises(ConfigurationError) as info:
        DOORS[door](**{name: value})
    return str(info.value)


@pytest.mark.parametrize(("name", "value"), BAD)
def test_every_door_refuses_a_bad_shared_setting_in_the_same_words(name, value):
    words = {door: refusal(door, name, value).replace(f"`{door}(", "`DOOR(") for door in DOORS}
    assert f"`DOOR({name}={value!r})`" in words["guard"], words
    if name == "precision":  # the Trainer's arguments express three: the list differs, not the words
        head = f"`DOOR(precision={value!r})` must be None (keep the run's precision), 'auto' or one of"
        assert all(w.startswith(head) for w in words.values()), words
    else:
        assert len(set(words.values())) == 1, words


@pytest.mark.parametrize("door", DOORS)
def test_every_door_accepts_the_same_good_values(door, tmp_path):
    for value in (None, "auto", "32-true", "bf16-mixed", "bf16"):
        DOORS[door](precision=value)
    DOORS[door](memory_limit="6GiB", target_batch_size=8, max_seq_len=128, log_dir=tmp_path,
                profile=ProfileWindow(), monitor=False)  # fmt: skip
    assert set(SHARED) <= set(ResourceGuard.__init__.__code__.co_varnames)
    assert set(SHARED) <= set(ResourceGuardCallback.__init__.__code__.co_varnames)


def tiny_gpt2() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))


def build(tmp_path, callback, **kwargs) -> Trainer:
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, **kwargs)  # fmt: skip
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}] * 8
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=data, callbacks=[callback])


def test_the_trainer_callback_accepts_what_the_trainer_runs_and_refuses_what_it_cannot_change(tmp_path):
    build(tmp_path, ResourceGuardCallback(precision="32-true", target_batch_size=8, monitor=False))
    with pytest.raises(
        ConfigurationError, match=r"precision='auto'\)`: the Trainer's precision .*plan_training_args"
    ):
        build(tmp_path, ResourceGuardCallback(precision="auto"))
    with pytest.raises(ConfigurationError, match=r"precision='bf16-mixed'\)` is not the TrainingArguments'"):
        build(tmp_path, ResourceGuardCallback(precision="bf16"))
    with pytest.raises(ConfigurationError, match=r"= 8; .*target_batch_size=16\)"):
        build(tmp_path, ResourceGuardCallback(target_batch_size=16))
    unwritable = tmp_path / "file"
    unwritable.write_text("")
    with pytest.raises(ConfigurationError, match=r"ResourceGuardCallback\(log_dir=.*not writable"):
        build(tmp_path, ResourceGuardCallback(log_dir=unwritable / "sub"))
