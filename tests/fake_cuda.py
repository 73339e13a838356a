"""A CUDA device for the monitor without a GPU: ``torch.cuda.*`` mocked, training stays on the CPU.

``install(monkeypatch)`` makes the :class:`~resource_guard.RunMonitor` that either front door
creates believe it runs on ``cuda:0`` (and sample every 10 ms, so that NVML is read several times in a
short run); ``torch.cuda.max_memory_allocated`` reads :data:`PEAK_BYTES`; the private memory-history
calls are recorded in the returned object's ``history`` list, and ``_dump_snapshot`` writes a small file.
``torch.cuda.memory_allocated`` reads the returned object's ``allocated`` (bytes, or a callable that
returns them) and ``torch.cuda.memory_stats`` its ``stats`` dict (the allocator's flat keys), which a
test may change while the run goes on.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

import resource_guard.observe.monitor as monitor_module

__all__ = ["PEAK_BYTES", "FakeEvent", "install"]

PEAK_BYTES = 123 * 2**20


class FakeEvent:
    """``torch.cuda.Event`` without a GPU: 1 ms between any two events."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.0


def install(monkeypatch: Any) -> types.SimpleNamespace:
    fake = types.SimpleNamespace(
        history=[],
        allocated=PEAK_BYTES // 2,
        stats={
            "allocated_bytes.all.current": PEAK_BYTES // 2,
            "reserved_bytes.all.current": PEAK_BYTES,
            "num_alloc_retries": 0,
        },
    )

    def memory_allocated(device: Any = None) -> int:
        value = fake.allocated
        return int(value() if callable(value) else value)

    def record_history(enabled: str | None = "all", **kwargs: Any) -> None:
        fake.history.append(("record", enabled, kwargs))

    def dump_snapshot(filename: str = "dump_snapshot.pickle", **kwargs: Any) -> None:
        fake.history.append(("dump", filename))
        Path(filename).write_bytes(b"fake snapshot")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: PEAK_BYTES)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "memory_allocated", memory_allocated)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(fake.stats))
    props = types.SimpleNamespace(total_memory=40 * 2**30, name="NVIDIA A100-SXM4-40GB", major=8, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record_history)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump_snapshot)
    original = monitor_module.RunMonitor

    class CudaMonitor(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(device="cuda:0", interval_s=0.01, profile=False, summary=False)
            kwargs.setdefault("device_spec", None)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(monitor_module, "RunMonitor", CudaMonitor)
    fake.monitor = CudaMonitor
    return fake
