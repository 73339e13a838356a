"""Benchmark cases: training steps of models defined outside this package, built from configs.

Every entry of :data:`CASES` is a zero-argument function that builds, from scratch and seeded (two
calls give identical models, optimizers and batches), a tuple ``(model, optimizer, batch, loss_fn)``
where ``loss_fn`` is ``None`` when the model computes its own loss (transformers models given
``labels``). Models are in train mode, with random initialisation (no weights are downloaded) and
sized so that one real CPU step takes well under a few seconds.

Keys are ``"<model>/<precision>"`` or ``"<model>/ckpt/<precision>"`` (activation checkpointing);
:func:`precision_of` returns the precision part. ``*-mixed`` precisions keep fp32 parameters (the step
itself runs under autocast); ``*-true`` precisions other than ``32-true`` cast the model.

Attention implementation, chosen explicitly per transformers model (alternating so both code paths
are covered):

=============  ======  =============================================
model          attn    notes
=============  ======  =============================================
gpt2           sdpa    GPT2LMHeadModel, labels = input ids
bert-mlm       eager   BertForMaskedLM, 15% of positions labelled
bert-cls       sdpa    BertForSequenceClassification, SGD momentum
llama          sdpa    LlamaForCausalLM, MHA
qwen2          eager   Qwen2ForCausalLM, grouped-query attention
t5             eager   T5ForConditionalGeneration, labels = targets
vit            sdpa    ViTForImageClassification
resnet         --      ResNetForImageClassification (no checkpointing support in transformers)
=============  ======  =============================================

torch.nn models: ``lstm`` (LSTM language model), ``gru`` (bidirectional GRU classifier), ``convbn``
(conv + BatchNorm net, SGD momentum), ``nn-transformer`` (``nn.TransformerEncoderLayer`` stack); each
takes a ``checkpoint`` flag that wraps its repeated blocks in ``torch.utils.checkpoint``
(``use_reentrant=False``) inside ``forward``.

Dropout is left at each config's default: which elements are dropped is random, but the bytes
(masks and outputs) are not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# the library's own fd-level silencing (re-exported for the benchmarks that measure with the profiler)
from resource_guard.estimate.host.quiet import native_stderr_silenced

__all__ = [
    "CASES",
    "MODELS",
    "Built",
    "precision_of",
    "is_checkpointed",
    "model_of",
    "native_stderr_silenced",
]

Built = tuple[nn.Module, torch.optim.Optimizer, Any, "Callable[[nn.Module, Any], Any] | None"]

SEED = 1234
PRECISIONS = ("32-true", "bf16-mixed")
_TRUE_DTYPES = {"32-true": torch.float32, "16-true": torch.float16, "bf16-true": torch.bfloat16}


# ----------------------------------------------------------------------------------------------------
# helpers


def _gen(offset: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + 1000 + offset)


def _tokens(vocab: int, *shape: int, offset: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=_gen(offset))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _finish(model: nn.Module, precision: str) -> nn.Module:
    """Cast for ``*-true`` precisions and put the model in train mode."""
    dtype = _TRUE_DTYPES.get(precision, torch.float32)
    if dtype != torch.float32:
        model.to(dtype)
    return model.train()


def _hf(model: nn.Module, ckpt: bool, precision: str) -> nn.Module:
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _finish(model, precision)


def _maybe_ckpt(block: nn.Module, use: bool, *args: Any) -> Any:
    if use:
        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


# ----------------------------------------------------------------------------------------------------
# transformers models


def gpt2(ckpt: bool = False, precision: str = "32-true") -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    cfg = GPT2Config(
        vocab_size=8192,
        n_positions=256,
        n_embd=256,
        n_layer=4,
        n_head=4,
        bos_token_id=8191,
        eos_token_id=8191,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = _hf(GPT2LMHeadModel(cfg), ckpt, precision)
    ids = _tokens(cfg.vocab_size, 4, 128)
    return model, _adamw(model), {"input_ids": ids, "labels": ids.clone()}, None


def bert_mlm(ckpt: bool = False, precision: str = "32-true") -> Built:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(SEED)
    cfg = BertConfig(
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    model = _hf(BertForMaskedLM(cfg), ckpt, precision)
    ids = _tokens(cfg.vocab_size, 4, 128)
    labels = torch.where(torch.rand(ids.shape, generator=_gen(1)) < 0.15, ids, torch.full_like(ids, -100))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "labels": labels,
    }
    return model, _adamw(model), batch, None


def bert_cls(ckpt: bool = False, precision: str = "32-true") -> Built:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(SEED)
    cfg = BertConfig(
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=256,
        num_labels=3,
        attn_implementation="sdpa",
    )
    model = _hf(BertForSequenceClassification(cfg), ckpt, precision)
    ids = _tokens(cfg.vocab_size, 8, 128)
    mask = torch.ones_like(ids)
    mask[:, 96:] = 0  # padded tail: exercises the attention-mask path
    batch = {"input_ids": ids, "attention_mask": mask, "labels": _tokens(3, 8, offset=1)}
    return model, _sgd(model), batch, None


def llama(ckpt: bool = False, precision: str = "32-true") -> Built:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = _hf(LlamaForCausalLM(cfg), ckpt, precision)
    ids = _tokens(cfg.vocab_size, 4, 128)
    return model, _adamw(model), {"input_ids": ids, "labels": ids.clone()}, None


def qwen2(ckpt: bool = False, precision: str = "32-true") -> Built:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    cfg = Qwen2Config(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    model = _hf(Qwen2ForCausalLM(cfg), ckpt, precision)
    ids = _tokens(cfg.vocab_size, 4, 128)
    return model, _adamw(model), {"input_ids": ids, "labels": ids.clone()}, None


def t5(ckpt: bool = False, precision: str = "32-true") -> Built:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(SEED)
    cfg = T5Config(
        vocab_size=8192,
        d_model=256,
        d_kv=32,
        d_ff=1024,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        use_cache=False,
        attn_implementation="eager",
    )
    model = _hf(T5ForConditionalGeneration(cfg), ckpt, precision)
    batch = {
        "input_ids": _tokens(cfg.vocab_size, 4, 128),
        "attention_mask": torch.ones(4, 128, dtype=torch.long),
        "labels": _tokens(cfg.vocab_size, 4, 32, offset=1),
    }
    return model, _adamw(model), batch, None


def vit(ckpt: bool = False, precision: str = "32-true") -> Built:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(SEED)
    cfg = ViTConfig(
        image_size=64,
        patch_size=8,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        num_labels=10,
        attn_implementation="sdpa",
    )
    model = _hf(ViTForImageClassification(cfg), ckpt, precision)
    batch = {
        "pixel_values": torch.randn(8, 3, 64, 64, generator=_gen()),
        "labels": _tokens(10, 8, offset=1),
    }
    return model, _adamw(model), batch, None


def resnet(ckpt: bool = False, precision: str = "32-true") -> Built:
    from transformers import ResNetConfig, ResNetForImageClassification

    if ckpt:
        raise ValueError("transformers' ResNet does not support gradient checkpointing")
    torch.manual_seed(SEED)
    cfg = ResNetConfig(
        num_channels=3,
        embedding_size=32,
        hidden_sizes=[32, 64, 128, 256],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        num_labels=10,
    )
    model = _hf(ResNetForImageClassification(cfg), False, precision)
    batch = {
        "pixel_values": torch.randn(8, 3, 64, 64, generator=_gen()),
        "labels": _tokens(10, 8, offset=1),
    }
    return model, _adamw(model), batch, None


# ----------------------------------------------------------------------------------------------------
# torch.nn models (loss computed by an explicit loss_fn)


def _token_ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["x"])
    return F.cross_entropy(logits.flatten(0, -2), batch["y"].flatten())


class LSTMLanguageModel(nn.Module):
    """Embedding → stacked single-layer LSTMs (one module per layer) → linear head over the vocab."""

    def __init__(self, vocab: int = 4096, dim: int = 128, hidden: int = 256, layers: int = 3) -> None:
        super().__init__()
        self.checkpoint = False
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.LSTM(dim if i == 0 else hidden, hidden, batch_first=True) for i in range(layers)
        )
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = _maybe_ckpt(_FirstOutput(layer), self.checkpoint, h)
        return self.head(self.drop(h))


class GRUClassifier(nn.Module):
    """Frame features → projection → stacked bidirectional GRUs → mean pool → linear classifier."""

    def __init__(self, features: int = 64, hidden: int = 192, layers: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.checkpoint = False
        self.proj = nn.Linear(features, hidden)
        self.layers = nn.ModuleList(
            nn.GRU(hidden if i == 0 else 2 * hidden, hidden, batch_first=True, bidirectional=True)
            for i in range(layers)
        )
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        for layer in self.layers:
            h = _maybe_ckpt(_FirstOutput(layer), self.checkpoint, h)
        return self.head(h.mean(dim=1))


class _FirstOutput(nn.Module):
    """Wrap an RNN so that calling it returns only its output sequence (checkpoint-friendly)."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


class ConvBNBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)))


class ConvBNNet(nn.Module):
    """A plain VGG-style conv + BatchNorm net with global average pooling."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128, 128), classes: int = 10) -> None:
        super().__init__()
        self.checkpoint = False
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0])
        )
        chans = [widths[0], *widths]
        self.blocks = nn.ModuleList(
            ConvBNBlock(chans[i], chans[i + 1], 1 if i == 0 else 2) for i in range(len(widths))
        )
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        for block in self.blocks:
            h = _maybe_ckpt(block, self.checkpoint, h)
        return self.head(h.mean(dim=(2, 3)))


class NNTransformerTagger(nn.Module):
    """Embedding → ``nn.TransformerEncoderLayer`` stack (pre-norm, GELU) → per-token classifier."""

    def __init__(self, vocab: int = 4096, dim: int = 256, layers: int = 4, classes: int = 32) -> None:
        super().__init__()
        self.checkpoint = False
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, nhead=4, dim_feedforward=4 * dim, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = _maybe_ckpt(layer, self.checkpoint, h)
        return self.head(self.norm(h))


def lstm(ckpt: bool = False, precision: str = "32-true") -> Built:
    torch.manual_seed(SEED)
    model = LSTMLanguageModel()
    model.checkpoint = ckpt
    model = _finish(model, precision)
    x = _tokens(4096, 8, 65)
    batch = {"x": x[:, :-1].contiguous(), "y": x[:, 1:].contiguous()}
    return model, _adamw(model), batch, _token_ce


def _clip_ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def gru(ckpt: bool = False, precision: str = "32-true") -> Built:
    torch.manual_seed(SEED)
    model = GRUClassifier()
    model.checkpoint = ckpt
    model = _finish(model, precision)
    dtype = _TRUE_DTYPES.get(precision, torch.float32)
    batch = {"x": torch.randn(8, 100, 64, generator=_gen()).to(dtype), "y": _tokens(10, 8, offset=1)}
    return model, _adamw(model), batch, _clip_ce


def convbn(ckpt: bool = False, precision: str = "32-true") -> Built:
    torch.manual_seed(SEED)
    model = ConvBNNet()
    model.checkpoint = ckpt
    model = _finish(model, precision)
    dtype = _TRUE_DTYPES.get(precision, torch.float32)
    batch = (torch.randn(16, 3, 64, 64, generator=_gen()).to(dtype), _tokens(10, 16, offset=1))
    return model, _sgd(model), batch, _image_ce


def _image_ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def nn_transformer(ckpt: bool = False, precision: str = "32-true") -> Built:
    torch.manual_seed(SEED)
    model = NNTransformerTagger()
    model.checkpoint = ckpt
    model = _finish(model, precision)
    batch = {"x": _tokens(4096, 4, 128), "y": _tokens(32, 4, 128, offset=1)}
    return model, _adamw(model), batch, _token_ce


# ----------------------------------------------------------------------------------------------------
# registry

#: model name → (builder, supports activation checkpointing)
MODELS: dict[str, tuple[Callable[..., Built], bool]] = {
    "gpt2": (gpt2, True),
    "bert-mlm": (bert_mlm, True),
    "bert-cls": (bert_cls, True),
    "llama": (llama, True),
    "qwen2": (qwen2, True),
    "t5": (t5, True),
    "vit": (vit, True),
    "resnet": (resnet, False),
    "lstm": (lstm, True),
    "gru": (gru, True),
    "convbn": (convbn, True),
    "nn-transformer": (nn_transformer, True),
}


def _make_cases() -> dict[str, Callable[[], Built]]:
    cases: dict[str, Callable[[], Built]] = {}
    for name, (builder, ckpt_ok) in MODELS.items():
        for precision in PRECISIONS:
            cases[f"{name}/{precision}"] = functools.partial(builder, ckpt=False, precision=precision)
        if ckpt_ok:
            cases[f"{name}/ckpt/32-true"] = functools.partial(builder, ckpt=True, precision="32-true")
    # checkpointing under autocast, on a few models where the recomputation runs in bf16
    for name in ("gpt2", "llama", "convbn"):
        builder = MODELS[name][0]
        cases[f"{name}/ckpt/bf16-mixed"] = functools.partial(builder, ckpt=True, precision="bf16-mixed")
    return dict(sorted(cases.items(), key=lambda kv: list(MODELS).index(model_of(kv[0]))))


def precision_of(name: str) -> str:
    """The precision a case runs at: the last ``/`` part of its name."""
    return name.rsplit("/", 1)[-1]


def is_checkpointed(name: str) -> bool:
    """Whether the case uses activation checkpointing."""
    return "/ckpt/" in name


def model_of(name: str) -> str:
    """The model part of a case name."""
    return name.split("/", 1)[0]


CASES: dict[str, Callable[[], Built]] = _make_cases()
