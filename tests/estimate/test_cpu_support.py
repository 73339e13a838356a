"""What this CPU can run: the capability probes, how the estimator uses them (a warning for a step
this CPU cannot run, no per-shape GEMM probes where oneDNN does not pack), and the test suite on a
simulated AVX2-only CPU (``ONEDNN_MAX_CPU_ISA=AVX2`` caps oneDNN below this machine's AVX-512)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from resource_guard import estimate_memory
from resource_guard.estimate import kernels
from resource_guard.estimate.cpu_support import CpuKernelSupport, cpu_can_run, reduced_gemm_packs

ROOT = Path(__file__).resolve().parents[2]
AVX2 = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _lstm() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, object]:
    torch.manual_seed(0)
    model = nn.LSTM(8, 16, batch_first=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 5, 8), _first_sum


def _first_sum(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b)[0].float().sum()


def test_fp32_kernels_run_and_unchecked_operators_are_assumed_to() -> None:
    assert cpu_can_run("aten.mkldnn_rnn_layer", torch.float32).runs
    assert cpu_can_run("aten.mm", torch.bfloat16) == CpuKernelSupport("aten.mm", torch.bfloat16, True)
    assert reduced_gemm_packs(torch.float32) is False


def test_gemm_probe_agrees_with_torchs_own_onednn_check() -> None:
    assert reduced_gemm_packs(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_estimate_says_when_this_cpu_cannot_run_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_bf16(op: str, dtype: torch.dtype) -> CpuKernelSupport:
        runs = dtype != torch.bfloat16
        return CpuKernelSupport(op, dtype, runs, None if runs else "needs AVX-512 (simulated)")

    monkeypatch.setattr(kernels, "cpu_can_run", no_bf16)
    model, opt, batch, loss_fn = _lstm()
    est = estimate_memory(model, opt, batch, loss_fn, precision="bf16-mixed", device="cpu")
    assert est.method == "traced"
    assert est.cpu_unsupported == ("aten.mkldnn_rnn_layer in bf16 (needs AVX-512 (simulated))",)
    assert "this CPU cannot run the step: aten.mkldnn_rnn_layer in bf16 (needs AVX-512 (simulated))" in (
        est.warnings
    )
    assert est.to_dict()["cpu_unsupported"] == list(est.cpu_unsupported)
    fp32 = estimate_memory(model, opt, batch, loss_fn, device="cpu")
    cuda = estimate_memory(model, opt, batch, loss_fn, precision="bf16-mixed", device="cuda")
    assert fp32.cpu_unsupported == cuda.cpu_unsupported == ()  # fp32 runs; a GPU target is not this CPU


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = kernels._probe

    def counting(func, args, kwargs, size_of):  # type: ignore[no-untyped-def]
        seen.append(str(func))
        return real(func, args, kwargs, size_of)

    monkeypatch.setattr(kernels, "_probe", counting)
    monkeypatch.setattr(kernels, "_CACHE", {})
    return seen


@pytest.mark.parametrize("packs", [True, False])
def test_reduced_gemms_are_probed_only_where_onednn_packs_them(
    monkeypatch: pytest.MonkeyPatch, packs: bool
) -> None:
    seen = _count_probes(monkeypatch)
    monkeypatch.setattr(kernels, "reduced_gemm_packs", lambda dtype: packs)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    estimate_memory(model, torch.optim.SGD, torch.randn(32, 64), lambda m, b: m(b).float().sum(),
                    precision="bf16-mixed", device="cpu")  # fmt: skip
    gemms = [f for f in seen if f.split(".")[1] in ("mm", "addmm")]
    assert bool(gemms) is packs


def test_large_flash_attention_probe_is_cut_and_extrapolated_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    b, h, t, d = 2, 12, 512, 64
    with torch.device("meta"):
        q = torch.empty(b, h, t, d, dtype=torch.bfloat16)
        args = (q, q, q, q, q, torch.empty(b, h, t), 0.0, True)
    assert b * h * 12 * t * t * d > kernels.PROBE_BUDGET_FLOPS  # the full probe is over budget
    full = kernels._probe(op, args, {}, lambda _: None)
    seen = _count_probes(monkeypatch)
    cut = kernels._reduced_probe(op, args, {}, lambda _: None)
    assert len(seen) == 2  # at one head per thread and at two
    assert cut.scratch_bytes == full.scratch_bytes > 0


# -- a simulated AVX2-only CPU --------------------------------------------------------------------------
_AVX2_CHECK = textwrap.dedent(
    """
    import torch
    from torch import nn
    from resource_guard.estimate.cpu_support import cpu_can_run, reduced_gemm_packs

    lstm = nn.LSTM(8, 16, batch_first=True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lstm(torch.randn(2, 5, 8))
        raised = False
    except RuntimeError as exc:
        raised = "primitive descriptor" in str(exc)
    support = cpu_can_run("aten.mkldnn_rnn_layer", torch.bfloat16)
    print(raised, support.runs, reduced_gemm_packs(torch.bfloat16))
    print(support.describe())
    """
)


@pytest.mark.slow
def test_avx2_simulation_reproduces_the_failure_and_the_check_sees_it() -> None:
    done = subprocess.run([sys.executable, "-c", _AVX2_CHECK], env=AVX2, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    flags, reason = done.stdout.splitlines()[:2]
    assert flags.split() == ["True", "False", "False"]  # the real step fails; the check says so
    assert "bf16 LSTM needs AVX-512" in reason and "ONEDNN_MAX_CPU_ISA=AVX2" in reason


@pytest.mark.slow
def test_real_step_comparisons_skip_with_the_reason_on_an_avx2_cpu() -> None:
    """The README's test command on an AVX2-only CPU: the bf16 LSTM comparison skips, naming why; the
    other bf16 comparisons still run against the real step (and pass: no packing scratch there)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/estimate/test_estimate.py::test_estimate_matches_real_cpu_step", "-k", "bf16"],
        cwd=ROOT, env=AVX2, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:]
    assert "2 passed, 1 skipped" in out, out[-3000:]
    assert "this CPU cannot run the reference step: aten.mkldnn_rnn_layer in bf16" in out
    assert "needs AVX-512" in out


def test_gpu_target_low_precision_convolutions_are_not_probed_on_this_cpu(monkeypatch) -> None:
    """A CPU kernel in fp16 says nothing of cuDNN's workspace and is very slow here: the rule stands."""
    from resource_guard.estimate import kernels

    probed: list[object] = []
    monkeypatch.setattr(
        kernels, "_reduced_probe", lambda func, *a, **k: probed.append(func) or kernels.KernelExtra(0)
    )
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten())
    batch = torch.randn(4, 3, 16, 16)
    for precision in ("16-mixed", "bf16-mixed"):
        est = estimate_memory(
            model, torch.optim.SGD, batch, lambda m, b: m(b).float().mean(), precision=precision, device="t4"
        )
        assert est.traced
    assert probed == []
    estimate_memory(model, torch.optim.SGD, batch, lambda m, b: m(b).mean(), precision="32-true", device="t4")
    assert probed  # fp32 kernels are still probed (their scratch is the same kind on the target)
