"""The per-operator step-time model (planning/op_time.py) and the planner ranking by it (speed.py)."""

from __future__ import annotations

import dataclasses
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


def _points(*rates: float) -> tuple[tuple[float, float], ...]:
    return tuple((float(10 ** (5 + 2 * i)), r) for i, r in enumerate(rates))


def _calibration(**changes) -> CpuCalibration:
    """Injected constants (no measurement): small matmuls slower, cold passes slower than hot ones."""
    fields = dict(
        matmul_flops_per_s={"torch.float32": _points(1e10, 5e10, 1e11),
                            "torch.bfloat16": _points(1e10, 1e11, 2e11),
                            "torch.float32/tn": _points(5e9, 2.5e10, 5e10)},
        copy_bytes_per_s={"torch.float32": _points(4e10, 4e10, 1e10),
                          "torch.bfloat16": _points(2e10, 2e10, 1e10)},
        op_overhead_s=5e-6,
        view_overhead_s=1e-6,
        attention_flops_per_s={"torch.float32": _points(2e10), "torch.float32/backward": _points(1e10)},
        transcendental_per_s={"torch.float32": _points(1e9, 5e8)},
        cold_bytes_per_s={"torch.float32": 5e9},
        cast_bytes_per_s=_points(5e9, 5e9, 2e9),
        micro_step_overhead_s=5e-5,
        optimizer_op_overhead_s=3e-6,
        rnn_step_s={"torch.float32": 1e-5},
        conv_flops_per_s={"torch.float32": 3e10, "torch.float32/backward": 2e10},
        named_per_s={"bernoulli_/torch.float32": 1e8, "mixed/torch.float32": 2e8},
    )  # fmt: skip
    fields.update(changes)
    return CpuCalibration(**fields)


@pytest.mark.slow
def test_calibration_measures_every_rate_under_a_fake_clock() -> None:
    """One real calibration run (its work is real, its clock fake: every timed round lasts one tick)."""
    cal = measure_cpu(_fake_timer())
    n = 512
    for dtype in ("torch.float32", "torch.bfloat16"):
        for layout in ("", "/nn", "/nt", "/tn"):
            size = 2 if dtype == "torch.bfloat16" else 4
            calls = max(2, min(256, op_time._MATMUL_POOL_BYTES // (2 * n * n * size)))  # a round's calls
            expected = (2.0 * n**3, 2.0 * n**3 * calls / 1e-3)
            assert cal.matmul_flops_per_s[dtype + layout][-1] == pytest.approx(expected)
        assert cal.cold_bytes_per_s[dtype] > 0 and len(cal.attention_flops_per_s[f"{dtype}/backward"]) == 2
        assert cal.conv_flops_per_s[dtype] > 0 and cal.rnn_step_s[dtype] >= 0
        assert cal.named_per_s[f"bernoulli_/{dtype}"] > 0 and len(cal.transcendental_per_s[dtype]) == 2
    assert len(cal.cast_bytes_per_s) == 3
    # the per-operator overheads: never below a bare operator's dispatch (1 tick / 200 calls)
    assert cal.op_overhead_s >= 1e-3 / 200 and cal.optimizer_op_overhead_s >= 1e-3 / 200
    assert cal.micro_step_overhead_s >= 0 and cal.calibration_s > 0


def test_the_default_clock_is_the_threads_cpu_time_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert op_time.default_timer() is time.thread_time
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert op_time.default_timer() is time.perf_counter


def test_calibration_is_cached_per_cpu_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(op_time, "_CACHE", {})
    calls: list[int] = []
    monkeypatch.setattr(op_time, "measure_cpu", lambda timer: calls.append(1) or _calibration())
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
    cal = _calibration()
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


def _forward(**kw) -> op_time.OpWork:
    return op_time.OpWork(**{"op_class": "matmul", "flops": 0.0, "bytes": 0, "dtype": torch.float32,
                             "phase": "forward", **kw})  # fmt: skip


def test_a_larger_matmul_is_predicted_slower_and_a_small_one_far_from_peak() -> None:
    cal = _calibration()
    small, large = (classify_op(_aten.mm.default, (torch.ones(n, n), torch.ones(n, n)), {}, torch.ones(n, n))
                    for n in (16, 256))  # fmt: skip
    t_small, t_large = op_time._kernel_seconds(small, cal), op_time._kernel_seconds(large, cal)
    assert t_large > t_small
    # the efficiency curve: 4096x the FLOPs at a higher rate costs less than 4096x the time
    assert t_large / t_small < large.flops / small.flops


def test_matmul_layouts_of_a_linear_layer_are_told_apart() -> None:
    """A Linear's forward reads its weight transposed (``nt``); each layout has its own calibrated rate."""
    model = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    ops = count_step_ops(model, torch.optim.SGD(model.parameters(), lr=0.1), x, lambda m, b: m(b).sum())
    layouts = {(w.name, w.phase): w.variant for w in ops.micro_step if w.op_class == "matmul"}
    assert layouts[("addmm", "forward")] == "nt"
    assert all(v in ("nn", "nt", "tn", "tt") for v in layouts.values())
    # the calibrated layout's rate is used where there is one: tn is slower in this calibration
    cal = _calibration()
    nt, tn = _forward(flops=1e7, variant="nt"), _forward(flops=1e7, variant="tn")
    assert op_time._kernel_seconds(tn, cal) == pytest.approx(2 * op_time._kernel_seconds(nt, cal))


def test_checkpointing_adds_its_recompute() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)])
    opt, x = torch.optim.AdamW, torch.randn(8, 32)
    plain = count_step_ops(model, opt, x, lambda m, b: m(b).square().mean())
    ckpt = count_step_ops(model, opt, x, lambda m, b: m(b).square().mean(), checkpoint_every=1)
    flops = lambda ops: sum(w.flops for w in ops.micro_step if w.op_class == "matmul")  # noqa: E731
    # each block's forward runs again in the backward, as far as the backward needs it: its first Linear
    # (the second's output is saved for nothing, so PyTorch's checkpoint stops before it)
    first_linear = 2 * 8 * 32 * 64
    assert flops(ckpt) == pytest.approx(flops(plain) + 3 * first_linear)
    cal = _calibration()
    assert predict_ops(ckpt, cal).micro_step_s > predict_ops(plain, cal).micro_step_s
    assert len(ckpt.optimizer) == len(plain.optimizer)  # the update does not change


def test_host_overhead_is_paid_per_operator_and_per_micro_step() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    ops = count_step_ops(model, torch.optim.AdamW, torch.randn(2, 8), lambda m, b: m(b).sum())
    base, doubled = predict_ops(ops, _calibration()), predict_ops(ops, _calibration(op_overhead_s=10e-6))
    extra = doubled.micro_step_by_class_s["framework"] - base.micro_step_by_class_s["framework"]
    paid = [w for w in ops.micro_step if w.name not in op_time._TRACE_ONLY]
    assert 0 < len(paid) < len(ops.micro_step)  # the trace's detaches cost a real step nothing
    assert extra == pytest.approx(len(paid) * 5e-6)
    assert base.micro_step_by_class_s["framework"] >= 5e-5  # the fixed part of a micro-step
    # the optimizer's operators pay the optimizer's overhead, and its states are read out of the cache
    assert base.optimizer_s >= len(ops.optimizer) * 3e-6
    cal = _calibration()
    w = _forward(op_class="elementwise", bytes=2**20)
    cold = dataclasses.replace(w, phase="optimizer")
    assert op_time._kernel_seconds(cold, cal) > op_time._kernel_seconds(w, cal)


def test_autocast_casts_and_mixed_dtype_operators_are_classed() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 4))
    loss = lambda m, b: m(b).float().square().mean() + b.sum()  # noqa: E731
    fp32 = count_step_ops(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16), loss)
    bf16 = count_step_ops(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16), loss,
                          precision="bf16-mixed")  # fmt: skip
    assert not any(w.variant == "cast" for w in fp32.micro_step)
    assert any(w.variant == "cast" for w in bf16.micro_step)  # the weights and input cast to bf16
    assert any(w.name == "bernoulli_" and w.variant == "named" for w in fp32.micro_step)  # dropout
    a, b = torch.ones(64, 8), torch.ones(64, 8, dtype=torch.bfloat16)
    mixed = classify_op(_aten.add.Tensor, (a, b), {}, a + b)
    assert (mixed.variant, mixed.flops) == ("mixed", 512.0)
    assert op_time._kernel_seconds(mixed, _calibration()) == pytest.approx(512 / 2e8)


def test_a_recurrent_layer_pays_per_time_step() -> None:
    model = nn.LSTM(8, 16, batch_first=True)
    x = torch.randn(2, 12, 8)
    ops = count_step_ops(model, torch.optim.SGD(model.parameters(), lr=0.1), x, lambda m, b: m(b)[0].sum())
    rnn = [w for w in ops.micro_step if w.variant == "rnn"]
    if not rnn:  # this build runs the LSTM as separate cells: their matmuls are counted one by one
        pytest.skip("no fused recurrent operator in this build")
    assert all(w.steps == 12 for w in rnn) and all(w.flops > 0 for w in rnn)
    cal = _calibration()
    slower = _calibration(rnn_step_s={"torch.float32": 2e-5})
    assert op_time._kernel_seconds(rnn[0], slower) - op_time._kernel_seconds(rnn[0], cal) == pytest.approx(
        12e-5
    )


def test_the_reason_names_host_time_when_fewer_micro_steps_win() -> None:
    """Micro-steps that cost the same host time each: the largest that fits wins by host time."""

    class HostBound(_FakeModel):
        def predict(self, model, optimizer, batch, loss_fn, *, precision, checkpoint_every):
            micro = batch.shape[0]
            return StepTimePrediction(
                0.001 + 0.0001 * micro, 0.0, {"framework": 0.001, "matmul": 0.0001 * micro}
            )

    batch, loss = torch.randn(16, 64, 32), lambda m, b: m(b).square().mean()
    kw = dict(device="cpu", precision="32-true", memory_limit=4 * 2**20, headroom=0.0)
    rule = plan(_mlp(), torch.optim.AdamW, batch, loss, step_time="rule", **kw)
    p = plan(_mlp(), torch.optim.AdamW, batch, loss, step_time=HostBound(0), **kw)
    assert p.micro_batch_size == rule.micro_batch_size > 1  # fewest micro-steps: the largest that fits
    why = next(r for r in p.reasons if r.startswith("fastest that fits"))
    assert "next:" in why and "host time around the operators" in why
    timed = [a for a in p.alternatives if a.predicted_step_ms is not None]
    assert len(timed) > 1 and [a.predicted_step_ms for a in timed] == sorted(
        a.predicted_step_ms for a in timed
    )
