"""Libraries read values as in a real step while the step is traced (transformers' causal mask)."""

from __future__ import annotations

import threading

import pytest
import torch

from resource_guard.estimate import estimate_memory, measure_training_step
from resource_guard.estimate.result import TRACED
from resource_guard.estimate.trace.libraries import as_real_step
from resource_guard.planning.checkpointing import apply_checkpointing

transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    apply_checkpointing(model)  # the recomputed mask sits at the peak, in backward
    ids = torch.randint(1, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    return model, torch.optim.AdamW(model.parameters()), {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.cpu_reference
def test_a_checkpointed_llama_without_a_mask_is_traced_as_the_real_step_runs_it():
    # without `as_real_step` transformers saw a FakeTensor as "tracing" and built a 4-D causal mask that
    # the real step skips (SDPA's is_causal): +1.6% here
    model, opt, batch = _llama()
    est = estimate_memory(model, opt, batch, device="cpu")
    assert est.method == TRACED  # the mask made in the step (torch.ones) is a known small constant
    model, opt, batch = _llama()
    true = measure_training_step(model, opt, batch).peak_bytes
    assert est.peak_bytes == pytest.approx(true, rel=0.002)


def test_only_the_tracing_thread_sees_fake_tensors_as_real_and_the_original_comes_back():
    from transformers.utils import import_utils

    original = import_utils.is_fake_tensor
    with torch._subclasses.FakeTensorMode():
        fake = torch.empty(2)
    seen: list[bool] = []
    with as_real_step():
        assert import_utils.is_fake_tensor(fake) is False
        other = threading.Thread(target=lambda: seen.append(import_utils.is_fake_tensor(fake)))
        other.start()
        other.join()
    assert seen == [True] and import_utils.is_fake_tensor is original
    with pytest.raises(RuntimeError), as_real_step():
        raise RuntimeError("the step failed")
    assert import_utils.is_fake_tensor is original
