"""A fake ``pynvml`` module for the monitoring tests: GPUs described in Python, errors on demand.

Use the ``fake_pynvml`` fixture (in the test modules) or :func:`install`::

    nvml = install(monkeypatch, [FakeGpu("NVIDIA A100-SXM4-40GB", "GPU-aaaa")])
    nvml.fail_after = 3          # the 4th query raises NVMLError_GpuIsLost (a GPU lost mid-run)

The sampler queries from its own thread; a test waits for what it needs instead of sleeping::

    nvml.wait_for_calls(nvml.calls + 2 * QUERIES_PER_SAMPLE)   # a full sample was taken since
    nvml.fail_in(0); nvml.wait_until_lost()                     # the sampler has seen the GPU go
"""

from __future__ import annotations

import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeGpu", "FakeNvml", "HANG_S", "QUERIES_PER_SAMPLE", "install"]

HANG_S = 60.0  # a wait that takes this long is a hang, not a slow machine
QUERIES_PER_SAMPLE = 5  # per GPU: utilization, memory, power, temperature, SM clock


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's spelling
    pass


class NVMLError_NoPermission(NVMLError):  # noqa: N801
    pass


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
    pass


class NVMLError_DriverNotLoaded(NVMLError):  # noqa: N801
    pass


@dataclass
class FakeGpu:
    name: str
    uuid: str
    util: int = 40
    used: int = 3 * 2**30
    total: int = 40 * 2**30
    power_mw: int | None = 250_000  # None: NotSupported
    temperature: int = 61
    sm_clock: int = 1410


@dataclass
class FakeNvml:
    """State of the fake driver; ``module`` is what ``import pynvml`` returns."""

    gpus: list[FakeGpu]
    init_error: bool = False
    fail_after: int | None = None
    calls: int = 0
    inits: int = 0
    shutdowns: int = 0
    module: types.ModuleType = field(init=False)
    _queried: threading.Condition = field(init=False, repr=False, default_factory=threading.Condition)

    def __post_init__(self) -> None:
        m = types.ModuleType("pynvml")
        m.NVMLError = NVMLError  # type: ignore[attr-defined]
        m.NVMLError_NotSupported = NVMLError_NotSupported  # type: ignore[attr-defined]
        m.NVMLError_NoPermission = NVMLError_NoPermission  # type: ignore[attr-defined]
        m.NVMLError_GpuIsLost = NVMLError_GpuIsLost  # type: ignore[attr-defined]
        m.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
        m.NVML_CLOCK_SM = 1  # type: ignore[attr-defined]
        m.nvmlInit = self._init  # type: ignore[attr-defined]
        m.nvmlShutdown = self._shutdown  # type: ignore[attr-defined]
        m.nvmlDeviceGetCount = lambda: len(self.gpus)  # type: ignore[attr-defined]
        m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)  # type: ignore[attr-defined]
        m.nvmlDeviceGetName = lambda h: self._gpu(h).name.encode()  # type: ignore[attr-defined]
        m.nvmlDeviceGetUUID = lambda h: self._gpu(h).uuid  # type: ignore[attr-defined]
        m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=self._query(h).util, memory=5)  # type: ignore[attr-defined]
        m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
            used=self._query(h).used, total=self._gpu(h).total, free=self._gpu(h).total - self._gpu(h).used
        )
        m.nvmlDeviceGetPowerUsage = self._power  # type: ignore[attr-defined]
        m.nvmlDeviceGetTemperature = lambda h, sensor: self._query(h).temperature  # type: ignore[attr-defined]
        m.nvmlDeviceGetClockInfo = lambda h, clock: self._query(h).sm_clock  # type: ignore[attr-defined]
        self.module = m

    def _init(self) -> None:
        if self.init_error:
            raise NVMLError_DriverNotLoaded("Driver Not Loaded")
        self.inits += 1

    def _shutdown(self) -> None:
        self.shutdowns += 1

    def _gpu(self, handle: Any) -> FakeGpu:
        return self.gpus[handle[1]]

    def _query(self, handle: Any) -> FakeGpu:
        with self._queried:
            self.calls += 1
            lost = self.fail_after is not None and self.calls > self.fail_after
            self._queried.notify_all()
        if lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        return self._gpu(handle)

    def wait_for_calls(self, n: int, timeout_s: float = HANG_S) -> None:
        """Block until the driver has been queried ``n`` times in all."""
        with self._queried:
            if not self._queried.wait_for(lambda: self.calls >= n, timeout_s):
                raise TimeoutError(f"NVML queried {self.calls} times in {timeout_s} s, waited for {n}")

    def fail_in(self, n: int) -> None:
        """The GPU is lost after ``n`` more queries."""
        with self._queried:
            self.fail_after = self.calls + n

    def wait_until_lost(self, timeout_s: float = HANG_S) -> None:
        """Block until a query has raised ``GpuIsLost`` (the sampler has seen the fault)."""
        assert self.fail_after is not None, "no fault injected: call fail_in() first"
        self.wait_for_calls(self.fail_after + 1, timeout_s)

    def _power(self, handle: Any) -> int:
        gpu = self._query(handle)
        if gpu.power_mw is None:
            raise NVMLError_NotSupported("Not Supported")
        return gpu.power_mw


def install(monkeypatch: Any, gpus: list[FakeGpu], **kwargs: Any) -> FakeNvml:
    """Make ``import pynvml`` return a fake driver with ``gpus``."""
    fake = FakeNvml(gpus, **kwargs)
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake
