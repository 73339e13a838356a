"""The Hugging Face Trainer door: plan_training_args, ResourceGuardCallback, the Trainer's step rebuilt.

Small GPT-2 and BERT models built from configs (no weights, no download), on the CPU, a few steps each.
"""

from __future__ import annotations

import dataclasses
import inspect
import runpy
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import resource_guard
from cpu_reference import skip_unless_cpu_runs
from resource_guard.devices import play_cpu
from resource_guard.errors import ConfigurationError, DoesNotFitError
from resource_guard.frontdoors.hf import runtime as hf_runtime
from resource_guard.frontdoors.hf import step as hf_step
from resource_guard.frontdoors.hf import trainer as hf_trainer
from resource_guard.frontdoors.hf.plan import plan_training_args
from resource_guard.frontdoors.hf.runtime import without_accelerate_autocast
from resource_guard.frontdoors.hf.trainer import ResourceGuardCallback

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, num_labels=3,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def lm_rows(count: int, length: int) -> list[dict[str, torch.Tensor]]:
    """Rows that repeat one short pattern each: a small model learns them in a few steps."""
    rows = []
    for i in range(count):
        ids = (torch.arange(length) * (1 + i % 3)) % VOCAB
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


CKPT = (
    "activation_checkpointing"
    if hasattr(TrainingArguments, "activation_checkpointing")
    else "gradient_checkpointing"
)


def targs(tmp_path: Path, **kwargs) -> TrainingArguments:
    base = {
        "use_cpu": True, "report_to": [], "save_strategy": "no", "max_steps": 3, "logging_steps": 1,
        "disable_tqdm": True, "learning_rate": 3e-3,
    }  # fmt: skip
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kwargs})


def peak_at(model, args, data, **kwargs) -> int:
    """The traced peak of the full per-device batch (no cap that matters)."""
    _, made = plan_training_args(
        model, args, data, memory_limit="8GiB", verbose=False, return_plan=True, **kwargs
    )
    return made.fit.device_total_bytes


def fp32_peak(tmp_path: Path, rows: int, data) -> int:
    """The estimate of the Trainer's step at ``rows`` rows in fp32, as the callback makes it for
    arguments without bf16/fp16 (``peak_at`` lets the plan choose the precision, bf16 on a bf16 host)."""
    from resource_guard.estimate import estimate_memory

    model, args = gpt2(), targs(tmp_path, per_device_train_batch_size=rows)
    step = hf_step.trainer_step(hf_step.trainer_loss(model, args), args.max_grad_norm)
    batch = hf_step.sample_batch(data, hf_step_default_collator(), rows, "cpu", model=model)
    optimizer = hf_step.trainer_optimizer(model, args)
    return estimate_memory(model, [optimizer], batch, step, device="cpu").peak_bytes


class PadToLongest:
    """A padding collator (what DataCollatorWithPadding does, without a tokenizer)."""

    def __init__(self, max_length: int | None = None, pad_to_multiple_of: int | None = None) -> None:
        self.max_length, self.pad_to_multiple_of = max_length, pad_to_multiple_of

    def __call__(self, rows):
        length = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        out = {k: torch.zeros(len(rows), length, dtype=torch.long) for k in ("input_ids", "attention_mask")}
        out["labels"] = torch.full((len(rows), length), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            out["input_ids"][i, :n] = r["input_ids"]
            out["attention_mask"][i, :n] = 1
            out["labels"][i, :n] = r["input_ids"]
        return out


class Logged(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


# -- exports, arguments and the seams ------------------------------------------------------------------
def test_both_names_are_exported_lazily_from_the_package():
    assert resource_guard.plan_training_args is plan_training_args
    assert resource_guard.ResourceGuardCallback is ResourceGuardCallback
    assert {"plan_training_args", "ResourceGuardCallback"} <= set(resource_guard.__all__)


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"headroom": 0.95}, "ResourceGuardCallback(headroom=0.95)"),
        ({"memory_limit": "lots"}, "memory_limit"),
        ({"max_seq_len": 0}, "ResourceGuardCallback(max_seq_len=0)"),
        ({"monitor": "yes"}, "ResourceGuardCallback(monitor='yes')"),
        ({"loss_fn": 3}, "ResourceGuardCallback(loss_fn=3)"),
    ],
)
def test_callback_refuses_bad_arguments_quoting_the_call(kwargs, quoted):
    with pytest.raises(ConfigurationError, match=quoted.replace("(", r"\(").replace(")", r"\)")):
        ResourceGuardCallback(**kwargs)


def test_plan_training_args_refuses_bad_arguments(tmp_path):
    with pytest.raises(ConfigurationError, match=r"plan_training_args\(target_batch_size=0\)"):
        plan_training_args(gpt2(), targs(tmp_path), lm_rows(4, 8), target_batch_size=0)
    with pytest.raises(ConfigurationError, match="TrainingArguments"):
        plan_training_args(gpt2(), {"per_device_train_batch_size": 2}, lm_rows(4, 8))
    with pytest.raises(ConfigurationError, match=r"plan_training_args\(precision='bf16-true'\)"):
        plan_training_args(gpt2(), targs(tmp_path), lm_rows(4, 8), precision="bf16-true")
    with pytest.raises(ConfigurationError, match="set the precision in one place"):
        plan_training_args(gpt2(), targs(tmp_path, bf16=True), lm_rows(4, 8), precision="16-mixed")


@pytest.mark.parametrize("isa", ["avx512_core_bf16", "avx2"])
def test_plan_training_args_keeps_the_arguments_precision_unless_asked(tmp_path, isa):
    """Numerics by consent: float32 arguments stay float32 on a CPU with native bf16 too;
    ``precision="auto"`` opts in to the planner's choice (bf16 there)."""
    args = targs(tmp_path, per_device_train_batch_size=4)
    with play_cpu(isa):
        kept, made = plan_training_args(gpt2(), args, lm_rows(8, 16), verbose=False, return_plan=True)
        chosen = plan_training_args(gpt2(), args, lm_rows(8, 16), precision="auto", verbose=False)
    assert not kept.bf16 and not kept.fp16 and made.precision == "32-true"
    assert any("precision kept as set (float32" in r for r in made.reasons), made.reasons
    assert chosen.bf16 is (isa == "avx512_core_bf16") and not chosen.fp16


def test_transformers_seams_are_where_we_expect():
    """Fails loudly when a transformers/accelerate release moves what the door relies on."""
    assert set(hf_step.TRANSFORMERS_SEAMS) == {
        "trainer_optimizer", "trainer_loss", "is_causal_lm", "decay_parameter_names", "checkpointing_fields",
        "trainer_collator",
    }  # fmt: skip
    # the collator Trainer.__init__ chooses for data_collator=None (hf_step.trainer_collator mirrors it)
    assert "DataCollatorWithPadding(processing_class)" in inspect.getsource(Trainer.__init__)
    field, kwargs_field = hf_step.checkpointing_fields(TrainingArguments("out", use_cpu=True, report_to=[]))
    assert {field, kwargs_field} <= {f.name for f in dataclasses.fields(TrainingArguments)}
    assert isinstance(inspect.getattr_static(Trainer, "get_optimizer_cls_and_kwargs"), staticmethod)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer_pt_utils import LabelSmoother

    assert "GPT2LMHeadModel" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() and callable(LabelSmoother)
    for hook in (
        "on_init_end",
        "on_train_begin",
        "on_substep_end",
        "on_step_end",
        "on_evaluate",
        "on_train_end",
    ):
        assert hook in vars(TrainerCallback), hook
    # the Trainer calls the model with the batch as keyword arguments (the forward pre-hook reads them)
    assert "model(**inputs)" in inspect.getsource(Trainer.compute_loss)
    # accelerate's autocast wrapper on the instance, the original kept as `_original_forward`
    from accelerate import Accelerator

    model = gpt2()
    Accelerator(cpu=True, mixed_precision="bf16").prepare_model(model)
    assert "forward" in vars(model) and hasattr(model, "_original_forward")
    with without_accelerate_autocast(model):
        assert "forward" not in vars(model)
    assert "forward" in vars(model)


# -- the Trainer's step, rebuilt ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "optim", ["adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop"]
)
def test_optimizer_is_the_one_the_trainer_builds(tmp_path, optim):
    model = gpt2()
    args = targs(tmp_path, optim=optim, weight_decay=0.01)
    ours = hf_step.trainer_optimizer(model, args)
    theirs = Trainer(model=model, args=args, train_dataset=lm_rows(2, 8)).create_optimizer()
    assert type(ours) is type(theirs)
    assert [len(g["params"]) for g in ours.param_groups] == [len(g["params"]) for g in theirs.param_groups]
    assert [{k: v for k, v in g.items() if k != "params"} for g in ours.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in theirs.param_groups
    ]


def test_eight_bit_optimizer_needs_bitsandbytes(tmp_path):
    args = targs(tmp_path, optim="adamw_bnb_8bit")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigurationError, match="adamw_bnb_8bit"):
            hf_step.trainer_optimizer(gpt2(), args)
    else:
        assert "8bit" in type(hf_step.trainer_optimizer(gpt2(), args)).__name__


def test_label_smoothed_loss_is_the_trainers(tmp_path):
    model = gpt2().eval()  # no dropout: the two losses are computed on the same function
    args = targs(tmp_path, label_smoothing_factor=0.1)
    batch = {k: torch.stack([r[k] for r in lm_rows(4, 16)]) for k in ("input_ids", "labels")}
    trainer = Trainer(model=model, args=args, train_dataset=lm_rows(2, 8))
    theirs = trainer.compute_loss(model, dict(batch))
    ours = hf_step.trainer_loss(model, args)(model, dict(batch))
    plain = hf_step.trainer_loss(model, targs(tmp_path))(model, dict(batch)).loss
    assert torch.allclose(ours, theirs) and not torch.allclose(ours, plain)


def test_compute_loss_func_is_used(tmp_path):
    seen = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(labels.shape)
        return outputs.logits.float().mean()

    model = gpt2()
    batch = {k: torch.stack([r[k] for r in lm_rows(2, 8)]) for k in ("input_ids", "labels")}
    hf_step.trainer_loss(model, targs(tmp_path), compute_loss_func=loss_func)(model, batch)
    assert seen == [torch.Size([2, 8])]


# -- plan_training_args ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_planned_arguments_train_under_a_cap_that_forces_accumulation(tmp_path):
    data = lm_rows(32, 32)
    args = targs(tmp_path, per_device_train_batch_size=16, max_steps=4)
    full = peak_at(gpt2(), args, data)
    cap = int(full * 0.75 / 0.9)  # the full batch of 16 does not fit; half of it does
    model = gpt2()
    planned, made = plan_training_args(model, args, data, memory_limit=cap, verbose=False, return_plan=True)
    assert planned.per_device_train_batch_size * planned.gradient_accumulation_steps == 16
    assert planned.gradient_accumulation_steps > 1 and made.fit.fits
    assert args.per_device_train_batch_size == 16  # the user's arguments are not touched
    logged = Logged()
    trainer = Trainer(
        model=model, args=planned, train_dataset=data,
        callbacks=[ResourceGuardCallback(memory_limit=cap, monitor=False), logged],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 4
    assert logged.losses[-1] < logged.losses[0]


def test_plan_is_made_for_the_collators_longest_batch_and_keeps_user_settings(tmp_path, capsys):
    rows = [{"input_ids": torch.arange(8 + i % 5) % VOCAB} for i in range(16)]
    collate = PadToLongest(max_length=40, pad_to_multiple_of=16)
    args = targs(tmp_path, per_device_train_batch_size=4, label_smoothing_factor=0.1, **{CKPT: True})
    planned, made = plan_training_args(gpt2(), args, rows, collate, memory_limit="1GiB", return_plan=True)
    assert getattr(planned, CKPT) and made.checkpointing  # kept
    assert any("4×48 int64" in r and "pad_to_multiple_of=16" in r for r in made.reasons), made.reasons
    assert "gradient checkpointing kept" in capsys.readouterr().err  # printed, with the table

    # the dataset's length column, when the collator does not cap the length
    class Lengths(list):
        lengths = [8 + i % 5 for i in range(16)] + [200]

    _, made = plan_training_args(gpt2(), args, Lengths(rows), PadToLongest(), verbose=False, return_plan=True)
    assert any("4×200 int64" in r and "dataset.lengths" in r for r in made.reasons), made.reasons


@pytest.mark.slow
def test_bert_classifier_is_planned_under_a_cap(tmp_path):
    rows = [{"input_ids": torch.arange(24) % VOCAB, "labels": torch.tensor(i % 3)} for i in range(16)]
    args = targs(tmp_path, per_device_train_batch_size=16)
    full = peak_at(bert(), args, rows)
    planned = plan_training_args(bert(), args, rows, memory_limit=int(full * 0.7 / 0.9), verbose=False)
    assert planned.per_device_train_batch_size * planned.gradient_accumulation_steps == 16
    assert planned.per_device_train_batch_size < 16


def test_lora_model_carries_no_base_gradients_or_state(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    _, made = plan_training_args(model, targs(tmp_path, per_device_train_batch_size=4), lm_rows(8, 16),
                                 memory_limit="1GiB", verbose=False, return_plan=True)  # fmt: skip
    breakdown = made.estimate.breakdown
    assert trainable < total / 10
    assert breakdown["optimizer_state"] <= 2 * trainable + 4096  # AdamW: two moments of the adapters only
    assert breakdown["gradients"] <= trainable


@pytest.mark.cpu_reference
def test_lora_step_estimate_matches_a_real_cpu_step(tmp_path):
    from peft import LoraConfig, get_peft_model

    from resource_guard.estimate import estimate_memory
    from resource_guard.estimate.user_step import measure_user_step

    model = get_peft_model(gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    args = targs(tmp_path, per_device_train_batch_size=8, max_grad_norm=1.0)
    step = hf_step.trainer_step(hf_step.trainer_loss(model, args), args.max_grad_norm)
    batch = hf_step.sample_batch(lm_rows(8, 64), hf_step_default_collator(), 8, "cpu", model=model)
    optimizer = hf_step.trainer_optimizer(model, args)
    est = estimate_memory(model, [optimizer], batch, step, device="cpu")
    skip_unless_cpu_runs(est)
    real = measure_user_step(model, [optimizer], batch, step)
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.02 * real.peak_bytes, (est.peak_bytes, real.peak_bytes)


def hf_step_default_collator():
    from transformers import default_data_collator

    return default_data_collator


# -- ResourceGuardCallback ----------------------------------------------------------------------------
def test_a_cap_below_one_row_stops_before_step_zero_with_the_report(tmp_path):
    args = targs(tmp_path, per_device_train_batch_size=4)
    trainer = Trainer(
        model=gpt2(), args=args, train_dataset=lm_rows(8, 16),
        callbacks=[ResourceGuardCallback(memory_limit="64KiB", monitor=False)],
    )  # fmt: skip
    with pytest.raises(DoesNotFitError) as raised:
        trainer.train()
    assert trainer.state.global_step == 0
    report = raised.value.report
    assert report.needed_bytes > report.usable_bytes and str(raised.value).startswith("Nothing fits")


def test_a_configured_batch_too_big_stops_before_step_zero_naming_the_one_that_fits(tmp_path):
    data = lm_rows(16, 32)
    args = targs(tmp_path, per_device_train_batch_size=16)
    cap = int(peak_at(gpt2(), args, data) * 0.6 / 0.9)
    trainer = Trainer(
        model=gpt2(), args=args, train_dataset=data,
        callbacks=[ResourceGuardCallback(memory_limit=cap, monitor=False)],
    )  # fmt: skip
    with pytest.raises(DoesNotFitError, match=r"per_device_train_batch_size=16.*largest per-device batch"):
        trainer.train()
    assert trainer.state.global_step == 0


class LateLong(torch.utils.data.IterableDataset):
    """Short rows, then long ones: the long batch arrives late."""

    def __iter__(self):
        for i in range(64):
            yield {"input_ids": torch.arange(16 if i < 8 else 160) % VOCAB}


@pytest.mark.slow
def test_a_late_long_batch_stops_before_it_runs(tmp_path):
    args = targs(tmp_path, per_device_train_batch_size=4, max_steps=6, report_to=["tensorboard"])
    short = peak_at(gpt2(), args, list(LateLong())[:4], data_collator=PadToLongest())
    long = peak_at(gpt2(), args, list(LateLong())[8:12], data_collator=PadToLongest())
    cap = int((short + long) / 2 / 0.9)  # the short batches fit, the long one does not
    guard = ResourceGuardCallback(memory_limit=cap, profile=False)
    trainer = Trainer(model=gpt2(), args=args, train_dataset=LateLong(), data_collator=PadToLongest(),
                      callbacks=[guard])  # fmt: skip
    with pytest.raises(DoesNotFitError, match="stopped before it ran") as raised:
        trainer.train()
    assert trainer.state.global_step == 2  # two steps of short batches ran; the third batch did not
    assert guard.shape_stats["stops"] == 1 and guard.shape_stats["batches_checked"] == 3
    assert "4×160" in raised.value.report.shape.shape
    assert guard.report is not None  # the monitor closed with the error, the report written
    assert (tmp_path / "out" / "resource_guard" / "report.json").exists()


def test_report_files_and_tensorboard_tags_exist_after_train(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = targs(tmp_path, per_device_train_batch_size=4, report_to=["tensorboard"])
    guard = ResourceGuardCallback(memory_limit="1GiB", profile=False)
    trainer = Trainer(model=gpt2(), args=args, train_dataset=lm_rows(16, 16), callbacks=[guard])
    trainer.train()
    out = tmp_path / "out"
    for name in ("report.md", "report.json"):
        assert (out / "resource_guard" / name).exists(), name
    assert guard.report is not None and guard.report.stats.steps == 3
    (run,) = (out / "runs").iterdir()  # the Trainer's own TensorBoard run
    events = EventAccumulator(str(run))
    events.Reload()
    assert any(tag.startswith("resource_guard/") for tag in events.Tags()["scalars"])
    assert "train/loss" in events.Tags()["scalars"]  # the same run as the Trainer's
    assert any(tag.startswith("resource_guard/plan") for tag in events.Tags()["tensors"])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_micro_steps_model_flops_are_counted_for_mfu_without_the_recomputed_forward(
    tmp_path, checkpointing
):
    """GPT-2 (2 layers, width 32, vocabulary 128) on 4 rows of 16 tokens: each matmul weight costs
    2·tokens FLOPs forward and twice that backward; attention's two batched matmuls per layer come on
    top where torch's counter knows the kernel (CPU's fused attention it does not count). The model's own
    gradient checkpointing recomputes the forward; that is hardware work, not model FLOPs."""
    args = targs(tmp_path, per_device_train_batch_size=4, max_steps=2, **{CKPT: checkpointing})
    guard = ResourceGuardCallback(memory_limit="1GiB", profile=False, verbose=False)
    Trainer(model=gpt2(), args=args, train_dataset=lm_rows(16, 16), callbacks=[guard]).train()
    tokens, width = 4 * 16, 32
    weights = 2 * (width * 3 * width + width * width + 2 * width * 4 * width) + width * VOCAB
    attention = 2 * 2 * (2 * 4 * 16 * 16 * width)  # layers × (QKᵀ, AV) × 2·B·S·S·width
    linear = 3 * 2 * tokens * weights
    assert guard.report is not None and guard.report.stats.flops_per_step is not None
    assert linear <= guard.report.stats.flops_per_step <= linear + 3 * attention


@pytest.mark.slow
def test_auto_find_batch_size_comes_down_to_the_batch_that_fits_without_running_a_step(tmp_path, monkeypatch):
    """accelerate's loop lowers the batch after each out-of-memory error (by 10% or by half, as its
    version does); the callback raises a predicted one before any step, so the loop comes down from 8
    to 4, the largest that fits, and the run trains at 4 without a real step above it."""
    from resource_guard.errors import PredictedOutOfMemoryError

    data = lm_rows(64, 16)
    args = targs(tmp_path, per_device_train_batch_size=8, auto_find_batch_size=True)
    cap = int((fp32_peak(tmp_path, 4, data) + fp32_peak(tmp_path, 5, data)) / 2 / 0.9)
    refused, rows = [], []
    trainer_loop = hf_trainer.ResourceGuardCallback._preflight

    def preflight(self, *a, **k):
        try:
            return trainer_loop(self, *a, **k)
        except PredictedOutOfMemoryError as error:
            refused.append((self._rows, str(error)))
            raise

    monkeypatch.setattr(hf_trainer.ResourceGuardCallback, "_preflight", preflight)
    model = gpt2()
    model.register_forward_pre_hook(  # the real forwards: the estimates trace copies of the model
        lambda m, a, k: rows.append(len(k["input_ids"])) if m is model and m.training else None,
        with_kwargs=True,
    )
    guard = ResourceGuardCallback(memory_limit=cap, profile=False)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[guard])
    trainer.train()
    assert trainer.state.train_batch_size == 4 and guard.plan is not None and guard.plan.micro_batch_size == 4
    assert set(rows) == {4} and trainer.state.global_step == 3  # no real step above 4
    assert refused[0][0] == 8 and all(n > 4 for n, _ in refused)
    assert " out of memory." in refused[0][1] and "Per-device batch 8 needs" in refused[0][1]
    assert issubclass(PredictedOutOfMemoryError, RuntimeError)  # what accelerate's loop catches


def test_without_auto_find_batch_size_a_batch_too_big_is_refused_naming_the_one_that_fits(tmp_path):
    from resource_guard.errors import PredictedOutOfMemoryError

    data = lm_rows(64, 16)
    cap = int(fp32_peak(tmp_path, 4, data) / 0.9) + 1
    guard = ResourceGuardCallback(memory_limit=cap, profile=False, verbose=False)
    trainer = Trainer(model=gpt2(), args=targs(tmp_path, per_device_train_batch_size=16), train_dataset=data,
                      callbacks=[guard])  # fmt: skip
    with pytest.raises(DoesNotFitError, match="per_device_train_batch_size=16 needs more") as raised:
        trainer.train()
    assert not isinstance(raised.value, PredictedOutOfMemoryError)


class FailAt(TrainerCallback):
    """Makes the model fail in its forward (an out-of-memory error) or its backward (a RuntimeError)
    from the step after ``step``, the way a real failure comes: from inside the Trainer's own step."""

    def __init__(self, model, where: str, step: int = 2) -> None:
        self.armed, self.step = False, step
        if where == "forward":
            model.register_forward_pre_hook(self._forward)
        else:
            model.lm_head.weight.register_hook(self._backward)

    def on_step_end(self, args, state, control, **kwargs):
        self.armed = self.armed or state.global_step >= self.step

    def _forward(self, module, args):
        if self.armed and module.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    def _backward(self, grad):
        if self.armed:
            raise RuntimeError("a backward that fails (simulated)")


def test_an_out_of_memory_error_in_a_training_forward_writes_the_report_at_once(tmp_path):
    model = gpt2()
    guard = ResourceGuardCallback(memory_limit="1GiB", profile=False)
    args = targs(tmp_path, per_device_train_batch_size=4, max_steps=5)
    trainer = Trainer(model=model, args=args, train_dataset=lm_rows(32, 16),
                      callbacks=[guard, FailAt(model, "forward")])  # fmt: skip
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    assert guard.report is not None and guard.report.verdict == "oom"
    oom = guard.report.stats.oom
    assert oom is not None and oom["step"] == 3 and oom["error"].startswith("OutOfMemoryError")
    out = tmp_path / "out" / "resource_guard"
    assert (out / "oom.json").exists() and "oom" in (out / "report.md").read_text()


def test_a_run_restarted_after_an_unseen_error_closes_the_first_report_with_a_note(tmp_path, monkeypatch):
    monitors = []
    build = hf_trainer.build_monitor

    def keep(*args, **kwargs):
        monitors.append(build(*args, **kwargs))
        return monitors[-1]

    monkeypatch.setattr(hf_trainer, "build_monitor", keep)
    model = gpt2()
    failing = FailAt(model, "backward")
    guard = ResourceGuardCallback(memory_limit="1GiB", profile=False)
    args = targs(tmp_path, per_device_train_batch_size=4, max_steps=4)
    trainer = Trainer(model=model, args=args, train_dataset=lm_rows(32, 16), callbacks=[guard, failing])
    with pytest.raises(RuntimeError, match="a backward that fails"):
        trainer.train()
    assert guard.report is None  # the Trainer said nothing: the run is still open
    failing.armed, failing.step = False, 10**9
    trainer.train()  # a retry, as auto_find_batch_size's after an out-of-memory error
    first = monitors[0].report
    assert first is not None and first.stats.steps == 2
    assert any("RunEndedEarly: the Trainer started training again" in n for n in first.stats.notes)
    assert guard.report is not None and guard.report is monitors[1].report and guard.report.stats.steps == 4


CRASHING_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from frontdoors.test_hf_trainer import FailAt, gpt2, lm_rows, targs
from pathlib import Path
from transformers import Trainer
from resource_guard import ResourceGuardCallback

model = gpt2()
args = targs(Path({tmp!r}), per_device_train_batch_size=4, max_steps=5)
guard = ResourceGuardCallback(memory_limit="1GiB", profile=False)
trainer = Trainer(model=model, args=args, train_dataset=lm_rows(32, 16),
                  callbacks=[guard, FailAt(model, "backward")])
trainer.train()
"""


@pytest.mark.slow
def test_a_script_that_dies_in_backward_still_writes_the_report_at_exit(tmp_path):
    import json
    import subprocess
    import sys

    script = CRASHING_SCRIPT.format(tests=str(ROOT / "tests"), tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "a backward that fails" in done.stderr, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "resource_guard" / "report.json").read_text())
    assert report["summary"]["steps"] == 2
    notes = report["summary"]["notes"]
    assert any("RuntimeError: a backward that fails" in n for n in notes), notes
    assert "resource_guard: verdict" in done.stderr  # the summary printed as at on_train_end


@pytest.mark.slow
def test_evaluation_is_preflighted_and_refused_when_it_does_not_fit(tmp_path):
    data = lm_rows(16, 32)
    args = targs(tmp_path, per_device_train_batch_size=2, per_device_eval_batch_size=16, eval_strategy="no")
    guard = ResourceGuardCallback(memory_limit="1GiB", monitor=False)
    trainer = Trainer(model=gpt2(), args=args, train_dataset=data, eval_dataset=data, callbacks=[guard])
    trainer.train()
    trainer.evaluate()
    assert [c.batch_size for c in guard.eval_checks] == [16] and guard.eval_checks[0].fits
    eval_peak = guard.eval_checks[0].predicted_peak_bytes
    tight = ResourceGuardCallback(memory_limit=int(eval_peak * 0.5 / 0.9), monitor=False)
    trainer = Trainer(model=gpt2(), args=args, eval_dataset=data, callbacks=[tight])
    with pytest.raises(DoesNotFitError, match="evaluation step does not fit"):
        trainer.evaluate()


@pytest.mark.slow
def test_trainer_subclass_with_its_own_loss_and_user_checkpointing(tmp_path):
    class Mine(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(input_ids=inputs["input_ids"])
            loss = out.logits.float().logsumexp(-1).mean()
            return (loss, out) if return_outputs else loss

    def loss_fn(model, batch):
        return model(input_ids=batch["input_ids"]).logits.float().logsumexp(-1).mean()

    args = targs(
        tmp_path, per_device_train_batch_size=4, **{CKPT: True, f"{CKPT}_kwargs": {"use_reentrant": False}}
    )
    guard = ResourceGuardCallback(memory_limit="1GiB", loss_fn=loss_fn, monitor=False)
    trainer = Mine(model=gpt2(), args=args, train_dataset=lm_rows(16, 16), callbacks=[guard])
    trainer.train()
    assert trainer.state.global_step == 3 and hf_runtime.checkpointed(trainer.model)
    assert any("the model's own" in r for r in guard.plan.reasons)


@pytest.mark.slow
def test_sft_trainer_from_trl(tmp_path):
    trl = pytest.importorskip("trl", reason="trl is an optional extra of the Trainer door's users")
    args = trl.SFTConfig(
        str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no", max_steps=2,
        per_device_train_batch_size=4, disable_tqdm=True,
    )  # fmt: skip
    args = plan_training_args(gpt2(), args, lm_rows(16, 16), memory_limit="1GiB", verbose=False)
    assert isinstance(args, trl.SFTConfig)
    guard = ResourceGuardCallback(memory_limit="1GiB", monitor=False)
    data = [{"input_ids": r["input_ids"].tolist()} for r in lm_rows(16, 16)]
    import datasets
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t0")
    trainer = trl.SFTTrainer(model=gpt2(), args=args, train_dataset=datasets.Dataset.from_list(data),
                             processing_class=tokenizer, callbacks=[guard])  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2 and guard.plan is not None


@pytest.mark.slow
def test_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(str(ROOT / "examples" / "hf_trainer.py"), run_name="not_main")
    trainer = namespace["main"](str(tmp_path / "example"))
    assert trainer.args.gradient_accumulation_steps > 1
    assert (tmp_path / "example" / "resource_guard" / "report.md").exists()


def test_arguments_copy_is_a_dataclass_copy(tmp_path):
    args = targs(tmp_path, per_device_train_batch_size=2)
    planned = plan_training_args(gpt2(), args, lm_rows(4, 8), memory_limit="1GiB", verbose=False)
    assert planned is not args and dataclasses.is_dataclass(planned)


@pytest.mark.slow
def test_bf16_run_traces_under_accelerates_autocast_wrapper(tmp_path):
    """Under bf16 accelerate wraps the model's forward in autocast; the checks trace around it (no warning:
    a shape check that failed would warn, and ResourceGuardWarning is an error in this suite)."""
    args = targs(tmp_path, per_device_train_batch_size=4, bf16=True, max_steps=2)
    guard = ResourceGuardCallback(memory_limit="1GiB", monitor=False)
    trainer = Trainer(model=gpt2(), args=args, train_dataset=lm_rows(8, 16), callbacks=[guard])
    trainer.train()
    assert "forward" in vars(trainer.model) and hasattr(trainer.model, "_original_forward")  # wrapped
    assert guard.plan is not None and guard.plan.precision == "bf16-mixed"
    assert trainer.state.global_step == 2 and guard.shape_stats["batches_checked"] == 2


def test_one_plan_printout_the_callback_confirms_what_plan_training_args_printed(tmp_path, capsys):
    """Issue #40: the plan is printed once (plan_training_args), the callback confirms it in one line; the
    device the user did not name is "auto-detected"; the settings the plan changed show old → new."""
    rows = lm_rows(32, 16)
    args = targs(tmp_path, per_device_train_batch_size=8, max_steps=1)
    limit = int(0.8 * peak_at(gpt2(), args, rows))  # 8 rows at once do not fit: the plan accumulates
    planned = plan_training_args(gpt2(), args, rows, memory_limit=limit)
    printed = capsys.readouterr().err
    assert "auto-detected" in printed and "asked for" not in printed
    line = next(x for x in printed.splitlines() if x.startswith("- TrainingArguments:"))
    assert " → " in line, line  # smaller micro-batches or checkpointing: something changed
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", CKPT):
        old, new = getattr(args, name), getattr(planned, name)
        assert (f"{name}={old!r} → {new!r}" if old != new else f"{name}={new!r},") in line, (name, line)
    guard = ResourceGuardCallback(memory_limit=limit, monitor=False)
    Trainer(model=gpt2(), args=planned, train_dataset=rows, callbacks=[guard]).train()
    confirmed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ResourceGuard")]
    assert len(confirmed) == 1 and "as plan_training_args planned it" in confirmed[0], confirmed
    assert any("auto-detected" in r for r in guard.plan.reasons)

    # arguments the user wrote (not planned here): the callback prints the plan it checked, device auto
    guard = ResourceGuardCallback(memory_limit="1GiB", monitor=False)
    Trainer(model=gpt2(), args=targs(tmp_path, max_steps=1), train_dataset=rows, callbacks=[guard]).train()
    full = capsys.readouterr().err
    assert "- TrainingArguments:" in full and "auto-detected" in full and "as plan_training_args" not in full
