"""What the monitor compares its measured peak with (``MonitorOutputs._estimated_peak_bytes``)."""

from __future__ import annotations

import torch

from resource_guard import estimate_memory
from resource_guard.devices import load_catalog
from resource_guard.observe.outputs import MonitorOutputs


class _Outputs(MonitorOutputs):
    def __init__(self, estimate: object, cuda: bool, spec: object) -> None:
        self.estimate = estimate  # type: ignore[assignment]
        self._cuda = cuda
        self.device_spec = spec  # type: ignore[assignment]


def test_on_cuda_the_measured_allocator_peak_is_compared_with_the_allocator_models_peak() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(100, 333), torch.nn.ReLU(), torch.nn.Linear(333, 7))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(13, 100)
    est = estimate_memory(model, optimizer, batch, lambda m, b: m(b).sum(), device="cuda")
    spec = load_catalog().get("a100-40gb")
    allocated = est.for_device(spec).allocated_peak_bytes
    assert allocated > est.peak_bytes  # odd sizes: the allocator rounds every block up
    assert _Outputs(est, True, spec)._estimated_peak_bytes() == allocated
    assert _Outputs(est, False, spec)._estimated_peak_bytes() == est.peak_bytes  # CPU: tensors only
    assert _Outputs(None, True, spec)._estimated_peak_bytes() is None
