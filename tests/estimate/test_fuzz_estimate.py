"""Fuzzing the estimator against real CPU steps (hypothesis).

Random small MLPs, conv nets (with or without BatchNorm) and recurrent nets (LSTM/GRU), batch sizes,
precisions (``32-true``, ``bf16-mixed``, ``16-mixed``) and optimizers (SGD with and without momentum,
Adam, AdamW) are estimated with ``estimate_memory(..., device="cpu")`` and run for real on deep
copies with :func:`~resource_guard.estimate.host.measure.measure_training_step` (the profiler's memory
records).

Tolerance, the property every case must hold:

    estimate >= real - max(2% of real, 64 KiB)

2% is DESIGN.md's "never under by more than 2%". The 64 KiB floor is for tiny models (tens of KiB of
tensors), where a handful of bytes the profiler charges to the step and the estimator does not see —
the loss scalar, a GradScaler-style ``1/scale`` 0-d tensor, the allocator's 64-byte alignment of tiny
tensors that differ by kernel — are a large share of the total yet irrelevant to any capacity
decision (no device is sized within 64 KiB). A trace that cannot run must fall back to the analytic
estimate, which must be conservative: ``estimate >= real`` with no tolerance. No case may raise.
Where this CPU cannot run the reference step (the estimate's ``cpu_unsupported``: an LSTM under fp16
autocast, or under bf16 without AVX-512), the example is discarded with the reason
(``tests/cpu_reference.py``).

Repeatability: ``derandomize=True`` (the examples are a function of the test's code), no database.
The default run (30 cases) takes ~20 s on 2 cores; the ``slow`` variant (120 cases) ~80 s.
Observed over ~500 fuzzed cases: every case traced (no fallback); estimate / real - 1 between -0.9%
and +1.7%, median 0; the largest shortfalls are a few bytes on tiny models (the 64 KiB floor) and
< 1% (under 7 KiB) on small bidirectional LSTMs (oneDNN workspace probes).
Cases that once failed are kept as regular tests at the bottom.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from torch import nn

from cpu_reference import measure_reference
from resource_guard import estimate_memory
from resource_guard.errors import ResourceGuardWarning
from resource_guard.step.precision import parse_precision
from resource_guard.step.training import training_step

TOLERANCE_FRACTION = 0.02
TOLERANCE_FLOOR_BYTES = 64 * 1024

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")


@dataclass(frozen=True)
class Case:
    """One fuzzed configuration (hashable and printable, so hypothesis can shrink and report it)."""

    kind: str  # "mlp", "conv", "lstm", "gru"
    widths: tuple[int, ...]
    batch_size: int
    precision: str
    optimizer: str
    batch_norm: bool = False
    extent: int = 8  # image side (conv) or sequence length (recurrent)
    layers: int = 1  # recurrent layers
    bidirectional: bool = False


def build(case: Case) -> tuple[nn.Module, Any, Any, Any]:
    """The model, an optimizer factory, a batch and a loss function for ``case`` (seeded)."""
    torch.manual_seed(0)
    w = case.widths
    if case.kind == "mlp":
        layers: list[nn.Module] = []
        for a, b in zip(w, w[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model: nn.Module = nn.Sequential(*layers[:-1])
        batch: Any = (torch.randn(case.batch_size, w[0]), torch.randint(0, w[-1], (case.batch_size,)))

        def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
            return nn.functional.cross_entropy(m(b[0]), b[1])

    elif case.kind == "conv":
        layers = []
        for a, b in zip(w, w[1:]):
            layers.append(nn.Conv2d(a, b, 3, padding=1))
            if case.batch_norm:
                layers.append(nn.BatchNorm2d(b))
            layers.append(nn.ReLU())
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w[-1], 4))
        batch = (
            torch.randn(case.batch_size, w[0], case.extent, case.extent),
            torch.randint(0, 4, (case.batch_size,)),
        )

        def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
            return nn.functional.cross_entropy(m(b[0]), b[1])

    else:
        model = Recurrent(case)
        batch = torch.randn(case.batch_size, case.extent, w[0])

        def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
            return m(b).square().mean()

    return model, optimizer_factory(case.optimizer), batch, loss_fn


class Recurrent(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        cls = nn.LSTM if case.kind == "lstm" else nn.GRU
        hidden = case.widths[1]
        self.rnn = cls(
            case.widths[0], hidden, num_layers=case.layers, batch_first=True, bidirectional=case.bidirectional
        )
        self.head = nn.Linear(hidden * (2 if case.bidirectional else 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def optimizer_factory(name: str) -> Any:
    def make(params: Any) -> torch.optim.Optimizer:
        if name == "sgd":
            return torch.optim.SGD(params, lr=0.01)
        if name == "sgd-momentum":
            return torch.optim.SGD(params, lr=0.01, momentum=0.9)
        if name == "adam":
            return torch.optim.Adam(params, lr=1e-3)
        return torch.optim.AdamW(params, lr=1e-3)

    return make


def compare(case: Case) -> tuple[Any, Any]:
    """Estimate and measure ``case``; assert the property. Returns ``(estimate, measured)``."""
    model, make_optimizer, batch, loss_fn = build(case)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceGuardWarning)
        est = estimate_memory(model, make_optimizer, batch, loss_fn, precision=case.precision, device="cpu")
    # skipped where this CPU cannot run the reference (an LSTM under fp16, or bf16 without AVX-512,
    # autocast); a reference that raises after the library said it runs fails, naming the probe
    real = measure_reference(
        est, twin, make_optimizer(list(twin.parameters())), batch, loss_fn, precision=case.precision
    )
    if est.method == "analytic":  # a fallback is allowed, but only when it says why and is conservative
        assert any("analytic" in str(w.message) for w in caught), case
        assert est.peak_bytes >= real.peak_bytes, (case, est.peak_bytes, real.peak_bytes)
    else:
        slack = max(TOLERANCE_FRACTION * real.peak_bytes, TOLERANCE_FLOOR_BYTES)
        assert est.peak_bytes >= real.peak_bytes - slack, (case, est.peak_bytes, real.peak_bytes)
    return est, real


# -- strategies -------------------------------------------------------------------------------------
widths = st.integers(min_value=1, max_value=96)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(("mlp", "conv", "lstm", "gru")))
    common = {
        "batch_size": draw(st.integers(min_value=1, max_value=48)),
        "precision": draw(st.sampled_from(PRECISIONS)),
        "optimizer": draw(st.sampled_from(OPTIMIZERS)),
    }
    if kind == "mlp":
        return Case(kind, tuple(draw(st.lists(widths, min_size=2, max_size=5))), **common)
    if kind == "conv":
        chans = tuple(draw(st.lists(st.integers(1, 16), min_size=2, max_size=4)))
        extent = draw(st.integers(min_value=1, max_value=16))
        return Case(kind, chans, batch_norm=draw(st.booleans()), extent=extent, **common)
    return Case(
        kind,
        (draw(st.integers(1, 32)), draw(st.integers(1, 48))),
        extent=draw(st.integers(min_value=1, max_value=12)),
        layers=draw(st.integers(min_value=1, max_value=2)),
        bidirectional=draw(st.booleans()),
        **common,
    )


_COMMON = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.cpu_reference
@settings(max_examples=15, **_COMMON)  # the quick pass; 120 more in the slow shards below
@given(case=cases())
def test_estimate_is_never_under_a_real_cpu_step(case: Case) -> None:
    compare(case)


def _many(shard: int) -> Any:
    """120 more examples in six seeded shards of 20: each shard a test of its own (under a minute on a
    loaded 2-core host), the same examples every run."""

    @pytest.mark.cpu_reference
    @pytest.mark.slow
    @seed(shard)
    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    def test(case: Case) -> None:
        compare(case)

    test.__name__ = f"test_estimate_is_never_under_a_real_cpu_step_many_{shard}"
    return test


test_estimate_is_never_under_a_real_cpu_step_many_0 = _many(0)
test_estimate_is_never_under_a_real_cpu_step_many_1 = _many(1)
test_estimate_is_never_under_a_real_cpu_step_many_2 = _many(2)
test_estimate_is_never_under_a_real_cpu_step_many_3 = _many(3)
test_estimate_is_never_under_a_real_cpu_step_many_4 = _many(4)
test_estimate_is_never_under_a_real_cpu_step_many_5 = _many(5)


# -- cases found by fuzzing, kept as regular tests --------------------------------------------------
def test_lstm_16_mixed_is_estimated_and_says_whether_this_cpu_runs_it() -> None:
    """Found by the fuzzer: the reference step raises in oneDNN on most CPUs (an AMX Xeon too, where a
    probe of the internal operator said it runs); the estimate must still be made, and must say whether
    this CPU runs the step exactly as the real step turns out."""
    case = Case("lstm", (1, 1), batch_size=1, precision="16-mixed", optimizer="sgd", extent=1)
    model, make_optimizer, batch, loss_fn = build(case)
    est = estimate_memory(model, make_optimizer, batch, loss_fn, precision=case.precision, device="cpu")
    assert est.method == "traced" and est.cpu_unknown == ()
    assert est.peak_bytes >= est.breakdown["parameters"] + est.breakdown["gradients"] > 0
    spec = parse_precision(case.precision)
    optimizer = make_optimizer(model.parameters())
    try:
        training_step(model, optimizer, batch, loss_fn, spec, "cpu", loss_scale=2.0**16)
        runs = True
    except RuntimeError:
        runs = False
    assert bool(est.cpu_unsupported) is not runs, (est.cpu_unsupported, runs)
    assert runs or any(w.startswith("this CPU cannot run the step: nn.LSTM") for w in est.warnings)
