"""benchmarks/public_gpu.py reproduces the published run of 2022: its pieces, checked on a tiny BERT."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from resource_guard.estimate.emulate.cuda_autocast import CudaAutocast


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).parents[2] / "benchmarks" / "public_gpu.py"
    spec = importlib.util.spec_from_file_location("public_gpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get("public_gpu")
    sys.modules["public_gpu"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        if saved is None:
            sys.modules.pop("public_gpu", None)
        else:
            sys.modules["public_gpu"] = saved


def test_the_softmax_of_torch_1_10_keeps_its_input_and_differentiates_as_softmax(bench):
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = bench._SoftmaxKeepingInput.apply(x, -1)
    assert len(saved) == 2 and saved[0] is x
    torch.testing.assert_close(y, torch.softmax(x, -1))
    assert torch.autograd.gradcheck(lambda t: bench._SoftmaxKeepingInput.apply(t, -1), (x,))


def test_adamw_hf_steps_as_torch_adamw_without_weight_decay(bench):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(a.detach().clone())
    ours, theirs = bench._AdamWHF([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        g = torch.randn(4, 3)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_the_trainer_optimizer_of_2022_clips_the_gradients_before_its_step(bench, name):
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = bench._trainer_optimizer(name, as_today=False)(params)
    for p in params:
        p.grad = torch.full_like(p, 10.0)
    opt.step()
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    assert norm == pytest.approx(1.0, rel=1e-4)
    today = bench._trainer_optimizer(name, as_today=True)(params)
    for p in params:
        p.grad = torch.full_like(p, 10.0)
    today.step()
    assert all(bool((p.grad == 10.0).all()) for p in params)


def test_the_attention_of_2022_keeps_a_float32_softmax_input_under_fp16_autocast(bench):
    from transformers import BertConfig, BertForSequenceClassification

    B, S, H = 2, 16, 4
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=H, intermediate_size=64,
        max_position_embeddings=S, attn_implementation="eager",
    )  # fmt: skip
    model = BertForSequenceClassification(config).train()
    batch = {"input_ids": torch.randint(0, 100, (B, S)), "labels": torch.zeros(B, dtype=torch.long)}

    def scores_kept() -> list[torch.dtype]:
        kept: dict[int, torch.dtype] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if tuple(t.shape) == (B, H, S, S):
                kept[id(t.untyped_storage())] = t.dtype
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), CudaAutocast(torch.float16):
            model(**batch).loss.backward()
        return sorted(kept.values(), key=str)

    assert scores_kept() == [torch.bool, torch.float32]  # today: softmax output, dropout mask
    with bench._bert_of_2022():
        assert scores_kept() == [torch.bool, torch.float32, torch.float32]  # and the softmax input
    from transformers.models.bert import modeling_bert

    assert modeling_bert.eager_attention_forward is not bench._attention_2022
