"""A later step that starts with the gradients allocated (accumulation, zeroed gradients):
``for_device(..., gradients_kept=True)`` against a step traced with its gradients really allocated."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from resource_guard import estimate_memory
from resource_guard.estimate.allocation.allocator import device_fit
from resource_guard.estimate.allocation.later_step import later_peak_from_timeline, later_step, running_peak
from resource_guard.estimate.trace.tracer import CATEGORIES


def test_the_gradients_become_initial_and_their_births_temporaries() -> None:
    # 0 a parameter; 1 an activation; 2, 3 gradients freed by zero_grad; 4 freed before the end
    events = [(1, 64), (2, 32), (4, 8), (1, -64), (4, -8), (3, 16), (2, -32), (3, -16)]
    initial, later = later_step(events, [(0, 8)])
    assert initial == [(0, 8), (2, 32), (3, 16)]
    assert later == [(1, 64), (-1, 32), (-1, -32), (4, 8), (1, -64), (4, -8), (-2, 16), (-2, -16)]
    assert running_peak([(0, 8)], events) == 8 + 64 + 32 + 8
    assert running_peak(initial, later) == 8 + 48 + 64 + 32  # the new gradient of 2 beside the old


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64), nn.LayerNorm(64))


def _gradients_allocated(params):
    """AdamW whose state exists and whose gradients are allocated and zeroed, as after
    ``zero_grad(set_to_none=False)``."""
    params = list(params)
    opt = torch.optim.AdamW(params, foreach=False)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad.zero_()
    return opt


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_a_later_step_is_what_a_step_traced_with_its_gradients_allocated_shows(precision) -> None:
    batch = torch.randn(128, 64)
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    plain = estimate_memory(_model(), lambda ps: torch.optim.AdamW(ps, foreach=False), batch, loss,
                            precision=precision, device="a100-40gb")  # fmt: skip
    traced = estimate_memory(_model(), _gradients_allocated, batch, loss, precision=precision,
                             device="a100-40gb")  # fmt: skip
    first = plain.for_device("a100-40gb")
    later = plain.for_device("a100-40gb", gradients_kept=True)
    truth = traced.for_device("a100-40gb")
    # equal up to a few 512-byte roundings of the small temporaries, ordered a little differently
    assert later.allocated_peak_bytes == pytest.approx(truth.allocated_peak_bytes, rel=1e-3)
    assert later.allocated_peak_bytes > first.allocated_peak_bytes
    assert later.reserved_peak_bytes == pytest.approx(truth.reserved_peak_bytes, rel=0.01)
    assert later.reserved_peak_bytes >= first.reserved_peak_bytes
    assert any("later step" in note for note in later.notes)
    cpu = plain.for_device("cpu", gradients_kept=True)
    assert cpu.allocated_peak_bytes == pytest.approx(traced.peak_bytes, rel=1e-3)


def test_without_allocation_events_the_timeline_gives_the_later_peak() -> None:
    g = CATEGORIES.index("gradients")

    def point(phase: str, activations: int, grads: int) -> tuple[str, tuple[int, ...]]:
        sizes = [0] * len(CATEGORIES)
        sizes[CATEGORIES.index("parameters")] = 100
        sizes[CATEGORIES.index("activations")] = activations
        sizes[g] = grads
        return phase, tuple(sizes)

    timeline = [point("forward", 50, 0), point("backward", 30, 60), point("backward", 0, 100),
                point("optimizer", 0, 100)]  # fmt: skip
    est = SimpleNamespace(timeline=timeline, peak_bytes=200)
    assert later_peak_from_timeline(est) == 100 + 50 + 100  # the end of forward, every gradient there
    assert later_peak_from_timeline(SimpleNamespace(timeline=timeline, peak_bytes=400)) == 400


def test_an_extrapolated_estimate_takes_the_later_peak_from_its_timeline() -> None:
    g, a = CATEGORIES.index("gradients"), CATEGORIES.index("activations")
    sizes = [0] * len(CATEGORIES)
    forward, backward = list(sizes), list(sizes)
    forward[a], backward[g] = 5 * 2**30, 3 * 2**30
    est = SimpleNamespace(
        peak_bytes=5 * 2**30, device_kind="cuda", phase_peak_bytes={}, allocator_overhead=(2**20, 2**21),
        allocations=[(1, 512), (1, -512)], initial_allocations=[],  # a shallow sample's, not the model's
        timeline=[("forward", tuple(forward)), ("backward", tuple(backward))],
    )  # fmt: skip
    first = device_fit(est, "a100-40gb")
    later = device_fit(est, "a100-40gb", gradients_kept=True)
    assert later.allocated_peak_bytes - first.allocated_peak_bytes == 3 * 2**30
    assert later.reserved_peak_bytes - later.allocated_peak_bytes == 2**21


class _Tied(nn.Module):
    """One weight used three times: its gradient sums three contributions before it is accumulated."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


@pytest.mark.cpu_reference
@pytest.mark.parametrize(("build", "optimizer"), [(_model, "AdamW"), (_model, "SGD"), (_Tied, "AdamW")])
def test_a_later_step_is_what_a_real_last_accumulation_micro_step_shows(build, optimizer) -> None:
    # the real last micro-step of accumulation: it starts with the earlier micro-steps' gradients
    from resource_guard.estimate import measure_training_step

    batch = torch.randn(128, 64)
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    make = lambda ps: getattr(torch.optim, optimizer)(ps, lr=1e-3)  # noqa: E731
    est = estimate_memory(build(), make, batch, loss, device="cpu")
    model = build()
    real = measure_training_step(model, make(model.parameters()), batch, loss, gradients_kept=True)
    assert real.start_bytes - est.persistent_bytes >= 4 * sum(p.numel() for p in model.parameters())
    later = est.for_device("cpu", gradients_kept=True).allocated_peak_bytes
    assert later == pytest.approx(real.peak_bytes, rel=0.005)
    model = build()
    first = measure_training_step(model, make(model.parameters()), batch, loss)
    assert est.for_device("cpu").allocated_peak_bytes == pytest.approx(first.peak_bytes, rel=0.005)


def test_a_new_gradient_lives_until_it_is_accumulated_into_the_old_one() -> None:
    # gradient 2 is born at event 1 and accumulated into .grad after event 3 (a weight used twice sums
    # its contributions first): the later step's new gradient lives as long, beside the old one
    events = [(1, 64), (2, 32), (4, 8), (1, -64), (4, -8), (2, -32)]
    initial, later = later_step(events, [(0, 8)], gradients=[(2, 4)])
    assert initial == [(0, 8), (2, 32)]
    assert later == [(1, 64), (-1, 32), (4, 8), (1, -64), (-1, -32), (4, -8)]
    assert running_peak(initial, later) == 8 + 32 + 64 + 32 + 8
    _, at_once = later_step(events, [(0, 8)], gradients=[(2, -1)])  # not known: added at once
    assert at_once[:3] == [(1, 64), (-1, 32), (-1, -32)]
