"""Time-to-train and cost projection: the consistency rules of issue #13 and the step-time model."""

from __future__ import annotations

import doctest
import json
import math

import pytest
import torch
from torch import nn

from resource_guard.devices import Catalog, DeviceSpec, load_catalog
from resource_guard.errors import ConfigurationError
from resource_guard.planning.projection import project_training, remaining_run, training_samples
from resource_guard.planning.steptime import (
    Calibration,
    Interconnect,
    count_step_flops,
    peak_flops,
    step_time,
)

SEQ, WIDTH, VOCAB, BLOCKS = 16, 32, 64, 3
GiB = 2**30


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())


def _tokens(batch: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def _gpu(
    name: str, *, tflops: float = 100.0, memory: int = 16 * GiB, price: float | None = 1.0
) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        kind="cuda",
        memory_bytes=memory,
        bf16=True,
        compute_capability="8.0",
        peak_tflops={"bf16": tflops, "fp32": tflops / 8},
        memory_bandwidth_gbps=1e6,  # so fast that every step is compute-bound
        price_per_hour_usd=price,
    )


def _project(catalog: Catalog, **kwargs):
    kwargs.setdefault("train_samples", 8000)
    kwargs.setdefault("gpus", [1])
    return project_training(TokenModel(), torch.optim.AdamW, _tokens(), catalog=catalog, **kwargs)


def test_hours_scale_linearly_with_tokens_and_cost_is_hours_times_price_times_gpus():
    cat = Catalog([_gpu("slow", tflops=50, price=0.5), _gpu("fast", tflops=200, price=3.0)])
    one = _project(cat, train_samples=None, train_tokens=8 * SEQ * 1000, gpus=[2])
    three = _project(cat, train_samples=None, train_tokens=3 * 8 * SEQ * 1000, gpus=[2])
    assert one.optimizer_steps == 1000 and three.optimizer_steps == 3000
    by_key = {(r.device, r.gpus): r for r in one.rows}
    for r in three.rows:
        assert r.hours == pytest.approx(3 * by_key[(r.device, r.gpus)].hours)
    for r in (*one.rows, *three.rows):
        spec = cat.get(r.device)
        assert r.cost_usd == pytest.approx(r.hours * spec.price_per_hour_usd * r.gpus)
    for proj in (one, three):
        for r in proj.rows:
            assert r.hours == pytest.approx(r.step_s * proj.optimizer_steps / 3600)


def test_a_faster_device_is_never_projected_slower_for_a_compute_bound_model():
    peaks = [0.001, 0.002, 0.004, 0.016]  # TFLOP/s low enough that this small model is compute-bound
    cat = Catalog([_gpu(f"d{p}", tflops=p) for p in peaks])
    rows = {r.device: r for r in _project(cat).rows}
    times = [rows[f"d{p}"].step_s for p in peaks]
    assert all(r.bound == "compute" for r in rows.values())
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_checkpointing_adds_the_forward_flops_of_the_checkpointed_blocks():
    flops = count_step_flops(TokenModel(), torch.optim.AdamW, _tokens(4))
    names = [f"blocks.{i}" for i in range(BLOCKS)]
    per_block = 2 * SEQ * WIDTH * WIDTH  # one Linear's forward matmul per sample
    assert flops.recompute_per_sample(names) == pytest.approx(BLOCKS * per_block)
    assert flops.step(4, names) - flops.step(4) == pytest.approx(4 * BLOCKS * per_block)
    # nested names are counted once
    assert flops.recompute_per_sample([*names, "blocks.0.0"]) == flops.recompute_per_sample(names)
    # the optimizer's update is in the step, once, whatever the batch
    trainable = sum(p.numel() for p in TokenModel().parameters())
    assert flops.step(4) - 4 * (flops.forward_per_sample + flops.backward_per_sample) == 12 * trainable


def test_a_checkpointed_plan_costs_its_recompute():
    cat = Catalog([_gpu("g", tflops=0.004)])  # compute-bound
    rows = {}
    for ckpt in (False, True):
        proj = _project(cat, checkpointing=ckpt)
        (rows[ckpt],) = proj.rows
        assert rows[ckpt].plan["checkpointing"] is ckpt
    modules = [f"blocks.{i}" for i in range(BLOCKS)]
    assert rows[False].time.flops == pytest.approx(proj.flops.step(8))
    assert rows[True].time.flops == pytest.approx(proj.flops.step(8, modules))
    assert rows[True].step_s > rows[False].step_s


def test_a_device_where_nothing_fits_is_never_recommended():
    cat = Catalog([_gpu("cramped", tflops=10_000, memory=2**20, price=0.01), _gpu("roomy", price=5.0)])
    proj = _project(cat, gpus=[1, 2])
    cramped = [r for r in proj.rows if r.device == "cramped"]
    assert cramped and all(not r.fits and not r.recommended and "usable" in r.reason for r in cramped)
    assert proj.recommended("cheapest").device == "roomy"
    assert proj.recommended("fastest").device == "roomy"
    assert [r.fits for r in proj.rows] == sorted((r.fits for r in proj.rows), reverse=True)  # no-fit last


def test_limits_filter_the_recommendation():
    cat = Catalog([_gpu("slow", tflops=0.001, price=0.1), _gpu("fast", tflops=0.1, price=50.0)])
    free = _project(cat)
    assert free.recommended("cheapest").device == "slow" and free.recommended("fastest").device == "fast"
    slow_hours = next(r.hours for r in free.rows if r.device == "slow")
    limited = _project(cat, max_hours=slow_hours / 2)
    assert limited.recommended("cheapest").device == "fast"
    assert _project(cat, max_hours=slow_hours / 2, max_cost=1e-12).recommended("fastest") is None


def test_multi_node_rows_pay_the_inter_node_link_and_partial_nodes_are_refused():
    cat = Catalog([_gpu("g")])
    link = Interconnect(gpus_per_node=2, intra_node_gbps=100.0, inter_node_gbps=1.0)
    proj = _project(cat, gpus=[2, 4, 6], interconnect=link, train_samples=24000, target_batch_size=24)
    rows = {r.gpus: r for r in proj.rows}
    assert rows[4].nodes == 2 and rows[4].fits and "between nodes" in rows[4].reason
    assert rows[4].time.comm_s > rows[2].time.comm_s > 0
    assert rows[6].nodes == 3  # 6 GPUs fill three nodes of 2
    refused = _project(cat, gpus=[3], interconnect=link, target_batch_size=24)
    assert not refused.rows[0].fits and "whole nodes" in refused.rows[0].reason


def test_calibration_from_a_run_report_replaces_the_efficiency(tmp_path):
    cat = load_catalog()
    a100 = cat.get("a100-40gb")
    summary = {
        "step_time_s": 2.0,
        "flops_per_step": 0.25 * 312e12 * 2.0,  # 25% of the bf16 peak
        "device_kind": "cuda",
        "device_name": "NVIDIA A100-SXM4-40GB",
        "capacity_bytes": a100.memory_bytes,
        "precision": "bf16-mixed",
    }
    (tmp_path / "report.json").write_text(json.dumps({"summary": summary}))
    cal = Calibration.from_report(tmp_path, cat)
    assert cal.device == "a100-40gb" and cal.efficiency(cat) == pytest.approx(0.25)
    proj = project_training(
        TokenModel(),
        torch.optim.AdamW,
        _tokens(),
        train_samples=800,
        devices=["a100-40gb", "t4"],
        gpus=[1],
        calibration=cal,
    )
    assert proj.efficiency == pytest.approx(0.25) and all(r.calibrated for r in proj.rows)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigurationError, match="no report.json"):
        Calibration.from_report(tmp_path / "empty", cat)


def test_a_cpu_calibration_applies_to_its_own_rows_only():
    cat = Catalog([_gpu("g"), DeviceSpec(name="cpu", kind="cpu", memory_bytes=8 * GiB)])
    cal = Calibration("cpu", "32-true", achieved_flops_per_s=1e9)
    proj = _project(cat, devices=["g", cat.get("cpu")], precision="32-true", calibration=cal)
    rows = {r.device: r for r in proj.rows}
    assert rows["cpu"].calibrated and not rows["g"].calibrated
    assert rows["cpu"].step_s == pytest.approx(rows["cpu"].time.flops / 1e9)


def test_step_time_model_parts():
    a100 = load_catalog().get("a100-40gb")
    assert peak_flops(a100, "bf16-mixed") == 312e12 and peak_flops(a100, "32-true") == 19.5e12
    t = step_time(a100, "bf16-mixed", flops=1e12, bytes_moved=1555e9, efficiency=0.5)
    assert t.bound == "memory" and t.step_s == pytest.approx(1.0)
    ring = step_time(a100, "bf16-mixed", flops=0, bytes_moved=0, comm_bytes=300e9, comm_factor=2, gpus=8)
    assert ring.comm_s == pytest.approx(2 * 7 / 8)
    with pytest.raises(ConfigurationError, match="no peak"):
        step_time(load_catalog().get("t4"), "bf16-mixed", flops=1, bytes_moved=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"train_samples": 10, "train_tokens": 10}, "exactly one"),
        ({"train_samples": 0}, "int >= 1"),
        ({"epochs": 2}, "go together"),
        ({"train_samples": 10, "gpus": [0]}, "gpus"),
        ({"train_samples": 10, "max_cost": -1}, "max_cost"),
        ({"train_samples": 10, "efficiency": 1.5}, "efficiency"),
    ],
)
def test_bad_arguments_are_refused_before_any_trace(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        project_training(TokenModel(), torch.optim.AdamW, _tokens(), **kwargs)


def test_training_samples_and_remaining_run():
    assert training_samples(_tokens(), train_tokens=SEQ * 10 + 1) == 11
    assert training_samples(_tokens(), epochs=1.5, dataset_size=100) == 150
    with pytest.raises(ConfigurationError, match="token ids"):
        training_samples(torch.randn(4, 3), train_tokens=100)
    t4 = load_catalog().get("t4")
    left = remaining_run(t4, step_s=3.6, steps_done=0, total_steps=1000, gpus=2)
    assert left["eta_hours"] == pytest.approx(1.0) and left["cost_usd"] == pytest.approx(2 * 0.526)
    assert math.isclose(remaining_run(None, step_s=1, steps_done=5, total_steps=3)["eta_hours"], 0.0)


def test_a_small_model_is_launch_bound_and_a_calibration_measures_its_launches():
    flops = count_step_flops(nn.Linear(4, 2), torch.optim.SGD, torch.randn(8, 4), lambda m, b: m(b).sum())
    assert flops.kernels_per_micro_step == 5  # addmm, sum, ones_like (grad seed), mm, sum: views excluded
    h100 = load_catalog().get("h100-sxm")
    t = step_time(h100, "bf16-mixed", flops=1e6, bytes_moved=1e3, kernels=200)
    assert t.bound == "launch" and t.step_s == pytest.approx(200 * 5e-6)
    measured = step_time(h100, "bf16-mixed", flops=1e6, bytes_moved=0, kernels=200, achieved_flops_per_s=1e9)
    assert measured.launch_s == 0 and measured.step_s == pytest.approx(1e-3)


def test_module_examples_run():
    from resource_guard.planning import projection, projection_result, steptime

    for module in (projection, projection_result, steptime):
        assert doctest.testmod(module).failed == 0


def test_calibration_from_a_report_dict_and_a_report_without_flops():
    cat = load_catalog()
    summary = {"step_time_s": 0.5, "flops_per_step": 1e12, "device_kind": "cpu", "precision": "32-true"}
    cal = Calibration.from_report({"summary": summary}, cat)
    assert (cal.device, cal.achieved_flops_per_s, cal.efficiency(cat)) == ("cpu", 2e12, None)
    with pytest.raises(ConfigurationError, match="no step time and FLOPs"):
        Calibration.from_report({"summary": {**summary, "flops_per_step": None}}, cat)


def test_gpu_rows_use_the_per_operator_model_and_an_explicit_efficiency_the_whole_step():
    from resource_guard.planning.gpu_time import GpuOpModel

    cat = load_catalog()
    proj = project_training(
        TokenModel(),
        torch.optim.AdamW,
        _tokens(),
        train_samples=800,
        devices=["a100-40gb"],
        gpus=[1],
        catalog=cat,
    )
    (row,) = proj.rows
    assert proj.step_model == "per-operator" and proj.to_dict()["step_model"] == "per-operator"
    assert row.plan["accumulation_steps"] == 1
    gpu = GpuOpModel(cat.get("a100-40gb"))
    p = gpu.predict(TokenModel(), torch.optim.AdamW, _tokens(), precision=row.plan["precision"])
    assert row.step_s == pytest.approx(p.step_s(1))
    # this tiny model's GPU step waits on the host's launches, not on its FLOPs
    assert row.bound == "launch"
    whole = project_training(
        TokenModel(),
        torch.optim.AdamW,
        _tokens(),
        train_samples=800,
        devices=["a100-40gb"],
        gpus=[1],
        catalog=cat,
        efficiency=0.4,
    )
    assert whole.step_model == "whole-step" and whole.rows[0].step_s != pytest.approx(row.step_s)


def test_per_operator_rows_grow_with_the_batch_and_shrink_with_a_faster_gpu():
    cat = Catalog([_gpu("slow", tflops=0.004), _gpu("fast", tflops=0.016)])
    small = {r.device: r for r in _project(cat, target_batch_size=8).rows}
    large = {r.device: r for r in _project(cat, target_batch_size=32).rows}
    assert small["fast"].step_s < small["slow"].step_s
    for name in ("slow", "fast"):
        assert large[name].step_s > 2 * small[name].step_s  # compute-bound: four times the FLOPs
        assert large[name].hours < small[name].hours  # a quarter of the steps


def test_an_uncalibrated_cpu_row_uses_the_planners_cpu_model(monkeypatch):
    import resource_guard.planning.projection as projection_module
    from resource_guard.planning.op_time import CpuCalibration, OpTimeModel

    points = ((1e5, 1e10), (1e9, 1e11))
    cal = CpuCalibration(
        matmul_flops_per_s={"torch.float32": points},
        copy_bytes_per_s={"torch.float32": ((1e3, 1e10), (1e8, 5e9))},
        op_overhead_s=5e-6,
        view_overhead_s=1e-6,
        micro_step_overhead_s=5e-5,
    )  # injected constants: nothing measured
    monkeypatch.setattr(projection_module, "OpTimeModel", lambda: OpTimeModel(cal))
    cpu = DeviceSpec(name="cpu", kind="cpu", memory_bytes=8 * GiB)
    cat = Catalog([_gpu("g"), cpu])
    proj = _project(cat, devices=["g", cpu], precision="32-true")
    rows = {r.device: r for r in proj.rows}
    expected = OpTimeModel(cal).predict(TokenModel(), torch.optim.AdamW, _tokens(), precision="32-true")
    assert rows["cpu"].fits and not rows["cpu"].calibrated and rows["cpu"].efficiency is None
    assert rows["cpu"].step_s == pytest.approx(expected.step_s(rows["cpu"].plan["accumulation_steps"]))
    assert proj.step_model == "per-operator"
