"""Checks that need a real CUDA device: the estimate and the allocator model against the allocator.

They are skipped where no GPU exists (this repository's machines and CI); run them on a GPU host with
``python -m pytest -m gpu``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autocast_cases import CASES, REGION_CASES, make_inputs
from resource_guard import estimate_memory, guard
from resource_guard.estimate.emulate.attention import CUDNN, EFFICIENT, FLASH, MATH, select_backend
from resource_guard.estimate.emulate.cuda_autocast import CudaAutocast
from resource_guard.estimate.emulate.target import Target
from resource_guard.step.precision import parse_precision
from resource_guard.step.training import training_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _setup(
    device: str = "cuda",
) -> tuple[nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = (torch.randn(64, 1024, device=device), torch.randn(64, 1024, device=device))
    return model, optimizer, batch


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_allocated_and_reserved_peaks_match_the_cuda_allocator(precision: str) -> None:
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    model, optimizer, batch = _setup()
    estimate = estimate_memory(model, optimizer, batch, _loss, precision=precision)
    fit = estimate.for_device("cuda:0")
    spec = parse_precision(precision)
    training_step(model, optimizer, batch, _loss, spec, "cuda")  # optimizer state now exists
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    training_step(model, optimizer, batch, _loss, spec, "cuda")
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    assert fit.allocated_peak_bytes == pytest.approx(allocated, rel=0.05)
    assert fit.reserved_peak_bytes >= allocated
    assert fit.reserved_peak_bytes == pytest.approx(reserved, rel=0.15)


def test_a_guarded_cuda_run_reports_the_allocator_peak_without_drift(tmp_path: Path) -> None:
    model, optimizer, batch = _setup("cpu")
    loader = [batch] * 12
    with guard(model, optimizer, loss_fn=_loss, device="cuda", log_dir=tmp_path) as g:
        for micro in g.iterate(loader):
            with g.autocast():
                loss = _loss(model, micro)
            g.backward(loss)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["peak_memory_source"] == "cuda_allocated"
    assert "estimate-drift" not in [f["id"] for f in report["findings"]]
    assert g.summary()["measured_peak_bytes"] > 0


# -- the emulated CUDA autocast policy and attention kernels against the real ones -------------------
_LOW_DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("low", _LOW_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_autocast_dtypes_match_real_cuda_autocast(case: str, low: torch.dtype) -> None:
    if low == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    fn, _ = CASES[case]
    with torch.autocast("cuda", dtype=low):
        real = fn(make_inputs(low, "cuda"))
    with CudaAutocast(low):
        emulated = fn(make_inputs(low, "cpu"))
    assert emulated.dtype == real.dtype


@pytest.mark.parametrize("low", _LOW_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(REGION_CASES))
def test_regions_a_model_opens_give_the_dtypes_of_real_cuda_autocast(case: str, low: torch.dtype) -> None:
    if low == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    fn, _ = REGION_CASES[case]
    with torch.autocast("cuda", dtype=low):
        real = fn(make_inputs(low, "cuda"))  # the regions name x.device.type: "cuda" here
    with CudaAutocast(low):
        emulated = fn(make_inputs(low, "cpu"))  # ... and "cpu" here
    assert [t.dtype for t in emulated] == [t.dtype for t in real]


@pytest.mark.parametrize(
    "dtype, head_dim, masked",
    [
        (torch.float16, 64, False),
        (torch.bfloat16, 128, False),
        (torch.float32, 64, False),
        (torch.float16, 64, True),
    ],
)
def test_the_predicted_sdpa_backend_is_the_one_torch_picks(
    dtype: torch.dtype, head_dim: int, masked: bool
) -> None:
    from torch.nn.attention import SDPBackend

    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    q, k, v = (
        torch.randn(2, 4, 128, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)
    )
    mask = torch.ones(128, 128, device="cuda", dtype=torch.bool) if masked else None
    picked = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False)).name
    target = Target("cuda", "local", torch.cuda.get_device_capability())
    predicted = select_backend(target, q, k, v, mask)
    fused = {"FLASH_ATTENTION", "CUDNN_ATTENTION"}  # keep the same bytes
    same_bytes = {FLASH: fused, CUDNN: fused, EFFICIENT: {"EFFICIENT_ATTENTION"}, MATH: {"MATH"}}
    assert picked in same_bytes[predicted], (picked, predicted)
