"""``guard(model, None)``: a loop that updates the parameters by hand (pytorch/examples'
word_language_model: ``model.zero_grad()``, ``loss.backward()``, ``p.data.add_(p.grad, alpha=-lr)``), left
unchanged. Real CPU loops of tiny models."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from resource_guard import guard
from resource_guard.errors import ConfigurationError
from resource_guard.estimate.host.measure import allocation_deltas, live_bytes, peak_of
from resource_guard.estimate.host.quiet import quiet_profile

VOCAB, WIDTH, SEQ, BATCH, LR = 2048, 32, 16, 6, 0.5


class WordLM(nn.Module):
    """word_language_model's RNNModel in small: embedding, LSTM, decoder, ``log_softmax`` of flat logits."""

    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.LSTM(WIDTH, WIDTH, num_layers=2, batch_first=batch_first)
        self.decoder = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, hidden: Any = None) -> tuple[torch.Tensor, Any]:
        output, hidden = self.rnn(self.encoder(x), hidden)
        return F.log_softmax(self.decoder(output).view(-1, VOCAB), dim=1), hidden


def batches(steps: int, batch_first: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        x, y = data[:, :-1], data[:, 1:]
        if not batch_first:  # word_language_model's batchify: (seq, batch), targets flattened
            x, y = x.t().contiguous(), y.t().contiguous()
        out.append((x.contiguous(), y.reshape(-1)))
    return out


def manual_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, hidden: Any = None, zero: bool = True
) -> tuple[float, Any]:
    """One step as word_language_model's train() writes it."""
    if zero:
        model.zero_grad()
    output, hidden = model(x, hidden)
    loss = F.nll_loss(output, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-LR)
    return loss.item(), tuple(h.detach() for h in hidden)


def manual_loop(model: nn.Module, steps: int, batch_first: bool = True, carry: bool = False) -> list[float]:
    losses, hidden = [], None
    for x, y in batches(steps, batch_first):
        loss, hidden = manual_step(model, x, y, hidden if carry else None)
        losses.append(loss)
    return losses


def fresh(batch_first: bool = True) -> WordLM:
    torch.manual_seed(0)
    return WordLM(batch_first)


def real_peak_bytes(model: nn.Module, steps: int = 2, batch_first: bool = True) -> int:
    """The real CPU peak of a steady-state step of the loop as written (torch.profiler's memory records),
    from its ``model.zero_grad()`` on: the profiler does not see the frees of the last step's gradients,
    allocated before it started, so they are freed first."""
    (x, y), *_ = batches(1, batch_first)
    manual_step(model, x, y)
    model.zero_grad()
    gc.collect()
    start = live_bytes(model, (x, y))
    with quiet_profile() as prof:
        manual_step(model, x, y, zero=False)
    return start + peak_of(allocation_deltas(prof))


def test_guard_takes_no_optimizer_and_the_loop_runs_as_written(tmp_path: Path) -> None:
    alone = manual_loop(fresh(), steps=4)
    model = fresh()
    with guard(model, None, log_dir=tmp_path, profile=False) as g:
        guarded = manual_loop(model, steps=4)
    assert guarded == alone  # bit for bit: nothing applied
    assert g.optimizer_steps == 4 and g.micro_steps == 4
    assert g.plan is not None and g.plan.micro_batch_size == BATCH and g.plan.precision == "32-true"
    assert any("manual updates" in r for r in g.plan.reasons)
    observed = json.loads((tmp_path / "guard.json").read_text())["observed"]
    assert (observed["optimizer_steps"], observed["forwards"], observed["accumulation"]) == (4, 4, 1)
    assert observed["steps_counted"] == "a backward, then the next forward"
    assert observed["samples_per_step"] == BATCH


def test_guard_model_alone_is_manual_updates_too() -> None:
    model = fresh()
    with guard(model, monitor=False) as g:
        manual_loop(model, steps=3)
    assert g.optimizer_steps == 3 and g.optimizers == ()


def test_the_manual_loops_peak_is_predicted_within_2_percent_never_under() -> None:
    model = fresh()
    with guard(model, None, monitor=False) as g:
        manual_loop(model, steps=1)
    assert g.plan is not None
    predicted = g.plan.fit.allocated_peak_bytes
    real = real_peak_bytes(fresh())
    assert real <= predicted <= real * 1.02, (predicted, real)
    # no optimizer state in the plan
    assert g.plan.estimate.breakdown.get("optimizer_state", 0) == 0


def test_evaluation_and_no_backward_are_not_steps() -> None:
    model = fresh()
    (x, y), *_ = batches(1)
    with guard(model, monitor=False) as g:
        manual_step(model, x, y)
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
        manual_step(model, x, y)
    assert g.optimizer_steps == 2 and g.micro_steps == 2


@pytest.mark.parametrize("bad", ["sgd", 3])
def test_a_wrong_optimizer_names_optimizer_none(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"optimizer=None` for a loop that updates the parameters"):
        guard(fresh(), bad)


def test_g_iterate_without_an_optimizer_is_refused_before_any_step() -> None:
    model = fresh()
    before = [p.detach().clone() for p in model.parameters()]
    with (
        guard(model, None, monitor=False) as g,
        pytest.raises(ConfigurationError, match="no optimizer to step"),
    ):
        for _ in g.iterate(batches(2)):
            pass
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ConfigurationError, match="Remove `sample_batch=`"):
        guard(model, None, sample_batch=batches(1)[0])


# -- the batch dimension: sequence-first loops -------------------------------------------------------


def seq_first_loop(model: nn.Module, steps: int) -> list[float]:
    """word_language_model's loop: (seq, batch) ids, the hidden state carried (detached), flat targets."""
    return manual_loop(model, steps, batch_first=False, carry=True)


def test_a_sequence_first_loop_gets_its_batch_size_from_the_model(tmp_path: Path) -> None:
    alone = seq_first_loop(fresh(batch_first=False), steps=3)
    model = fresh(batch_first=False)
    with guard(model, log_dir=tmp_path, profile=False) as g:  # no batch_dim: the LSTM says so
        guarded = seq_first_loop(model, steps=3)
    assert guarded == alone
    assert g.plan is not None and g.plan.target_batch_size == BATCH and g.plan.micro_batch_size == BATCH
    assert any("LSTM (batch_first=False)" in r and "dim 1" in r for r in g.plan.reasons)
    observed = json.loads((tmp_path / "guard.json").read_text())["observed"]
    assert observed["samples_per_step"] == BATCH and observed["optimizer_steps"] == 3


def test_the_sequence_first_peak_is_predicted_within_2_percent_never_under() -> None:
    model = fresh(batch_first=False)
    with guard(model, monitor=False) as g:
        seq_first_loop(model, steps=1)
    assert g.plan is not None
    predicted = g.plan.fit.allocated_peak_bytes
    real = real_peak_bytes(fresh(batch_first=False), batch_first=False)
    assert real <= predicted <= real * 1.02, (predicted, real)


class TransposesItself(nn.Module):
    """Batch-first inputs, a sequence-first LSTM inside (the model transposes them itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        out, _ = self.rnn(x.transpose(0, 1))
        return self.head(out[-1])


@pytest.mark.parametrize("how", ["declared", "inputs"])
def test_batch_first_inputs_to_a_sequence_first_layer(how: str) -> None:
    """``batch_dim=0`` overrules the model's layer; so do inputs that share dim 0 but not dim 1."""
    model = TransposesItself()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(5, 12, 4), torch.randn(5, 1)
    inputs = (x,) if how == "declared" else (x, torch.full((5,), 12))
    with guard(model, optimizer, monitor=False, batch_dim=0 if how == "declared" else None) as g:
        F.mse_loss(model(*inputs), y).backward()
        optimizer.step()
    assert g.plan is not None and g.plan.target_batch_size == 5


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 1), nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum() + self.b(z).sum()


def test_an_ambiguous_batch_is_refused_before_any_step_naming_batch_dim() -> None:
    model = TwoInputs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with (
        pytest.raises(ConfigurationError, match=r"cannot tell the batch size.*batch_dim=1") as caught,
        guard(model, optimizer, monitor=False),
    ):
        model(torch.randn(4, 3), torch.randn(6, 3)).backward()
        optimizer.step()
    assert "EmbeddingBag" not in str(caught.value)  # the model has none
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_declared_batch_dim_that_the_inputs_do_not_have_is_refused() -> None:
    model = fresh()  # batch-first, (6, 16) ids: dim 1 is 16, the flat targets are not fed to the model
    with pytest.raises(ConfigurationError, match=r"`batch_dim=1` declared"), guard(model, None, batch_dim=1):
        model(torch.zeros(6, 16, dtype=torch.long), (torch.zeros(2, 5, 32), torch.zeros(2, 5, 32)))


@pytest.mark.parametrize("bad", [2, -1, "1", True, 1.0])
def test_batch_dim_is_checked_in_the_constructor(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"`guard\(batch_dim={bad!r}\)` must be None"):
        guard(fresh(), None, batch_dim=bad)


def test_g_iterate_with_batch_dim_1_is_refused_before_any_step() -> None:
    model = fresh()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        guard(model, optimizer, batch_dim=1, monitor=False) as g,
        pytest.raises(ConfigurationError, match="cuts batches along dim 0"),
    ):
        for _ in g.iterate(batches(2)):
            pass
