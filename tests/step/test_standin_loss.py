"""The stand-in loss the front doors plan from when the loop computes the loss itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from resource_guard import ConfigurationError, estimate_memory
from resource_guard.step.training import StandInLoss


class Classifier(nn.Module):
    def __init__(self, classes: int = 200) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.head = nn.Linear(256, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class LogitsLM(nn.Module):
    """A small decoder LM whose forward returns the logits (the loop computes the loss)."""

    def __init__(self, vocab: int = 1000, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


CASES = {
    "classifier": (Classifier, lambda: (torch.randn(32, 64), torch.randint(0, 200, (32,)))),
    "lm": (LogitsLM, lambda: (torch.randint(0, 1000, (8, 32)), torch.randint(0, 1000, (8, 32)))),
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_standin_estimate_is_close_to_and_not_below_cross_entropy(
    case: str, device: str, precision: str
) -> None:
    build, batch_of = CASES[case]
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = batch_of()
    exact = estimate_memory(model, optimizer, batch, ce, precision=precision, device=device)
    standin = StandInLoss()
    est = estimate_memory(model, optimizer, batch, standin, precision=precision, device=device)
    assert standin.used
    assert est.method == exact.method == "traced"
    assert exact.peak_bytes <= est.peak_bytes <= exact.peak_bytes * 1.03


def test_a_model_that_returns_its_loss_is_used_exactly() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.lin(x)
            return {"loss": F.cross_entropy(logits, y), "logits": logits}

    model, standin = WithLoss(), StandInLoss()
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    loss = standin(model, batch)
    torch.testing.assert_close(loss, model(*batch)["loss"])
    assert not standin.used


def test_the_targets_of_an_inputs_targets_pair_are_not_passed_to_forward() -> None:
    model, standin = Classifier(classes=5), StandInLoss()
    x, y = torch.randn(4, 64), torch.randint(0, 5, (4,))
    loss = standin(model, (x, y))
    expected = F.cross_entropy(model(x).float(), torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(loss, expected)
    assert standin.used


def test_a_mapping_output_stands_in_with_its_logits_only() -> None:
    class Mapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 6)

        def forward(self, input_ids: torch.Tensor) -> dict[str, Any]:
            hidden = self.lin(input_ids)
            return {"loss": None, "logits": hidden * 2, "hidden_states": (hidden,)}

    model = Mapped()
    x = torch.randn(3, 8)
    loss = StandInLoss()(model, {"input_ids": x, "labels": torch.zeros(3)})
    expected = F.cross_entropy(model(x)["logits"], torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(loss, expected)


def test_a_tuple_output_reduces_every_floating_tensor() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 5)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x), torch.ones(2, dtype=torch.long)

    model = Two()
    x = torch.randn(4, 8)
    loss = StandInLoss()(model, x)
    zeros = torch.zeros(4, dtype=torch.long)
    a, b, _ = model(x)
    torch.testing.assert_close(loss, F.cross_entropy(a, zeros) + F.cross_entropy(b, zeros))


def test_an_output_with_nothing_to_stand_in_for_keeps_the_clear_error() -> None:
    class Ints(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).argmax(-1)

    with pytest.raises(ConfigurationError, match="not a scalar loss"):
        StandInLoss()(Ints(), torch.randn(4, 8))


def test_estimate_memory_keeps_its_strict_default_for_logits() -> None:
    model = Classifier(classes=5)
    with pytest.raises(ConfigurationError, match="StandInLoss"):
        estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 64))
