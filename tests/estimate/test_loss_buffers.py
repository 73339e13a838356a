"""ATen's reduced pointwise losses keep their unreduced buffer as the storage of the 0-d loss they
return; the CPU target's trace must see that storage, not the fake kernel's 4 bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from resource_guard.estimate.host.kernels import _aten, kernel_extra

LOSSES = {
    "mse_loss": (F.mse_loss, _aten.mse_loss.default),
    "smooth_l1_loss": (F.smooth_l1_loss, _aten.smooth_l1_loss.default),
    "binary_cross_entropy": (F.binary_cross_entropy, _aten.binary_cross_entropy.default),
    "soft_margin_loss": (F.soft_margin_loss, _aten.soft_margin_loss.default),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_loss_storage_is_the_real_kernels(name: str, dtype: torch.dtype, reduction: str) -> None:
    fn, op = LOSSES[name]
    prediction = torch.rand(16, 40, dtype=dtype).clamp(0.1, 0.9)
    target = torch.rand(16, 40, dtype=dtype)
    real = fn(prediction, target, reduction=reduction)
    out = torch.empty((), dtype=dtype)
    extra = kernel_extra(
        op, (prediction, target), {"reduction": 1 if reduction == "mean" else 2}, out, lambda t: None
    )
    assert extra is not None
    assert extra.output_bytes == (real.untyped_storage().nbytes(),)


def test_unreduced_output_is_left_to_the_fake() -> None:
    out = torch.empty(16, 40)
    extra = kernel_extra(_aten.mse_loss.default, (out, out), {"reduction": 0}, out, lambda t: None)
    assert extra is None


def test_a_held_loss_is_estimated_with_its_buffer() -> None:
    """A step holding the first of two losses through the second's backward (LBFGS holds its first
    closure's loss through the step): the estimate of the held 0-d loss is its real buffer."""
    from resource_guard import estimate_memory
    from resource_guard.estimate.host.measure import allocation_deltas, live_bytes, peak_of
    from resource_guard.estimate.host.quiet import quiet_profile

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4096)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    x, y = torch.randn(64, 8), torch.rand(64, 4096)

    def two_losses(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        first = F.mse_loss(model(batch[0]), batch[1])
        first.backward()
        model._held = first  # type: ignore[assignment]  # held, as LBFGS's orig_loss is
        return F.mse_loss(model(batch[0]), batch[1])

    model, optimizer = build()
    estimate = estimate_memory(model, optimizer, (x, y), two_losses, device="cpu", keep_outputs=False)
    model, optimizer = build()
    optimizer.step()  # SGD keeps no state: nothing to warm
    start = live_bytes(model, optimizer, (x, y))
    with quiet_profile() as prof:
        loss = two_losses(model, (x, y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    real = start + peak_of(allocation_deltas(prof))
    assert estimate.peak_bytes >= real
    assert estimate.peak_bytes <= real * 1.02
