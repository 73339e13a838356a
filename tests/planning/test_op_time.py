"""The per-operator step-time model (planning/op_time.py) and the planner ranking by it (speed.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from resource_guard import ConfigurationError
from resource_guard.planning import op_time
from resource_guard.planning.op_time import (
    CpuCalibration,
    OpTimeModel,
    StepTimePrediction,
    classify_op,
    count_step_ops,
    cpu_calibration,
    measure_cpu,
    predict_ops,
)
from resource_guard.planning.planner import plan

_aten = torch.ops.aten


def _fake_timer(step: float = 1e-3):
    ticks = itertools.count()
    return lambda: next(ticks) * step


def test_calibration_is_deterministic_under_a_fake_timer() -> None:
    a, b = measure_cpu(_fake_timer()), measure_cpu(_fake_timer())
    assert a == b
    # each timed round lasts one tick of the fake clock: the rates follow from the sizes and repetitions
    assert a.op_overhead_s == pytest.approx(1e-3 / 200)
    n = 512
    assert a.matmul_flops_per_s["torch.float32"][-1] == pytest.approx((2.0 * n**3, 2.0 * n**3 / (1e-3 / 2)))


def test_calibration_is_cached_per_cpu_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(op_time, "_CACHE", {})
    calls: list[int] = []
    real = op_time.measure_cpu
    monkeypatch.setattr(op_time, "measure_cpu", lambda timer: calls.append(1) or real(_fake_timer()))
    first = cpu_calibration()
    assert cpu_calibration() is first and len(calls) == 1
    assert cpu_calibration(refresh=True) is not first and len(calls) == 2


def test_a_matmul_counts_its_flops_and_a_copy_its_bytes_exactly() -> None:
    a, b = torch.ones(4, 8), torch.ones(8, 2)
    mm = classify_op(_aten.mm.default, (a, b), {}, a @ b)
    assert (mm.op_class, mm.flops, mm.bytes) == ("matmul", 2 * 4 * 8 * 2, (32 + 16 + 8) * 4)
    x = torch.ones(1000)
    cast = classify_op(_aten._to_copy.default, (x,), {"dtype": torch.bfloat16}, x.bfloat16())
    assert (cast.op_class, cast.flops, cast.bytes) == ("copy", 0.0, 1000 * 4 + 1000 * 2)
    view = classify_op(_aten.t.default, (a,), {}, a.t())
    assert view.op_class == "view" and view.bytes == 0


def test_registry_formulas_are_read() -> None:
    """Fails loudly if torch.utils.flop_counter's registry moves (op_time._registry_flops reads it)."""
    from torch.utils.flop_counter import flop_registry

    assert _aten.mm in flop_registry and _aten.convolution in flop_registry


def test_the_traced_step_counts_the_linear_layers_flops() -> None:
    model = nn.Linear(16, 8)
    ops = count_step_ops(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16),
                         lambda m, b: m(b).sum())  # fmt: skip
    flops = sum(w.flops for w in ops.micro_step if w.op_class == "matmul")
    assert flops == 2 * (2 * 4 * 16 * 8)  # forward and the weight gradient (the input needs none)
    assert ops.optimizer  # SGD's update is traced once


def test_prediction_adds_micro_steps_and_the_optimizer() -> None:
    cal = measure_cpu(_fake_timer())
    model = nn.Linear(16, 8)
    ops = count_step_ops(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16),
                         lambda m, b: m(b).sum())  # fmt: skip
    p = predict_ops(ops, cal)
    assert p.accumulate_s > 0  # each later micro-step adds its gradients to the earlier ones
    assert p.step_s(3) == pytest.approx(3 * p.micro_step_s + 2 * p.accumulate_s + p.optimizer_s)
    assert p.step_s(1) == pytest.approx(p.micro_step_s + p.optimizer_s)
    assert sum(p.micro_step_by_class_s.values()) == pytest.approx(p.micro_step_s)
    with pytest.raises(TypeError, match="OpTimeModel"):
        OpTimeModel("fast")  # type: ignore[arg-type]


class _FakeModel:
    """Makes micro-batch ``fast`` the fastest per step; everything else 10 ms per micro-step."""

    def __init__(self, fast: int) -> None:
        self.fast = fast
        self.asked: list[tuple[int, int]] = []

    def predict(self, model, optimizer, batch, loss_fn, *, precision, checkpoint_every) -> StepTimePrediction:
        micro = batch.shape[0]
        self.asked.append((micro, checkpoint_every))
        per_micro = 0.001 if micro == self.fast else 0.010
        return StepTimePrediction(per_micro, 0.0, {"matmul": per_micro})


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))


def test_the_planner_picks_what_the_step_time_model_says_is_fastest() -> None:
    batch = torch.randn(16, 64, 32)
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    rule = plan(_mlp(), torch.optim.AdamW, batch, loss, device="cpu", precision="32-true", step_time="rule",
                memory_limit=4 * 2**20, headroom=0.0)  # fmt: skip
    assert rule.micro_batch_size > 1  # several fit: the rule takes the largest
    fake = _FakeModel(fast=1)
    p = plan(_mlp(), torch.optim.AdamW, batch, loss, device="cpu", precision="32-true", step_time=fake,
             memory_limit=4 * 2**20, headroom=0.0)  # fmt: skip
    assert (p.micro_batch_size, p.accumulation_steps) == (1, 16)
    assert any("fastest that fits by the step-time model" in r and "16.0 ms/step" in r for r in p.reasons)
    chosen = next(a for a in p.alternatives if a.chosen)
    assert chosen.predicted_step_ms == pytest.approx(16.0)
    assert "predicted ms/step" in p.summary()
    assert {m for m, _ in fake.asked} >= {1, rule.micro_batch_size}


def test_auto_precision_on_a_bf16_cpu_is_the_faster_predicted(monkeypatch: pytest.MonkeyPatch) -> None:
    from resource_guard.planning import planner

    monkeypatch.setattr(planner, "cpu_profile", lambda: type("P", (), {
        "native_bf16": True, "native_bf16_reason": lambda self=None: "native bf16 (test)"})())  # fmt: skip

    class ByPrecision(_FakeModel):
        def predict(self, model, optimizer, batch, loss_fn, *, precision, checkpoint_every):
            s = 0.001 if precision == "32-true" else 0.002
            return StepTimePrediction(s, 0.0, {"copy": s})

    p = plan(_mlp(), torch.optim.AdamW, torch.randn(8, 64, 32), lambda m, b: m(b).square().mean(),
             device="cpu", step_time=ByPrecision(0))  # fmt: skip
    assert p.precision == "32-true"
    assert any(r.startswith("precision 32-true: predicted") for r in p.reasons)
    assert sum(a.chosen for a in p.alternatives) == 1


def test_step_time_is_validated() -> None:
    with pytest.raises(ConfigurationError, match="step_time='fast'"):
        plan(_mlp(), torch.optim.AdamW, torch.randn(4, 64, 32), device="cpu", step_time="fast")


def test_calibration_type() -> None:
    assert isinstance(measure_cpu(_fake_timer()), CpuCalibration)
