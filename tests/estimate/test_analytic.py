"""The analytic fallback: an upper bound, forced, never below the real CPU step; the planner's refusal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from cpu_reference import measure_reference, reference_checked
from resource_guard import ConfigurationError, ResourceGuardWarning, plan
from resource_guard.devices import play_cpu
from resource_guard.estimate import estimate_memory
from resource_guard.estimate.analytic import analytic_estimate, optimizer_states_per_param
from resource_guard.estimate.trace import recovery
from resource_guard.step.precision import parse_precision

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _forced(model, optimizer, batch, precision="32-true"):
    return analytic_estimate(model, optimizer, batch, parse_precision(precision), "cpu", reason="forced")


class _Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = (
            nn.Embedding(100, 32),
            nn.LSTM(32, 48, batch_first=True),
            nn.Linear(48, 100),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(ids))[0])


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, x, x)[0])


def _ce(m, b):
    return nn.functional.cross_entropy(m(b[0]).flatten(0, -2), b[1].flatten())


SMALL = {
    "mlp": lambda: (
        nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 10)),
        (torch.randn(32, 64), torch.randint(0, 10, (32,))),
    ),
    "conv-bn": lambda: (
        nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        ),  # fmt: skip
        (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))),
    ),
    "lstm-lm": lambda: (_Lstm(), (torch.randint(0, 100, (4, 24)), torch.randint(0, 100, (4, 24)))),
    "attention": lambda: (_Attn(), (torch.randn(4, 48, 32), torch.randint(0, 8, (4, 48)))),
    "transformer-layer": lambda: (
        nn.Sequential(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), nn.Linear(32, 8)),
        (torch.randn(4, 40, 32), torch.randint(0, 8, (4, 40))),
    ),
}


@pytest.mark.cpu_reference
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", list(SMALL))
def test_forced_fallback_is_never_below_the_real_peak(name, precision):
    torch.manual_seed(0)
    model, batch = SMALL[name]()
    est = _forced(model, torch.optim.AdamW(model.parameters()), batch, precision)
    # whether this CPU runs the reference is the library's answer for the traced step
    traced = estimate_memory(model, torch.optim.AdamW, batch, _ce, precision=precision, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    truth = measure_reference(traced, model, optimizer, batch, _ce, precision=precision)
    assert est.peak_bytes >= truth.peak_bytes, (est.breakdown, truth.peak_bytes)
    assert est.method == "analytic" and "analytic upper bound" in est.warnings[1]


def _fallback_bound():
    """``benchmarks/fallback_bound.py``, the benchmark this test runs case by case."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fallback_bound
    finally:
        sys.path.remove(str(BENCHMARKS))
    return fallback_bound


BENCHMARK_CASES = sorted(_fallback_bound().all_cases())


def test_the_fallback_is_checked_over_the_benchmark_zoo() -> None:
    assert len(BENCHMARK_CASES) >= 24 and {"detr/32-true", "detr/bf16-mixed"} <= set(BENCHMARK_CASES)


@pytest.mark.cpu_reference
@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHMARK_CASES)
def test_forced_fallback_over_a_benchmark_model_is_never_below_the_real_peak(name):
    bound = _fallback_bound()
    build = bound.all_cases()[name]
    model, optimizer, batch, loss_fn = build()
    precision = bound.cases.precision_of(name)
    traced = estimate_memory(model, optimizer, batch, loss_fn, precision=precision, device="cpu")
    del model, optimizer, batch, loss_fn
    if traced.cpu_unsupported:  # the library's answer for the traced step: this CPU cannot run it
        pytest.skip(f"this CPU cannot run {name}'s step: {traced.cpu_unsupported}")
    with reference_checked(traced):
        est, true = bound.forced_fallback(name, build)
    assert est >= true, f"{name}: analytic {est:,} bytes below the real peak {true:,}"


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps),
        lambda ps: torch.optim.Adam(ps, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        lambda ps: torch.optim.Adafactor(ps),  # factored: far less than a parameter-sized state
    ],
    ids=["adamw", "adam-amsgrad", "sgd", "adafactor"],
)
def test_optimizer_state_comes_from_the_optimizers_real_layout(make):
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
    batch = torch.randn(8, 64)
    traced = estimate_memory(model, make, batch, lambda m, b: m(b).sum(), device="cpu")
    assert _forced(model, make, batch).breakdown["optimizer_state"] == traced.breakdown["optimizer_state"]


def test_the_count_by_type_is_kept_for_optimizers_that_cannot_step_on_fake_tensors():
    assert optimizer_states_per_param(torch.optim.AdamW) == 2
    assert optimizer_states_per_param(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)) == 0


class _Unique(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.sum() + torch.unique(y.detach()).float().sum() * 0.0


def test_the_planner_refuses_an_analytic_estimate_unless_allowed(monkeypatch):
    monkeypatch.setattr(recovery, "REAL_BUDGET_BYTES", 0)  # `unique` cannot be recovered: analytic
    model = _Unique()
    with pytest.warns(ResourceGuardWarning), pytest.raises(ConfigurationError, match="allow_rough=True"):
        plan(model, torch.optim.SGD, torch.randn(8, 16), device="cpu")
    with pytest.warns(ResourceGuardWarning, match="tracing failed"):
        made = plan(model, torch.optim.SGD, torch.randn(8, 16), device="cpu", allow_rough=True)
    assert made.estimate.method == "analytic"
    assert any("method: analytic upper bound" in r for r in made.reasons)


@pytest.mark.parametrize(
    ("isa", "native"), [("avx512_core_bf16", True), ("avx512_core", True), ("avx2", False)]
)
def test_cpu_convolutions_without_native_reduced_kernels_count_im2col_columns(isa, native):
    # an AVX2-only CPU in bf16 (most CPUs in fp16): oneDNN has no kernel, ATen's slow_conv2d allocates
    # full-batch im2col columns, twice in backward; the bound was 4.4% below a real conv+BN step there.
    # The allowance reads the CPU profile (played here; a ONEDNN_MAX_CPU_ISA cap plays it the same way)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 5, padding=2))
    batch = torch.randn(4, 3, 32, 32)
    spec = parse_precision("bf16-mixed")
    with play_cpu(isa):
        est = analytic_estimate(model, torch.optim.SGD, batch, spec, "cpu", reason="forced")
        fp32 = analytic_estimate(
            model, torch.optim.SGD, batch, parse_precision("32-true"), "cpu", reason="forced"
        )
    with play_cpu("avx512_core_bf16"):
        packed = analytic_estimate(model, torch.optim.SGD, batch, spec, "cpu", reason="forced")
    columns = 4 * 32 * 32 * (8 * 5 * 5) * 2  # the 5x5 conv's: batch x positions x (in x kernel) in bf16
    extra = est.breakdown["activations"] - packed.breakdown["activations"]
    assert extra == (0 if native else 2 * columns)
    assert ("im2col" in est.warnings[1]) is not native
    assert native or f"this CPU's oneDNN (ISA {isa}) has no bf16 kernels" in est.warnings[1]
    assert "im2col" not in fp32.warnings[1]  # float32 convolutions have oneDNN kernels everywhere
