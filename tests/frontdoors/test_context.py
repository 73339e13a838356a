"""The plain-PyTorch front door: ``with guard(model, optimizer) as g``."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from resource_guard import ConfigurationError, DoesNotFitError, estimate_memory, guard
from resource_guard.devices import resolve_device
from resource_guard.estimate import device_fit


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


class Wide(nn.Module):
    """An MLP with a 16 MiB weight and ~64 KiB of activations a sample (no batch-dependent layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh())
        self.out = nn.Linear(2048, 1)
        self.forward_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_calls += 1
        return self.out(self.blocks(x))


def data(n_batches: int, batch_size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, 64, generator=g), torch.randn(batch_size, 1, generator=g))
        for _ in range(n_batches)
    ]


def run(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, **kwargs: Any) -> Any:
    kwargs = {"device": "cpu", "precision": "32-true", "monitor": False, "loss_fn": mse, **kwargs}
    with guard(model, optimizer, **kwargs) as g:
        for batch in g.iterate(loader):
            with g.autocast():
                loss = mse(model, batch)
            g.backward(loss)
    return g


def cap_between(micro: int, full: int) -> int:
    """A memory limit under which batch ``full`` does not fit and accumulating micro-batches of ``micro``
    does (10% headroom): their later micro-steps start with the gradients allocated."""
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cpu = resolve_device("cpu")
    small, big = (
        device_fit(
            estimate_memory(model, opt, data(1, b)[0], mse, device="cpu"), cpu, gradients_kept=kept
        ).device_total_bytes
        for b, kept in ((micro, True), (full, False))
    )
    assert small < big, "accumulation cannot fit where the full batch does not"
    return int((small + big) / 2 / 0.9)


def test_one_optimizer_step_per_batch_when_the_full_batch_fits() -> None:
    model = Wide()
    g = run(model, torch.optim.SGD(model.parameters(), lr=0.1), data(3, 8))
    assert g.plan is not None and (g.plan.micro_batch_size, g.plan.accumulation_steps) == (8, 1)
    assert (g.optimizer_steps, g.micro_steps) == (3, 3)
    assert g.device == torch.device("cpu")


def test_a_cap_forces_accumulation_and_the_step_equals_the_unsplit_batch() -> None:
    torch.manual_seed(0)
    model = Wide()
    reference = copy.deepcopy(model)
    batches = data(1, 1024)  # activations (~64 KiB a sample) outweigh the 16 MiB weight's gradient
    limit = cap_between(256, 1024)
    g = run(model, torch.optim.SGD(model.parameters(), lr=0.5), batches, memory_limit=limit)
    assert g.plan is not None
    assert g.plan.micro_batch_size < 1024 and g.plan.accumulation_steps > 1
    assert g.plan.micro_batch_size * g.plan.accumulation_steps == 1024
    assert g.micro_steps == g.plan.accumulation_steps and g.optimizer_steps == 1

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    mse(reference, batches[0]).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_effective_batch_can_span_several_loader_batches_and_a_partial_one_is_averaged() -> None:
    torch.manual_seed(0)
    model = Wide()
    reference = copy.deepcopy(model)
    batches = data(3, 8)
    g = run(model, torch.optim.SGD(model.parameters(), lr=0.5), batches, target_batch_size=16)
    # batches 1+2 make one effective batch of 16; batch 3 alone is a partial one (8 samples)
    assert (g.optimizer_steps, g.micro_steps) == (2, 3)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for chunk in ([batches[0], batches[1]], [batches[2]]):
        x = torch.cat([b[0] for b in chunk])
        y = torch.cat([b[1] for b in chunk])
        ref_opt.zero_grad()
        mse(reference, (x, y)).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_plan_is_made_lazily_from_the_first_batch() -> None:
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, loss_fn=mse, device="cpu", precision="32-true", monitor=False) as g:
        assert g.plan is None
        for batch in g.iterate(data(1, 4)):
            assert g.plan is not None and g.plan.target_batch_size == 4
            g.backward(mse(model, batch))


def test_nothing_fits_fails_at_enter_before_any_step(tmp_path: Path) -> None:
    model = Wide()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DoesNotFitError) as info:
        with guard(
            model,
            opt,
            sample_batch=data(1, 8)[0],
            loss_fn=mse,
            device="cpu",
            memory_limit="64KiB",
            log_dir=tmp_path,
        ):
            pytest.fail("the body must not run")
    message = str(info.value)
    assert message.startswith("Nothing fits cpu") and "needs" in message and "usable" in message
    assert info.value.report is not None
    assert model.forward_calls == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_the_users_exception_comes_out_unchanged_and_nothing_is_left_running(tmp_path: Path) -> None:
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    threads_before = set(threading.enumerate())
    boom = RuntimeError("boom")
    with pytest.raises(RuntimeError) as info:
        with guard(
            model, opt, loss_fn=mse, device="cpu", precision="32-true", log_dir=tmp_path, profile=False
        ) as g:
            for i, batch in enumerate(g.iterate(data(4, 8))):
                g.backward(mse(model, batch))
                if i == 1:
                    raise boom
    assert info.value is boom
    assert set(threading.enumerate()) <= threads_before
    summary = json.loads((tmp_path / "guard.json").read_text())
    assert summary["outcome"] == "RuntimeError" and summary["optimizer_steps"] == 2
    assert (tmp_path / "report.json").exists()


def test_keyboard_interrupt_passes_through(tmp_path: Path) -> None:
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyboardInterrupt):
        with guard(
            model, opt, loss_fn=mse, device="cpu", precision="32-true", monitor=False, log_dir=tmp_path
        ) as g:
            for _batch in g.iterate(data(2, 8)):
                raise KeyboardInterrupt
    assert json.loads((tmp_path / "guard.json").read_text())["outcome"] == "KeyboardInterrupt"


def test_gradients_are_clipped_before_the_step() -> None:
    torch.manual_seed(0)
    model = Wide()
    before = [p.detach().clone() for p in model.parameters()]
    run(model, torch.optim.SGD(model.parameters(), lr=1.0), data(1, 8), clip_grad_norm=1e-3)
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)])
    assert 0 < delta.norm() <= 1e-3 * (1 + 1e-4)


def test_16_mixed_uses_a_grad_scaler_and_trains() -> None:
    model = Wide()
    before = [p.detach().clone() for p in model.parameters()]
    g = run(model, torch.optim.SGD(model.parameters(), lr=0.1), data(2, 8), precision="16-mixed")
    assert g._scaler is not None and g.plan is not None and g.plan.precision == "16-mixed"
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_checkpointing_is_applied_in_the_run_and_removed_after() -> None:
    from resource_guard.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 64, (4, 9))
    loader = [(tokens[:, :-1], tokens[:, 1:])]

    def lm_loss(m: nn.Module, b: Any) -> torch.Tensor:
        return m(*b)

    with guard(
        model, opt, loss_fn=lm_loss, device="cpu", precision="32-true", checkpointing=True, monitor=False
    ) as g:
        for batch in g.iterate(loader):
            assert g.plan is not None and g.plan.checkpointing
            assert all("forward" in block.__dict__ for block in model.blocks)  # wrapped for the run
            g.backward(lm_loss(model, batch))
    assert g.optimizer_steps == 1
    assert all("forward" not in block.__dict__ for block in model.blocks)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_batch_size": 0}, r"target_batch_size=0"),
        ({"headroom": 0.95}, r"headroom=0.95.*\[0, 0.9\)"),
        ({"precision": "fp8"}, r"fp8"),
        ({"clip_grad_norm": -1.0}, r"clip_grad_norm"),
    ],
)
def test_bad_arguments_are_refused_in_the_constructor(kwargs: dict[str, Any], match: str) -> None:
    model = Wide()
    with pytest.raises(ConfigurationError, match=match):
        guard(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_a_non_module_or_a_non_optimizer_is_refused() -> None:
    model = Wide()
    with pytest.raises(ConfigurationError, match="torch.nn.Module"):
        guard(lambda x: x, torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="torch.optim.Optimizer"):
        guard(model, "adam")  # type: ignore[arg-type]


def test_an_unwritable_log_dir_is_refused_at_enter(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    model = Wide()
    with pytest.raises(ConfigurationError, match="not writable"):
        with guard(model, torch.optim.SGD(model.parameters(), lr=0.1), log_dir=blocker / "logs"):
            pass


def test_a_non_scalar_loss_is_refused() -> None:
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with guard(model, opt, loss_fn=mse, device="cpu", precision="32-true", monitor=False) as g:
        for x, _y in g.iterate(data(1, 4)):
            with pytest.raises(ConfigurationError, match="scalar loss"):
                g.backward(model(x))


def test_a_catalog_device_cannot_be_trained_on() -> None:
    model = Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="not a device on this machine"):
        with guard(model, opt, sample_batch=data(1, 4)[0], loss_fn=mse, device="a100-40gb", monitor=False):
            pass


def test_the_plain_pytorch_example_accumulates_under_its_cap(tmp_path: Path) -> None:
    import importlib.util

    path = Path(__file__).parents[2] / "examples" / "plain_pytorch.py"
    spec = importlib.util.spec_from_file_location("plain_pytorch_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--steps", "2", "--log-dir", str(tmp_path)])
    assert result["accumulation_steps"] > 1
    assert result["micro_batch_size"] * result["accumulation_steps"] == 32
    assert result["optimizer_steps"] == 2
    assert (tmp_path / "guard.json").exists() and (tmp_path / "report.md").exists()


def test_the_monitor_gets_the_model_flops_of_a_loader_batch(tmp_path: Path) -> None:
    from resource_guard.observe.throughput import count_flops

    model = Wide()
    expected = count_flops(copy.deepcopy(model), data(1, 8)[0], mse)
    g = run(model, torch.optim.SGD(model.parameters(), lr=0.1), data(3, 8), monitor=True, log_dir=tmp_path)
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert expected and summary["flops_per_step"] == pytest.approx(expected)
    assert g.report is not None


class LogitsLM(nn.Module):
    """Returns logits; the loop computes the loss (the commonest model there is)."""

    def __init__(self, vocab: int = 1000, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def test_a_logits_model_trains_through_guard_without_loss_fn() -> None:
    torch.manual_seed(0)
    model = LogitsLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randint(0, 1000, (16, 32), generator=g),) * 2 for _ in range(3)]
    before = model.head.weight.detach().clone()
    with guard(model, optimizer, device="cpu", precision="32-true", monitor=False) as gd:
        for tokens, targets in gd.iterate(loader):
            with gd.autocast():
                loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            gd.backward(loss)
    assert gd.optimizer_steps == 3
    assert not torch.equal(before, model.head.weight)
    assert gd.plan is not None
    stated = [r for r in gd.plan.reasons if r.startswith("loss: stand-in")]
    assert len(stated) == 1 and "pass loss_fn= for an exact estimate" in stated[0]
    assert gd.plan.summary().count("loss: stand-in") == 1


def test_with_loss_fn_or_a_model_that_returns_its_loss_no_standin_is_stated() -> None:
    from resource_guard.demo import TinyGPT

    def ce(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]).flatten(0, 1), batch[1].flatten())

    tokens = torch.randint(0, 100, (4, 8))
    cases = [(LogitsLM(vocab=100), ce), (TinyGPT(vocab_size=100, d_model=16, n_layers=1, seq_len=8), None)]
    for model, loss_fn in cases:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        kwargs = {"device": "cpu", "precision": "32-true", "monitor": False, "loss_fn": loss_fn}
        with guard(model, optimizer, **kwargs) as g:
            for batch in g.iterate([(tokens, tokens)]):
                g.backward(ce(model, batch) if loss_fn is not None else model(*batch))
        assert g.plan is not None and g.optimizer_steps == 1
        assert not any("stand-in" in r for r in g.plan.reasons)
