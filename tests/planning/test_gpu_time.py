"""The per-operator step-time model on a catalog GPU (planning/gpu_time.py): structure, not fitted values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from resource_guard.devices import DeviceSpec, load_catalog, resolve_device
from resource_guard.errors import ConfigurationError
from resource_guard.planning.gpu_time import (
    KERNEL_FLOOR_S,
    GpuOpModel,
    exposed_comm_s,
    gpu_step_time,
)
from resource_guard.planning.op_time import OpWork, classify_op

CATALOG = load_catalog()


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(a)
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Decoder(nn.Module):
    def __init__(self, d: int = 256, heads: int = 4, layers: int = 2, vocab: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy((x @ self.emb.weight.t()).flatten(0, 1), ids.flatten())


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids)


def _ids(batch: int, seq: int = 128) -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


def _model(layers: int = 2) -> nn.Module:
    with torch.device("meta"):
        return _Decoder(layers=layers)


def test_refuses_a_cpu_and_an_unknown_kernel() -> None:
    with pytest.raises(ConfigurationError, match="CUDA or ROCm"):
        GpuOpModel(_cpu_spec())
    with pytest.raises(ConfigurationError, match="attention_kernel"):
        GpuOpModel(CATALOG.get("a100-40gb"), attention_kernel="flash9")


def _cpu_spec() -> DeviceSpec:
    return resolve_device("cpu")


def test_matmul_efficiency_grows_with_size_and_never_passes_the_ceiling() -> None:
    gpu = GpuOpModel(CATALOG.get("h100-sxm"))
    sizes = [64, 256, 1024, 4096, 16384]
    effs = [gpu.matmul_efficiency((1, n, n, n), torch.bfloat16) for n in sizes]
    assert effs == sorted(effs)
    assert all(0 < e <= gpu.matmul_ceiling for e in effs)
    assert effs[0] < effs[-1] / 10


def test_wave_quantization_one_tile_past_a_full_wave_costs_a_wave() -> None:
    gpu = GpuOpModel(CATALOG.get("a100-40gb"))  # 108 SMs
    full = gpu.matmul_efficiency((1, 128 * 108, 128, 4096), torch.bfloat16)
    one_more = gpu.matmul_efficiency((1, 128 * 109, 128, 4096), torch.bfloat16)
    assert one_more == pytest.approx(full * 109 / 216)


def test_a_tiny_operator_takes_the_kernel_floor_and_a_big_copy_its_bandwidth() -> None:
    gpu = GpuOpModel(CATALOG.get("a100-80gb"))
    tiny = OpWork("elementwise", 0.0, 64, torch.float32, "add")
    assert gpu.kernel_s(tiny) == KERNEL_FLOOR_S
    big = OpWork("copy", 0.0, 2 * 10**9, torch.bfloat16, "clone")
    assert gpu.kernel_s(big) == pytest.approx(2e9 / (2039e9 * 0.8))
    view = OpWork("view", 0.0, 0, torch.float32, "view")
    assert gpu.kernel_s(view) == 0.0


def test_causal_attention_counts_half_and_takes_less_time() -> None:
    q = torch.empty(2, 4, 256, 64, dtype=torch.bfloat16, device="meta")
    op = torch.ops.aten._scaled_dot_product_flash_attention.default
    full = classify_op(op, (q, q, q), {"is_causal": False}, op(q, q, q, is_causal=False))
    causal = classify_op(op, (q, q, q), {"is_causal": True}, op(q, q, q, is_causal=True))
    assert causal.flops == pytest.approx(full.flops / 2)
    assert full.shape == (8, 256, 256, 64)
    gpu = GpuOpModel(CATALOG.get("a100-40gb"))
    assert gpu.kernel_s(causal) < gpu.kernel_s(full)


def test_flash1_is_slower_than_flash2_and_the_h100_faster_than_the_a100() -> None:
    model, ids = _model(), _ids(8, 512)
    a100 = GpuOpModel(CATALOG.get("a100-40gb")).predict(
        model, torch.optim.AdamW, ids, _loss, precision="bf16-mixed"
    )
    old = GpuOpModel(CATALOG.get("a100-40gb"), attention_kernel="flash1").predict(
        model, torch.optim.AdamW, ids, _loss, precision="bf16-mixed"
    )
    h100 = GpuOpModel(CATALOG.get("h100-sxm")).predict(
        model, torch.optim.AdamW, ids, _loss, precision="bf16-mixed"
    )
    assert old.micro_step_by_class_s["attention"] > a100.micro_step_by_class_s["attention"]
    assert old.micro_step_by_class_s["matmul"] == a100.micro_step_by_class_s["matmul"]
    assert h100.micro_step_s < a100.micro_step_s


def test_trace_follows_the_gpu_target() -> None:
    gpu = GpuOpModel(CATALOG.get("a100-40gb"))
    ops = gpu.trace(_model(), torch.optim.AdamW, _ids(4), _loss, "bf16-mixed")
    names = {w.name for w in ops.micro_step}
    assert any("flash_attention" in n or "efficient_attention" in n for n in names)
    assert {w.dtype for w in ops.micro_step if w.op_class == "matmul"} == {torch.bfloat16}
    assert ops.optimizer  # the foreach update is listed
    fp32 = gpu.trace(_model(), torch.optim.AdamW, _ids(4), _loss, "32-true")
    assert {w.dtype for w in fp32.micro_step if w.op_class == "matmul"} == {torch.float32}


def test_recompute_and_batch_add_time_and_blocks_add_linearly() -> None:
    gpu = GpuOpModel(CATALOG.get("a100-40gb"))

    def micro(layers: int, batch: int, every: int = 0) -> float:
        return gpu.predict(
            _model(layers),
            torch.optim.AdamW,
            _ids(batch, 512),
            _loss,
            precision="bf16-mixed",
            checkpoint_every=every,
        ).micro_step_s

    base = micro(2, 16)
    assert micro(2, 16, every=1) > base
    assert micro(2, 64) > 2 * base  # larger matmuls are more efficient, but four times the work
    two, three, four = micro(2, 16), micro(3, 16), micro(4, 16)
    assert four - three == pytest.approx(three - two, rel=1e-6)


def test_host_bound_micro_step_waits_for_its_launches() -> None:
    gpu = GpuOpModel(CATALOG.get("h100-sxm"))
    with torch.device("meta"):
        tiny = _Decoder(d=32, heads=2, layers=2, vocab=64)
    p = gpu.predict(tiny, torch.optim.AdamW, _ids(1, 8), _loss, precision="bf16-mixed")
    launches = sum(
        1
        for w in gpu.trace(tiny, torch.optim.AdamW, _ids(1, 8), _loss, "bf16-mixed").micro_step
        if w.op_class != "view"
    )
    assert p.micro_step_by_class_s["framework"] > 0
    assert p.micro_step_s == pytest.approx(launches * gpu.launch_s)


def test_exposed_communication() -> None:
    assert exposed_comm_s(0.0, 1.0, units=4) == 0.0
    assert exposed_comm_s(1.0, 10.0, units=4) == 0.25  # hidden but for one unit
    assert exposed_comm_s(8.0, 2.0, units=4) == 6.0  # what the compute cannot hide
    assert exposed_comm_s(1.0, 10.0) == 1.0  # one unit: nothing overlaps


def test_gpu_step_time_accumulates_shards_the_update_and_overlaps() -> None:
    gpu = GpuOpModel(CATALOG.get("a100-40gb"))
    p = gpu.predict(_model(), torch.optim.AdamW, _ids(8, 512), _loss, precision="bf16-mixed")
    peak = gpu.peak(torch.bfloat16)
    one = gpu_step_time(p, peak_flops=peak)
    assert one.step_s == pytest.approx(p.micro_step_s + p.optimizer_s)
    four = gpu_step_time(p, peak_flops=peak, accumulation_steps=4, optimizer_share=0.25)
    assert four.step_s == pytest.approx(4 * p.micro_step_s + 3 * p.accumulate_s + p.optimizer_s / 4)
    assert four.flops == pytest.approx(4 * p.flops_per_micro_step)
    assert 0 < four.efficiency < 1
    hidden = gpu_step_time(p, peak_flops=peak, comm_s=p.micro_step_s / 2, comm_overlap="fsdp", units=10)
    exposed = gpu_step_time(p, peak_flops=peak, comm_s=p.micro_step_s / 2)
    assert hidden.comm_s == pytest.approx(p.micro_step_s / 20)
    assert exposed.comm_s == pytest.approx(p.micro_step_s / 2)
    assert math.isclose(exposed.step_s - hidden.step_s, exposed.comm_s - hidden.comm_s)


def test_plan_ranks_by_the_gpu_model_on_one_catalog_gpu_and_keeps_the_rule_on_several() -> None:
    from resource_guard.planning.planner import plan
    from resource_guard.planning.speed import resolve_step_model

    a100 = CATALOG.get("a100-40gb")
    assert isinstance(resolve_step_model("auto", a100), GpuOpModel)
    assert resolve_step_model("auto", a100, world_size=2) is None
    assert resolve_step_model("rule", a100) is None
    with torch.device("meta"):
        model = _Decoder(layers=2)
    one = plan(model, torch.optim.AdamW, _ids(16), _loss, device=a100, step_time="auto")
    assert any("fastest that fits by the step-time model" in r for r in one.reasons)
    two = plan(model, torch.optim.AdamW, _ids(16), _loss, device=a100, step_time="auto", world_size=2)
    assert not any("step-time model" in r for r in two.reasons)


def test_every_catalog_gpu_has_its_sm_count_and_the_figures_the_model_needs() -> None:
    from resource_guard.planning.gpu_time import SM_COUNT

    gpus = [spec for spec in CATALOG.values() if spec.kind in ("cuda", "rocm")]
    assert gpus and all(spec.name in SM_COUNT for spec in gpus)
    for spec in gpus:
        gpu = GpuOpModel(spec)  # refuses an entry without bandwidth or an fp32 peak
        assert 0 < gpu.matmul_efficiency((1, 4096, 4096, 4096), torch.float16) <= gpu.matmul_ceiling
