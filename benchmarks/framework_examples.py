"""The frameworks' own examples, each changed only by adding the door (#39).

Each example is written as its public source writes it, smaller (configs, not downloads; local text and
random images in place of WikiText-2 and MNIST), and runs twice: as written, and with the one line the
README adds (``callbacks=[ResourceGuard()]`` for Lightning; ``plan_training_args`` before the Trainer and
``callbacks=[ResourceGuardCallback()]`` for the Trainer). Cases:

- ``lightning/autoencoder``: Lightning's ``examples/pytorch/basics/autoencoder.py`` (``LitAutoEncoder``
  with its datamodule, validation and ``self.log``);
- ``lightning/gan``: ``examples/pytorch/domain_templates/generative_adversarial_net.py``: manual
  optimization, ``training_step(self, batch)`` with no ``batch_idx``, ``toggle_optimizer`` /
  ``manual_backward`` / ``optimizer.step()``, two Adams; its image logging needs torchvision, which is
  not installed here, so the grid is the images side by side (``torch.cat``) logged the same way;
- ``lightning/transformer_lm``: ``lightning.pytorch.demos.LightningTransformer`` on ``WikiText2`` read
  from local text (``download=False``), with TensorBoard and CSV loggers, ``accumulate_grad_batches=4``
  and ``ModelCheckpoint``;
- ``transformers/causal_lm``: ``run_clm.py``'s flow: a tokenizer, ``group_texts`` into blocks,
  ``default_data_collator``, ``Trainer(..., processing_class=tokenizer)``, ``train`` then ``evaluate``;
- ``transformers/text_classification``: ``run_glue.py``'s default: ``padding=False`` in the tokenizer,
  ``data_collator=None`` so the Trainer pads each batch (``DataCollatorWithPadding``);
- ``transformers/peft_lora``: a PEFT LoRA fine-tune of the causal LM (``get_peft_model``,
  ``DataCollatorForLanguageModeling(mlm=False)``), only where ``peft`` is installed.

The tokenizer is built here with the ``tokenizers`` library (a WordLevel model trained on the local
text, wrapped in ``PreTrainedTokenizerFast`` with a pad token): no download.

Per case it prints: whether it ran to the end with the package where it runs without it (the steps
both ran), the pre-flight's method (``traced`` expected everywhere), what the package changed of the
user's settings (during the run: Lightning's are put back at the end), where the report is, and the
report's first finding.

Run: ``python benchmarks/framework_examples.py [--only NAME ...] [--steps 6]`` (CPU, a few minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import random
import shutil
import tempfile
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WORDS = [f"w{i}" for i in range(300)]


def local_text(path: Path, lines: int = 400, seed: int = 0) -> list[str]:
    """Deterministic sentences of 4 to 60 words (ragged, as real text is), written to ``path``."""
    rng = random.Random(seed)
    text = [
        " ".join(rng.choice(WORDS[: 50 + 5 * (i % 50)]) for _ in range(rng.randint(4, 60)))
        for i in range(lines)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text) + "\n", encoding="utf8")
    return text


def local_tokenizer(text: list[str]) -> Any:
    """A WordLevel tokenizer trained on ``text`` and wrapped as transformers wraps a tokenizer file."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    made = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    made.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    made.train_from_iterator(text, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=made, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]", model_max_length=128
    )


@dataclass
class Outcome:
    steps: int | None = None  # the optimizer steps it ran (None: it failed)
    error: str | None = None
    method: str = "-"
    changed: str = "-"
    report: str = "-"
    finding: str = "-"
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# Lightning


def _lightning_door(door: bool) -> list[Any]:
    from resource_guard import ResourceGuard

    return [ResourceGuard()] if door else []


def _lightning_outcome(trainer: Any, guard: Any, user: dict[str, Any], root: Path) -> Outcome:
    out = Outcome(steps=int(trainer.global_step))
    if guard is None:
        return out
    made = guard.plan
    out.method = made.estimate.method if made is not None else "no plan"
    d = guard.decisions
    if d is not None:
        now = {
            "batch_size": d.micro_batch_size,
            "accumulate_grad_batches": d.accumulation_steps,
            "precision": d.precision,
            "activation checkpointing": "on" if d.checkpointing else "off",
        }
        diff = [f"{k} {user[k]} → {v}" for k, v in now.items() if str(user[k]) != str(v)]
        out.changed = "; ".join(diff) or "nothing"
    report = next(iter(sorted(root.rglob("resource_guard/report.md"))), None)
    out.report = str(report.relative_to(root)) if report is not None else "none"
    out.finding = _first_finding(guard.report)
    return out


def _first_finding(report: Any) -> str:
    if report is None:
        return "no report"
    findings = getattr(report, "findings", ())
    return f"{findings[0].id}: {findings[0].title}" if findings else "none"


def lightning_autoencoder(root: Path, door: bool, steps: int) -> Outcome:
    import lightning.pytorch as L
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset, random_split

    class LitAutoEncoder(L.LightningModule):
        def __init__(self, hidden_dim: int = 64, learning_rate: float = 10e-3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
            self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28))

        def forward(self, x):
            z = self.encoder(x)
            return self.decoder(z)

        def training_step(self, batch, batch_idx):
            return self._common_step(batch, batch_idx, "train")

        def validation_step(self, batch, batch_idx):
            self._common_step(batch, batch_idx, "val")

        def test_step(self, batch, batch_idx):
            self._common_step(batch, batch_idx, "test")

        def predict_step(self, batch, batch_idx, dataloader_idx=None):
            x = self._prepare_batch(batch)
            return self(x)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

        def _prepare_batch(self, batch):
            x, _ = batch
            return x.view(x.size(0), -1)

        def _common_step(self, batch, batch_idx, stage: str):
            x = self._prepare_batch(batch)
            loss = F.mse_loss(x, self(x))
            self.log(f"{stage}_loss", loss, on_step=True)
            return loss

    class MyDataModule(L.LightningDataModule):
        def __init__(self, batch_size: int = 32) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(42)
            dataset = TensorDataset(
                torch.rand(600, 1, 28, 28, generator=gen), torch.zeros(600, dtype=torch.long)
            )
            self.mnist_test = TensorDataset(torch.rand(64, 1, 28, 28, generator=gen), torch.zeros(64))
            self.mnist_train, self.mnist_val = random_split(
                dataset, [500, 100], generator=torch.Generator().manual_seed(42)
            )
            self.batch_size = batch_size

        def train_dataloader(self):
            return DataLoader(self.mnist_train, batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(self.mnist_val, batch_size=self.batch_size)

        def test_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

        def predict_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

    torch.manual_seed(0)
    callbacks = _lightning_door(door)
    trainer = L.Trainer(
        default_root_dir=root, accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=2,
        enable_progress_bar=False, callbacks=callbacks,
    )  # fmt: skip
    model, datamodule = LitAutoEncoder(), MyDataModule()
    trainer.fit(model, datamodule=datamodule)
    trainer.test(model, datamodule=datamodule)
    user = {
        "batch_size": 32,
        "accumulate_grad_batches": 1,
        "precision": "32-true",
        "activation checkpointing": "off",
    }
    return _lightning_outcome(trainer, callbacks[0] if door else None, user, root)


def lightning_gan(root: Path, door: bool, steps: int) -> Outcome:
    import lightning.pytorch as L
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    class Generator(nn.Module):
        def __init__(self, latent_dim: int = 100, img_shape: tuple = (1, 28, 28)) -> None:
            super().__init__()
            self.img_shape = img_shape

            def block(in_feat, out_feat, normalize=True):
                layers = [nn.Linear(in_feat, out_feat)]
                if normalize:
                    layers.append(nn.BatchNorm1d(out_feat, 0.8))
                layers.append(nn.LeakyReLU(0.2, inplace=True))
                return layers

            self.model = nn.Sequential(
                *block(latent_dim, 128, normalize=False),
                *block(128, 256),
                *block(256, 512),
                *block(512, 1024),
                nn.Linear(1024, int(math.prod(img_shape))),
                nn.Tanh(),
            )

        def forward(self, z):
            img = self.model(z)
            return img.view(img.size(0), *self.img_shape)

    class Discriminator(nn.Module):
        def __init__(self, img_shape: tuple) -> None:
            super().__init__()
            self.model = nn.Sequential(
                nn.Linear(int(math.prod(img_shape)), 512),
                nn.LeakyReLU(0.2, inplace=True),
                nn.Linear(512, 256),
                nn.LeakyReLU(0.2, inplace=True),
                nn.Linear(256, 1),
            )

        def forward(self, img):
            img_flat = img.view(img.size(0), -1)
            return self.model(img_flat)

    class GAN(L.LightningModule):
        def __init__(self, latent_dim: int = 100, lr: float = 0.0002, b1: float = 0.5, b2: float = 0.999,
                     batch_size: int = 64, **kwargs) -> None:  # fmt: skip
            super().__init__()
            self.save_hyperparameters()
            self.automatic_optimization = False
            mnist_shape = (1, 28, 28)
            self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=mnist_shape)
            self.discriminator = Discriminator(img_shape=mnist_shape)
            self.validation_z = torch.randn(8, self.hparams.latent_dim)
            self.example_input_array = torch.zeros(2, self.hparams.latent_dim)

        def forward(self, z):
            return self.generator(z)

        @staticmethod
        def adversarial_loss(y_hat, y):
            return F.binary_cross_entropy_with_logits(y_hat, y)

        def training_step(self, batch):
            imgs, _ = batch
            opt_g, opt_d = self.optimizers()
            z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
            z = z.type_as(imgs)
            # train the generator
            valid = torch.ones(imgs.size(0), 1)
            valid = valid.type_as(imgs)
            self.toggle_optimizer(opt_g)
            g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            self.untoggle_optimizer(opt_g)
            # train the discriminator
            self.toggle_optimizer(opt_d)
            real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
            fake = torch.zeros(imgs.size(0), 1)
            fake = fake.type_as(imgs)
            fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
            d_loss = (real_loss + fake_loss) / 2
            self.log("d_loss", d_loss, prog_bar=True)
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            self.untoggle_optimizer(opt_d)

        def configure_optimizers(self):
            lr = self.hparams.lr
            b1 = self.hparams.b1
            b2 = self.hparams.b2
            opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
            opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
            return [opt_g, opt_d], []

        def on_train_epoch_end(self):
            z = self.validation_z.type_as(self.generator.model[0].weight)
            sample_imgs = self(z)
            grid = torch.cat(list(sample_imgs), dim=-1)  # torchvision.utils.make_grid in the example
            for logger in self.loggers:
                logger.experiment.add_image("generated_images", grid, self.current_epoch)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    images = TensorDataset(torch.rand(64 * steps, 1, 28, 28, generator=gen) * 2 - 1, torch.zeros(64 * steps))
    callbacks = _lightning_door(door)
    trainer = L.Trainer(
        default_root_dir=root, accelerator="cpu", devices=1, max_epochs=1, enable_progress_bar=False,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(GAN(), DataLoader(images, batch_size=64))
    user = {
        "batch_size": 64,
        "accumulate_grad_batches": 1,
        "precision": "32-true",
        "activation checkpointing": "off",
    }
    out = _lightning_outcome(trainer, callbacks[0] if door else None, user, root)
    out.steps = int(trainer.global_step) // 2  # two optimizers: Lightning counts each one's step
    return out


def lightning_transformer_lm(root: Path, door: bool, steps: int) -> Outcome:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos import LightningTransformer, WikiText2
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from torch.utils.data import DataLoader

    local_text(root / "data" / "wikitext-2.txt")  # where WikiText2() looks: its download finds it there
    with contextlib.chdir(root):  # the demo's `prepare_data` calls WikiText2(download=True) in ./data
        torch.manual_seed(0)
        dataset = WikiText2()
        dataloader = DataLoader(dataset, batch_size=8)
        model = LightningTransformer(vocab_size=dataset.vocab_size)
        door_callbacks = _lightning_door(door)
        callbacks = [ModelCheckpoint(dirpath=root / "checkpoints", save_last=True), *door_callbacks]
        trainer = L.Trainer(
            default_root_dir=root, accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=4,
            logger=[TensorBoardLogger(root / "tb"), CSVLogger(root / "csv")], callbacks=callbacks,
            enable_progress_bar=False,
        )  # fmt: skip
        trainer.fit(model=model, train_dataloaders=dataloader)
    user = {
        "batch_size": 8,
        "accumulate_grad_batches": 4,
        "precision": "32-true",
        "activation checkpointing": "off",
    }
    out = _lightning_outcome(trainer, door_callbacks[0] if door else None, user, root)
    out.notes.append(
        f"checkpoint {'written' if (root / 'checkpoints' / 'last.ckpt').is_file() else 'MISSING'}"
    )
    return out


# ---------------------------------------------------------------------------------------------------
# transformers


def _hf_outcome(trainer: Any, callback: Any, user: Any, planned: Any, root: Path) -> Outcome:
    from resource_guard.frontdoors.hf.plan import planned_by

    out = Outcome(steps=int(trainer.state.global_step))
    if callback is None:
        return out
    fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
              "gradient_checkpointing", "activation_checkpointing")  # fmt: skip
    diff = [
        f"{k} {getattr(user, k)!r} → {getattr(planned, k)!r}"
        for k in fields
        if hasattr(user, k) and getattr(user, k) != getattr(planned, k)
    ]
    out.changed = "; ".join(diff) or "nothing"
    before = planned_by(planned)
    made = callback.plan
    methods = [
        f"plan_training_args {before.estimate.method if before is not None else '-'}",
        f"callback {made.estimate.method if made is not None else 'no plan'}",
    ]
    out.method = ", ".join(methods)
    report = Path(user.output_dir) / "resource_guard" / "report.md"
    out.report = str(report.relative_to(root)) if report.is_file() else "none"
    out.finding = _first_finding(callback.report)
    if made is not None:
        out.notes += [r for r in made.reasons if "largest batch" in r]
    return out


def _training_args(root: Path, steps: int, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(root / "out"), use_cpu=True, max_steps=steps, per_device_train_batch_size=8,
        logging_steps=1, save_strategy="no", report_to=["tensorboard"], disable_tqdm=True, seed=0, **kwargs,
    )  # fmt: skip


def _gpt2(vocab: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=128))


def transformers_causal_lm(root: Path, door: bool, steps: int) -> Outcome:
    from itertools import chain

    import datasets
    from transformers import Trainer, default_data_collator

    from resource_guard import ResourceGuardCallback, plan_training_args

    text = local_text(root / "train.txt")
    tokenizer = local_tokenizer(text)
    raw = datasets.Dataset.from_dict({"text": text}).train_test_split(test_size=0.1, seed=0)
    column_names = raw["train"].column_names
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    tokenized = raw.map(tokenize_function, batched=True, remove_columns=column_names)
    block_size = 64

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}  # noqa: SIM118 (run_clm.py)
        total_length = len(concatenated[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    lm_datasets = tokenized.map(group_texts, batched=True)
    train_dataset, eval_dataset = lm_datasets["train"], lm_datasets["test"]
    model = _gpt2(len(tokenizer))
    training_args = user = _training_args(root, steps)
    callbacks = []
    if door:
        training_args = plan_training_args(model, training_args, train_dataset, default_data_collator)
        callbacks = [ResourceGuardCallback()]
    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, data_collator=default_data_collator, callbacks=callbacks,
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    out = _hf_outcome(trainer, callbacks[0] if door else None, user, training_args, root)
    out.notes.append(f"eval perplexity {math.exp(metrics['eval_loss']):.1f}")
    return out


def transformers_text_classification(root: Path, door: bool, steps: int) -> Outcome:
    import datasets
    from transformers import BertConfig, BertForSequenceClassification, Trainer

    from resource_guard import ResourceGuardCallback, plan_training_args

    text = local_text(root / "train.txt")
    tokenizer = local_tokenizer(text)
    raw = datasets.Dataset.from_dict({"sentence": text, "label": [len(s.split()) % 2 for s in text]})
    raw = raw.train_test_split(test_size=0.1, seed=0)
    padding = False  # run_glue.py without --pad_to_max_length: the Trainer pads each batch
    max_seq_length = 128

    def preprocess_function(examples):
        return tokenizer(examples["sentence"], padding=padding, max_length=max_seq_length, truncation=True)

    raw = raw.map(preprocess_function, batched=True)
    train_dataset, eval_dataset = raw["train"], raw["test"]
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=128, num_labels=2)  # fmt: skip
    model = BertForSequenceClassification(config)
    data_collator = None  # run_glue.py: `None` unless --pad_to_max_length or fp16

    def compute_metrics(p):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        return {"accuracy": float((preds.argmax(-1) == p.label_ids).mean())}

    training_args = user = _training_args(root, steps)
    callbacks = []
    if door:
        training_args = plan_training_args(
            model, training_args, train_dataset, data_collator, processing_class=tokenizer
        )
        callbacks = [ResourceGuardCallback()]
    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        compute_metrics=compute_metrics, processing_class=tokenizer, data_collator=data_collator,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    out = _hf_outcome(trainer, callbacks[0] if door else None, user, training_args, root)
    out.notes.append(f"eval accuracy {metrics['eval_accuracy']:.2f}")
    return out


def transformers_peft_lora(root: Path, door: bool, steps: int) -> Outcome:
    import datasets
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer

    from resource_guard import ResourceGuardCallback, plan_training_args

    text = local_text(root / "train.txt")
    tokenizer = local_tokenizer(text)
    data = datasets.Dataset.from_dict({"text": text})
    data = data.map(lambda samples: tokenizer(samples["text"]), batched=True, remove_columns=["text"])
    model = _gpt2(len(tokenizer))
    peft_config = LoraConfig(task_type=TaskType.CAUSAL_LM, inference_mode=False, r=8, lora_alpha=32,
                             lora_dropout=0.1, target_modules=["c_attn"], fan_in_fan_out=True)  # fmt: skip
    model = get_peft_model(model, peft_config)
    data_collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    training_args = user = _training_args(root, steps)
    callbacks = []
    if door:
        training_args = plan_training_args(model, training_args, data, data_collator)
        callbacks = [ResourceGuardCallback()]
    trainer = Trainer(model=model, args=training_args, train_dataset=data, data_collator=data_collator,
                      callbacks=callbacks)  # fmt: skip
    trainer.train()
    return _hf_outcome(trainer, callbacks[0] if door else None, user, training_args, root)


CASES: dict[str, Callable[[Path, bool, int], Outcome]] = {
    "lightning/autoencoder": lightning_autoencoder,
    "lightning/gan": lightning_gan,
    "lightning/transformer_lm": lightning_transformer_lm,
    "transformers/causal_lm": transformers_causal_lm,
    "transformers/text_classification": transformers_text_classification,
    "transformers/peft_lora": transformers_peft_lora,
}
NEEDS = {"transformers/peft_lora": "peft"}


def run(name: str, door: bool, steps: int, keep: Path | None) -> Outcome:
    root = Path(tempfile.mkdtemp(prefix=f"fx_{name.replace('/', '_')}_{'door' if door else 'plain'}_"))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = CASES[name](root, door, steps)
        from resource_guard.errors import ResourceGuardWarning

        ours = [
            str(w.message).splitlines()[0] for w in caught if issubclass(w.category, ResourceGuardWarning)
        ]
        out.notes += [f"warning: {m[:140]}" for m in ours]
        if keep is not None and door:
            target = keep / name.replace("/", "_")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(root, target, ignore=shutil.ignore_patterns("*.ckpt", "data"))
            out.report = str(target / out.report) if out.report not in ("-", "none") else out.report
        return out
    except Exception as error:  # the table says what failed; the traceback goes to stderr
        traceback.print_exc()
        return Outcome(error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="run these cases only")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--keep", type=Path, default=None, help="copy each guarded run's files here")
    options = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    for name in options.only or CASES:
        needed = NEEDS.get(name)
        if needed is not None and importlib.util.find_spec(needed) is None:
            rows.append((name, f"skipped: `{needed}` is not installed", "-", "-", "-", "-", []))
            continue
        plain = run(name, False, options.steps, None)
        guarded = run(name, True, options.steps, options.keep)
        if plain.error is not None:
            ran = f"the example fails without the package ({plain.error})"
        elif guarded.error is not None:
            ran = f"NO: {guarded.error} (ran {plain.steps} steps without)"
        else:
            same = "yes" if guarded.steps == plain.steps else "NO"
            ran = f"{same}: {guarded.steps} steps with, {plain.steps} without"
        rows.append(
            (name, ran, guarded.method, guarded.changed, guarded.report, guarded.finding, guarded.notes)
        )
    print(
        "\n| example | ran to the end with the package | pre-flight | changed of the user's settings "
        "| report | first finding |"
    )
    print("|---|---|---|---|---|---|")
    for name, ran, method, changed, report, finding, _ in rows:
        print(f"| {name} | {ran} | {method} | {changed} | {report} | {finding} |")
    for name, *_, notes in rows:
        for note in notes:
            print(f"- {name}: {note}")


if __name__ == "__main__":
    main()
