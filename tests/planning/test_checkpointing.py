"""Activation checkpointing switch: which blocks, exact restore, recomputation, deepcopy, estimates."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from cpu_reference import measure_reference
from resource_guard import ConfigurationError
from resource_guard.estimate import estimate_memory
from resource_guard.planning.checkpointing import apply_checkpointing, find_checkpoint_blocks


class Block(nn.Module):
    """A residual MLP block that counts its forward calls."""

    def __init__(self, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.calls += 1
        return x + scale * self.down(torch.nn.functional.gelu(self.up(x)))


class Deep(nn.Module):
    def __init__(self, depth: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.small = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))  # same class, fewer parameters
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.small[0](self.stem(x))
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(self.small[1](x))


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _attrs(model: nn.Module) -> dict[str, dict[str, object]]:
    """Every module's attributes and hook tables, by identity and content."""
    out = {}
    for name, m in model.named_modules():
        entry = {k: v for k, v in m.__dict__.items() if not k.endswith("hooks") and k != "calls"}
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            entry[hooks] = tuple(getattr(m, hooks).keys())
        out[name] = entry
    return out


def _same(a: dict[str, dict[str, object]], b: dict[str, dict[str, object]]) -> bool:
    if a.keys() != b.keys():
        return False
    for name in a:
        if a[name].keys() != b[name].keys():
            return False
        for key, value in a[name].items():
            other = b[name][key]
            if value is not other and not (isinstance(value, tuple) and value == other):
                return False
    return True


# -- which blocks --------------------------------------------------------------------------------------
def test_finds_the_same_class_container_with_most_parameters():
    assert find_checkpoint_blocks(Deep(depth=3)) == ("blocks.0", "blocks.1", "blocks.2")


def test_top_level_sequential_of_same_blocks_is_found():
    model = nn.Sequential(*(Block() for _ in range(3)))
    assert find_checkpoint_blocks(model) == ("0", "1", "2")


def test_mixed_classes_and_parameterless_containers_are_not_blocks():
    assert find_checkpoint_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))) == ()
    assert find_checkpoint_blocks(nn.Sequential(nn.ReLU(), nn.ReLU())) == ()
    with pytest.raises(ConfigurationError, match="no repeated blocks"):
        apply_checkpointing(nn.Linear(3, 3))
    with pytest.raises(ConfigurationError, match="torch.nn.Module"):
        apply_checkpointing("model")  # type: ignore[arg-type]


# -- behaviour -----------------------------------------------------------------------------------------
def test_checkpointed_blocks_recompute_in_backward_and_give_the_same_gradients():
    torch.manual_seed(0)
    model = Deep()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 32)
    _loss(reference, x).backward()

    handle = apply_checkpointing(model)
    assert handle.method == "wrap" and handle.active
    assert handle.modules == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    _loss(model, x).backward()
    assert [b.calls for b in model.blocks] == [2, 2, 2, 2]  # forward, then again in backward
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)

    with torch.no_grad():  # no graph: no checkpoint, one call
        model(x)
    assert [b.calls for b in model.blocks] == [3, 3, 3, 3]
    model.eval()
    _loss(model, x)
    assert [b.calls for b in model.blocks] == [4, 4, 4, 4]


def test_remove_restores_the_model_exactly_and_is_idempotent():
    model = Deep()
    before = _attrs(model)
    keys = list(model.state_dict())
    handle = apply_checkpointing(model)
    assert list(model.state_dict()) == keys  # no renamed parameters
    assert not _same(before, _attrs(model))
    handle.remove()
    handle.remove()
    assert _same(before, _attrs(model)) and not handle.active
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_an_instance_forward_set_before_is_wrapped_and_put_back():
    model = Deep(depth=2)
    custom = model.blocks[0].forward  # a bound method stored on the instance, as some libraries do
    model.blocks[0].forward = custom  # type: ignore[method-assign]
    with apply_checkpointing(model):
        _loss(model, torch.randn(2, 32)).backward()
        assert model.blocks[0].calls == 2
    assert model.blocks[0].__dict__["forward"] is custom
    assert "forward" not in model.blocks[1].__dict__


def test_checkpointing_survives_deepcopy_and_pickle_on_the_copy():
    model = Deep(depth=2)
    handle = apply_checkpointing(model)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        _loss(twin, torch.randn(3, 32)).backward()
        assert [b.calls for b in twin.blocks] == [2, 2]  # the copy's blocks recompute themselves
        assert [b.calls for b in model.blocks] == [0, 0]  # and never call the original
    handle.remove()


@pytest.mark.cpu_reference
def test_estimate_with_checkpointing_is_lower_and_matches_a_real_step():
    def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
        torch.manual_seed(0)
        model = Deep(depth=6)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(64, 32)

    model, opt, x = build()
    plain = estimate_memory(model, opt, x, _loss, device="cpu")
    with apply_checkpointing(model):
        ckpt = estimate_memory(model, opt, x, _loss, device="cpu")
    assert ckpt.peak_bytes < plain.peak_bytes
    model, opt, x = build()
    apply_checkpointing(model)
    real = measure_reference(ckpt, model, opt, x, _loss)
    assert abs(ckpt.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes


# -- transformers models use their own switch ----------------------------------------------------------
def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        use_cache=False,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(cfg)


def test_transformers_model_uses_its_own_switch_and_is_restored_exactly():
    model = _tiny_gpt2()
    before = _attrs(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning from the switch we call
        handle = apply_checkpointing(model)
    assert handle.method == "transformers"
    assert handle.modules == ("transformer.h.0", "transformer.h.1") == find_checkpoint_blocks(model)
    assert all(model.get_submodule(n).gradient_checkpointing for n in handle.modules)
    ids = torch.randint(0, 64, (2, 8))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    assert _same(before, _attrs(model))
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_transformers_checkpointing_switched_on_by_the_user_is_left_on():
    model = _tiny_gpt2()
    model.activation_checkpointing_enable()
    handle = apply_checkpointing(model)
    assert not handle.active and handle.modules == ("transformer.h.0", "transformer.h.1")
    handle.remove()
    assert model.get_submodule("transformer.h.0").gradient_checkpointing is True
