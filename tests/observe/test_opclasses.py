"""Tests for resource_guard.observe.opclasses: the pattern table, call sites, the per-class times,
exposed communication and the device idle time that syncs open; on synthetic events and on a real CPU
profiler window."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest
import torch
from torch import nn

from resource_guard.observe import opclasses
from resource_guard.observe.opclasses import OP_CLASSES, EventRecord, classify, op_breakdown, user_frame
from resource_guard.observe.profiling import ProfileWindow, StepProfiler


def test_docstring_examples_run() -> None:
    assert doctest.testmod(opclasses).failed == 0


def test_the_module_is_framework_free() -> None:
    text = Path(opclasses.__file__).read_text(encoding="utf-8")
    assert "import torch" not in text and "import lightning" not in text


@pytest.mark.parametrize(
    ("name", "on_device", "cls"),
    [
        ("aten::mm", False, "matmul"),
        ("aten::convolution_backward", False, "matmul"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", False, "attention"),
        ("aten::copy_", False, "casts"),
        ("aten::_to_copy", False, "casts"),
        ("aten::_foreach_mul_", False, "optimizer"),
        ("aten::item", False, "sync"),
        ("cudaStreamSynchronize", False, "sync"),
        ("cudaMemcpyAsync", False, "other"),  # asynchronous: not a sync by itself
        ("c10d::allreduce_", False, "communication"),
        ("aten::gelu", False, "elementwise"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True, "communication"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<...>>", True, "attention"),
        ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", True, "attention"),
        ("ampere_sgemm_128x64_nn", True, "matmul"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
            True,
            "elementwise",
        ),
        (
            "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)>",
            True,
            "casts",
        ),
        ("void at::native::multi_tensor_apply_kernel<...FusedAdamMathFunctor...>", True, "optimizer"),
        ("Memcpy DtoD (Device -> Device)", True, "casts"),
        ("Memcpy HtoD (Pinned -> Device)", True, "other"),
    ],
)
def test_classify_follows_the_pattern_table(name: str, on_device: bool, cls: str) -> None:
    assert classify(name, on_device=on_device) == cls
    assert cls in OP_CLASSES


def test_user_frame_skips_library_frames() -> None:
    stack = (
        "<built-in method item of Tensor object at 0x7f>",
        "torch/_tensor.py(40): wrapped",
        "lightning/pytorch/loops/fit_loop.py(12): run",
        "resource_guard/frontdoors/guard/context.py(300): backward",
        "my_project/train.py(42): train_step",
        "my_project/train.py(90): main",
    )
    assert user_frame(stack) == "my_project/train.py:42 (train_step)"
    assert user_frame(stack[:4]) is None


def _ev(
    name: str,
    start: float,
    dur: float,
    *,
    device: bool = False,
    python: bool = False,
    self_us: float | None = None,
) -> EventRecord:
    return EventRecord(
        name, device, dur if self_us is None else self_us, start_us=start, total_us=dur, python=python
    )


def test_host_timeline_sums_self_times_by_class_and_names_call_sites() -> None:
    events = [
        _ev("ProfilerStep#1", 0, 1000),
        _ev("train.py(10): step", 0, 900, python=True),
        _ev("torch/nn/modules/module.py(1): _call_impl", 5, 300, python=True),
        _ev("aten::addmm", 10, 200),
        _ev("aten::to", 400, 100, self_us=10),
        _ev("aten::_to_copy", 405, 90, self_us=20),
        _ev("aten::copy_", 410, 70),
        _ev("aten::item", 600, 5),
        _ev("Optimizer.step#AdamW.step", 700, 150, self_us=50),
        _ev("aten::mul_", 710, 40),
    ]
    b = op_breakdown(events, steps=1)
    classes = dict(b.class_us)
    assert b.timeline == "host"
    assert classes["matmul"] == 200 and classes["casts"] == 100  # 10 + 20 + 70 self
    assert classes["optimizer"] == 40 and classes["sync"] == 5
    assert classes["other"] == 50  # the optimizer span's own time (a record function)
    assert b.cast_sites == (("train.py:10 (step)", 1.0, 100.0),)  # one copy_, the time of all three
    assert b.syncs == 1 and b.sync_idle_us == 0.0  # a CPU .item() waits for nothing


def test_a_copy_counts_the_allocation_of_its_result_and_clones_are_copies() -> None:
    events = [
        _ev("ProfilerStep#1", 0, 1000),
        _ev("train.py(10): step", 0, 900, python=True),
        _ev("aten::to", 100, 100, self_us=5),
        _ev("aten::_to_copy", 102, 95, self_us=10),
        _ev("aten::empty_strided", 103, 15),  # the result's allocation: part of the cast
        _ev("aten::copy_", 120, 70),
        _ev("aten::clone", 300, 60, self_us=10),
        _ev("aten::empty_like", 301, 10),
        _ev("aten::copy_", 312, 40),
        _ev("aten::empty_strided", 500, 30),  # outside any copy: not a cast
    ]
    classes = dict(op_breakdown(events, steps=1).class_us)
    assert classes["casts"] == 5 + 10 + 15 + 70 + 10 + 10 + 40
    assert classes["elementwise"] == 30


def test_forward_and_backward_in_an_optimizer_s_closure_are_not_optimizer_ops() -> None:
    """Lightning calls ``optimizer.step(closure)``: the training step runs inside the step's span."""
    events = [
        _ev("ProfilerStep#1", 0, 1000),
        _ev("Optimizer.step#AdamW.step", 0, 900, self_us=10),
        _ev("lightning/pytorch/loops/optimization/automatic.py(140): closure", 5, 600, python=True),
        _ev("aten::addmm", 10, 200),
        _ev("aten::gelu_backward", 300, 100),
        _ev("aten::_foreach_mul_", 700, 50),
        _ev("aten::addcdiv_", 800, 40),
    ]
    classes = dict(op_breakdown(events, steps=1).class_us)
    assert classes["matmul"] == 200 and classes["elementwise"] == 100
    assert classes["optimizer"] == 90


def test_device_timeline_exposed_comm_and_sync_idle() -> None:
    events = [
        _ev("ProfilerStep#1", 0, 1000),
        _ev("ampere_sgemm_128x64_nn", 0, 300, device=True),
        _ev("ncclKernel_AllReduce_RING_LL_Sum_float", 200, 300, device=True),  # 100 us hidden, 200 exposed
        _ev("cudaStreamSynchronize", 450, 100),  # host waits until 550; the device is idle 500..700
        _ev("train.py(7): loop", 0, 1000, python=True),
        _ev("elementwise_kernel", 700, 100, device=True),
        _ev("aten::item", 440, 120),  # its overhead is host time, not the device timeline's
    ]
    b = op_breakdown(events, steps=1)
    classes = dict(b.class_us)
    assert b.timeline == "device"
    assert classes["matmul"] == 300 and classes["communication"] == 300 and classes["elementwise"] == 100
    assert classes["sync"] == 100 and b.syncs == 1
    assert b.comm_us == 300 and b.exposed_comm_us == 200
    assert b.sync_idle_us == 200
    assert b.sync_sites == (("train.py:7 (loop)", 1.0, 100.0),)


def test_a_real_cpu_window_sees_casts_and_scalar_reads_with_their_call_sites() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    prof = StepProfiler(ProfileWindow(skip_first=0, wait=0, warmup=1, active=2), None)
    prof.start()

    def train_step() -> float:
        x = torch.randn(16, 64).to(torch.float64).to(torch.float32)  # two casts per step
        loss = model(x).sum()
        loss.backward()
        return loss.item()

    for _ in range(3):
        train_step()
        prof.step()
    summary = prof.summarize()
    assert summary is not None and summary.op_timeline == "host"
    classes = dict(summary.op_class_us)
    assert set(classes) == set(OP_CLASSES)
    assert classes["matmul"] > 0 and classes["casts"] > 0
    assert summary.syncs_per_step == 1.0  # one .item() per step
    here = __file__.rsplit("/", 1)[-1]
    sites = [site for site, _, _ in summary.cast_sites]
    assert any(here in site and "train_step" in site for site in sites), sites
    assert summary.cast_sites[0][1] >= 2.0  # the two casts per step (and the backward's copies)
    assert not any(".py(" in op for op, _, _ in summary.top_ops)  # Python frames are not ops


def _copy(start: float, dur: float) -> EventRecord:
    return EventRecord("aten::copy_", False, dur, ((64, 64), (64, 64)), start_us=start, total_us=dur)


def test_classes_are_medians_over_the_steps_and_one_slow_call_is_a_stall() -> None:
    """Issue #37: one aten::copy_ that stalled 150 ms inside the window made casts 100% of the step.
    The stall is set apart and counted at its kind's usual time; the classes are per-step medians."""
    events = []
    for k, mm in enumerate((2000.0, 2200.0, 2400.0)):
        t0 = k * 200_000.0
        events.append(_ev(f"ProfilerStep#{k}", t0, 190_000.0 if k == 1 else 10_000.0))
        events.append(_ev("aten::mm", t0 + 10, mm))
        events += [_copy(t0 + 3000 + 200 * i, 100.0) for i in range(4)]
    events.append(_copy(200_000.0 + 5000, 150_000.0))  # the stall, in step 1
    b = op_breakdown(events, steps=3)
    classes, spread = dict(b.class_us), dict(b.class_spread_us)
    # 4 copies of 100 us a step; step 1's stall counts at its kind's 100 us (500), the median is 400
    assert classes["casts"] == 400.0 and spread["casts"] == 50.0
    assert classes["matmul"] == 2200.0 and spread["matmul"] == 200.0  # median, half the range
    assert [(op, us) for op, us, _ in b.stalls] == [("aten::copy_", 150_000.0)]
    calm = op_breakdown([e for e in events if e.duration_us < 100_000.0 or e.name.startswith("Prof")], 3)
    assert calm.stalls == () and dict(calm.class_us)["casts"] == 400.0
    slow_everywhere = [  # the same slow copy in every step is the op's time, not a stall
        e if e.name != "aten::copy_" or e.start_us % 200_000.0 != 3000 else _copy(e.start_us or 0.0, 9000.0)
        for e in events
        if e.duration_us < 100_000.0 or e.name.startswith("Prof")
    ]
    assert op_breakdown(slow_everywhere, 3).stalls == ()


def test_a_blocking_runtime_call_takes_the_site_of_the_op_it_runs_in() -> None:
    """A GPU run's sync is cudaStreamSynchronize inside aten::item: not in the profiler's Python tree,
    it is named by the line that made the aten::item (the reader's ``site``), not a ``def`` line."""
    item = EventRecord("aten::item", False, 5.0, start_us=100.0, total_us=300.0, site="train.py:42 (step)")
    events = [
        _ev("ProfilerStep#1", 0, 1000),
        _ev("train.py(30): step", 0, 900, python=True),
        _ev("aten::mm", 10, 50),
        item,
        _ev("cudaStreamSynchronize", 110, 280),
        _ev("gemm_kernel", 20, 60, device=True),
    ]
    b = op_breakdown(events, steps=1)
    assert b.sync_sites == (("train.py:42 (step)", 1.0, 280.0),)
