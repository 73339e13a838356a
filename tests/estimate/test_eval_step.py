"""The evaluation step's estimate: what is resident (parameters, optimizer state, gradients), eval mode
under no_grad, and agreement with a real CPU evaluation step (within 3%, never under)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cpu_reference import reference_checked, skip_unless_cpu_runs
from resource_guard import ConfigurationError
from resource_guard.estimate import estimate_memory
from resource_guard.estimate.eval_step import EVAL_PHASE, estimate_eval_memory, measure_eval_step

F32 = 4


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 1000))
    return model, (torch.randn(64, 64), torch.randint(0, 1000, (64,))), _ce


def _conv():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    return model, (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))), _ce


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 1000, (4, 64))
    return model, {"input_ids": ids, "labels": ids}, None


BUILDS = [_mlp, _conv, _gpt2]
IDS = ["mlp-dropout", "conv-batchnorm", "gpt2"]


def _check(build, precision: str, with_optimizer: bool, kept: bool) -> None:
    model, batch, loss_fn = build()
    opt = torch.optim.AdamW(model.parameters()) if with_optimizer else None
    est = estimate_eval_memory(
        model, batch, loss_fn, optimizer=opt, gradients_kept=kept, precision=precision, device="cpu"
    )
    assert est.traced, est.warnings
    skip_unless_cpu_runs(est)
    real = copy.deepcopy(model)
    real_opt = torch.optim.AdamW(real.parameters()) if with_optimizer else None
    with reference_checked(est):
        truth = measure_eval_step(
            real, batch, loss_fn, optimizer=real_opt, gradients_kept=kept, precision=precision
        )
    error = est.peak_bytes / truth.peak_bytes - 1
    assert 0 <= error <= 0.03, (est.peak_bytes, truth.peak_bytes, error)


@pytest.mark.cpu_reference
@pytest.mark.parametrize(
    "build", [_mlp, _conv, pytest.param(_gpt2, marks=pytest.mark.slow)], ids=IDS
)  # a GPT-2 training step, then an eval step, measured for real: a few seconds each
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_eval_estimate_matches_real_cpu_eval_step_in_fit(build, precision):
    """Lightning's fit validates with the optimizer state and every gradient resident."""
    _check(build, precision, with_optimizer=True, kept=True)


@pytest.mark.cpu_reference
@pytest.mark.parametrize("build", BUILDS, ids=IDS)
def test_eval_estimate_matches_real_cpu_eval_step_alone(build):
    """`trainer.validate` / a plain loop after `zero_grad()`: parameters only."""
    _check(build, "32-true", with_optimizer=False, kept=False)


def test_resident_categories_are_counted_by_hand():
    model = nn.Linear(512, 512, bias=False)
    p_bytes = 512 * 512 * F32
    batch = torch.randn(8, 512)
    alone = estimate_eval_memory(model, batch, device="cpu")
    assert alone.peak_phase == EVAL_PHASE
    assert alone.breakdown["parameters"] == p_bytes
    assert alone.breakdown["gradients"] == alone.breakdown["optimizer_state"] == 0
    assert alone.breakdown["inputs"] == 8 * 512 * F32
    assert alone.breakdown["activations"] == 8 * 512 * F32  # the output, nothing saved for backward
    in_fit = estimate_eval_memory(
        model, batch, optimizer=torch.optim.AdamW(model.parameters()), gradients_kept=True, device="cpu"
    )
    assert in_fit.breakdown["gradients"] == p_bytes
    assert in_fit.breakdown["optimizer_state"] == 2 * p_bytes + F32  # exp_avg, exp_avg_sq, step
    assert in_fit.peak_bytes == alone.peak_bytes + 3 * p_bytes + F32
    assert "optimizer state, gradients" in in_fit.assumed_target


def test_gradients_default_to_those_the_model_holds():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    batch = torch.randn(4, 64)
    assert estimate_eval_memory(model, batch, device="cpu").breakdown["gradients"] == 0
    model[0](batch).sum().backward()  # only the first layer has gradients now
    held = estimate_eval_memory(model, batch, device="cpu").breakdown["gradients"]
    assert held == (64 * 64 + 64) * F32


def test_eval_step_is_far_below_the_training_step_and_leaves_the_model_alone():
    model, batch, loss_fn = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    before = copy.deepcopy(model.state_dict())
    train = estimate_memory(model, opt, batch, loss_fn, device="cpu")
    ev = estimate_eval_memory(model, batch, loss_fn, optimizer=opt, gradients_kept=True, device="cpu")
    # same resident state; no activations kept for backward
    assert ev.persistent_bytes == train.persistent_bytes
    assert ev.peak_bytes < train.peak_bytes
    assert model.training and not opt.state and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.is_grad_enabled()


def test_bigger_eval_batch_costs_more():
    model, (x, y), loss_fn = _mlp()
    small = estimate_eval_memory(model, (x[:8], y[:8]), loss_fn, device="cpu").peak_bytes
    large = estimate_eval_memory(model, (x, y), loss_fn, device="cpu").peak_bytes
    assert large > small


def test_frozen_model_is_estimated():
    model = nn.Linear(32, 32).requires_grad_(False)
    est = estimate_eval_memory(model, torch.randn(4, 32), gradients_kept=True, device="cpu")
    assert est.breakdown["gradients"] == 0 and est.traced


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "nope"}, r"estimate_eval_memory\(model=...\)"),
        ({"batch": None}, r"estimate_eval_memory\(batch=None\)"),
        ({"gradients_kept": "yes"}, r"gradients_kept='yes'"),
        ({"optimizer": 3}, r"estimate_eval_memory\(optimizer=...\)"),
        ({"loss_fn": 3}, r"loss_fn=3"),
    ],
)
def test_bad_arguments_are_refused_with_the_call(kwargs, match):
    args = {"model": nn.Linear(4, 4), "batch": torch.randn(2, 4)} | kwargs
    with pytest.raises(ConfigurationError, match=match):
        estimate_eval_memory(**args)
