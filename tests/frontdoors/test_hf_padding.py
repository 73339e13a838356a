"""Dynamic padding, as transformers' text-classification script runs by default: `data_collator=None` and
a tokenizer as `processing_class`, so the Trainer pads each batch with `DataCollatorWithPadding`. The
pre-flight plans the batch the Trainer will make (that collator, the dataset's longest example), before
the Trainer exists (`plan_training_args`) and inside it (`ResourceGuardCallback`)."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from resource_guard.errors import ConfigurationError
from resource_guard.frontdoors.hf import step as hf_step
from resource_guard.frontdoors.hf.plan import plan_training_args
from resource_guard.frontdoors.hf.trainer import ResourceGuardCallback

VOCAB, LONGEST = 64, 40


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built here (no download), with a pad token, as a local tokenizer file is."""
    words = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    made = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    made.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=made, pad_token="[PAD]", unk_token="[UNK]")


def bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=2,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def sentences(rows: int = 24) -> datasets.Dataset:
    """Ragged sentences, tokenized as run_glue.py does (`padding=False`: the collator pads); row 13 is
    the longest, far from the first batch."""
    lengths = [3 + (5 * i) % 11 for i in range(rows)]
    lengths[13] = LONGEST
    raw = datasets.Dataset.from_dict(
        {
            "sentence": [
                " ".join(f"w{(i + j) % (VOCAB - 2)}" for j in range(n)) for i, n in enumerate(lengths)
            ],
            "label": [i % 2 for i in range(rows)],
        }
    )
    tok = tokenizer()
    return raw.map(lambda b: tok(b["sentence"], padding=False, truncation=True), batched=True)


def args(tmp_path: Path, **kwargs) -> TrainingArguments:
    base = {
        "use_cpu": True, "report_to": [], "save_strategy": "no", "max_steps": 3, "disable_tqdm": True,
        "per_device_train_batch_size": 4,
    }  # fmt: skip
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kwargs})


def test_the_trainers_collator_is_chosen_as_the_trainer_chooses_it():
    assert isinstance(hf_step.trainer_collator(tokenizer()), DataCollatorWithPadding)
    from transformers import default_data_collator

    assert hf_step.trainer_collator(None) is default_data_collator
    model, data, tok = bert(), sentences(), tokenizer()
    trainer = Trainer(model=model, args=TrainingArguments("unused", use_cpu=True, report_to=[]),
                      train_dataset=data, processing_class=tok)  # fmt: skip
    assert type(trainer.data_collator) is type(hf_step.trainer_collator(tok))


def test_plan_training_args_pads_as_the_trainer_and_plans_the_longest_example(tmp_path):
    model, data = bert(), sentences()
    planned, made = plan_training_args(
        model, args(tmp_path), data, None, processing_class=tokenizer(), memory_limit="2GiB",
        verbose=False, return_plan=True,
    )  # fmt: skip
    assert made.estimate.method == "traced"
    assert any("longest example, row 13" in r and f"{LONGEST} input_ids" in r for r in made.reasons)
    assert planned.per_device_train_batch_size * planned.gradient_accumulation_steps == 4
    # the same plan as with the collator given explicitly, and bigger than the first batch's
    _, explicit = plan_training_args(
        model, args(tmp_path), data, DataCollatorWithPadding(tokenizer()), memory_limit="2GiB",
        verbose=False, return_plan=True,
    )  # fmt: skip
    assert explicit.estimate.peak_bytes == made.estimate.peak_bytes
    first = hf_step.sample_batch(data, DataCollatorWithPadding(tokenizer()), 4, "cpu", model=model)
    assert first["input_ids"].shape[1] < LONGEST


def test_ragged_rows_without_a_padding_collator_name_the_processing_class(tmp_path):
    with pytest.raises(ConfigurationError, match="processing_class="):
        plan_training_args(bert(), args(tmp_path), sentences(), memory_limit="2GiB", verbose=False)


@pytest.mark.parametrize("sampling", ["random", "group_by_length"])
def test_the_callback_plans_the_trainers_padded_batches(tmp_path, sampling):
    guard = ResourceGuardCallback(memory_limit="2GiB", monitor=False, verbose=False)
    trainer = Trainer(
        model=bert(), args=args(tmp_path, train_sampling_strategy=sampling), train_dataset=sentences(),
        processing_class=tokenizer(), callbacks=[guard],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 3
    assert guard.plan is not None and guard.plan.estimate.method == "traced"
    assert any("longest example, row 13" in r for r in guard.plan.reasons), guard.plan.reasons
    assert guard.shape_stats is not None and guard.shape_stats["stops"] == 0


class WeightedTrainer(Trainer):
    """A Trainer subclass with its own loss, as the docs' "customize the Trainer" recipe writes it."""

    calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        WeightedTrainer.calls += 1
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        weight = torch.tensor([1.0, 3.0], device=outputs.logits.device)
        loss = torch.nn.functional.cross_entropy(outputs.logits, labels, weight=weight)
        return (loss, outputs) if return_outputs else loss


def test_attach_reads_the_trainers_own_loss(tmp_path):
    trainer = WeightedTrainer(model=bert(), args=args(tmp_path), train_dataset=sentences(),
                              processing_class=tokenizer())  # fmt: skip
    guard = ResourceGuardCallback.attach(trainer, memory_limit="2GiB", monitor=False, verbose=False)
    assert guard in trainer.callback_handler.callbacks and guard.loss_fn is not None
    WeightedTrainer.calls = 0
    trainer.train()
    assert trainer.state.global_step == 3
    assert guard.plan is not None and guard.plan.estimate.method == "traced"
    assert WeightedTrainer.calls > 3  # the pre-flight traced the subclass's loss, beside the 3 real steps
    with pytest.raises(ConfigurationError, match="must be a transformers Trainer"):
        ResourceGuardCallback.attach(object())


def test_attach_reads_the_trainers_compute_loss_func(tmp_path):
    seen: list[int] = []

    def compute_loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(1)
        return torch.nn.functional.cross_entropy(outputs.logits, labels)

    trainer = Trainer(model=bert(), args=args(tmp_path), train_dataset=sentences(),
                      processing_class=tokenizer(), compute_loss_func=compute_loss_func)  # fmt: skip
    guard = ResourceGuardCallback.attach(trainer, memory_limit="2GiB", monitor=False, verbose=False)
    assert guard.compute_loss_func is compute_loss_func
    trainer.train()
    assert guard.plan is not None and guard.plan.estimate.method == "traced" and len(seen) > 3
