"""NVML queries for the run-time sampler: GPU utilization, memory, power, temperature and SM clock.

Follows nvitop's handling of the driver library: ``pynvml`` is imported and initialised lazily in
:meth:`NvmlDevices.open` (never at import or in a constructor), shut down in :meth:`NvmlDevices.close`;
fields the GPU does not support (``NVMLError_NotSupported``, ``NVMLError_NoPermission``) read as
``None`` ("not available"), and any other NVML error switches NVML off for the rest of the run with one
message instead of an exception. Torch device indices are mapped to NVML handles through
``CUDA_VISIBLE_DEVICES`` (indices and ``GPU-<uuid>`` prefixes), the same mapping
:func:`~resource_guard.devices.detect.detect_local_devices` uses. No CUDA context is created.

Example:
    >>> gpus = NvmlDevices([0])
    >>> gpus.is_open, gpus.error
    (False, None)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from resource_guard.devices.detect import _GpuInfo, _str, _visible_gpus

__all__ = ["GPU_FIELDS", "NvmlDevices", "NvmlUnavailable"]

GPU_FIELDS = (
    "util_percent",
    "memory_used_bytes",
    "memory_total_bytes",
    "power_w",
    "temperature_c",
    "sm_clock_mhz",
)


class NvmlUnavailable(Exception):
    """NVML cannot be used (any more); the message says why. Raised by :class:`NvmlDevices` only."""


class NvmlDevices:
    """NVML handles of some torch CUDA devices, in torch index order.

    Args:
        torch_indices: torch device indices to sample; ``None`` for every visible GPU.

    ``open``/``sample``/``close`` are meant to be called from one thread (the sampler's).
    """

    def __init__(self, torch_indices: Sequence[int] | None = None) -> None:
        self._wanted = None if torch_indices is None else tuple(torch_indices)
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._unsupported: tuple[type[BaseException], ...] = ()
        self.error: str | None = None

    @property
    def is_open(self) -> bool:
        return self._nvml is not None

    def open(self) -> None:
        """Import ``pynvml``, initialise NVML and look up the handles.

        Raises:
            NvmlUnavailable: no ``pynvml``, no driver, or the devices cannot be mapped. NVML is left
                shut down.
        """
        if self.is_open:
            return
        try:
            import pynvml
        except ImportError as exc:
            raise self._fail(f"pynvml cannot be imported ({exc})") from None
        errors = _error_types(pynvml)
        try:
            pynvml.nvmlInit()
        except errors as exc:
            raise self._fail(f"NVML cannot be initialised ({_describe(exc)})") from None
        self._nvml = pynvml
        self._unsupported = tuple(
            getattr(pynvml, name)
            for name in ("NVMLError_NotSupported", "NVMLError_NoPermission", "NVMLError_FunctionNotFound")
            if isinstance(getattr(pynvml, name, None), type)
        )
        try:
            physical = [
                _GpuInfo(_str(pynvml.nvmlDeviceGetName(h)), 0, None, uuid=_str(pynvml.nvmlDeviceGetUUID(h)))
                for h in map(pynvml.nvmlDeviceGetHandleByIndex, range(pynvml.nvmlDeviceGetCount()))
            ]
            visible = _visible_gpus(physical, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if visible is None:
                raise NvmlUnavailable("CUDA_VISIBLE_DEVICES names MIG devices, which NVML sampling skips")
            by_uuid = {gpu.uuid: i for i, gpu in enumerate(physical)}
            wanted = range(len(visible)) if self._wanted is None else self._wanted
            missing = [i for i in wanted if not 0 <= i < len(visible)]
            if missing:
                raise NvmlUnavailable(
                    f"torch device(s) {missing} are not among the {len(visible)} visible GPUs"
                )
            self._handles = {i: pynvml.nvmlDeviceGetHandleByIndex(by_uuid[visible[i].uuid]) for i in wanted}
        except NvmlUnavailable as exc:
            raise self._fail(str(exc)) from None
        except errors as exc:
            raise self._fail(f"NVML device lookup failed ({_describe(exc)})") from None

    def sample(self) -> dict[int, dict[str, float | None]]:
        """One reading per GPU: ``{torch_index: {field: value or None}}`` (fields: :data:`GPU_FIELDS`).

        Raises:
            NvmlUnavailable: NVML failed mid-run (GPU lost, driver gone); NVML has been shut down.
        """
        nvml = self._nvml
        if nvml is None:
            return {}
        out = {}
        try:
            for index, handle in self._handles.items():
                util = self._query(nvml.nvmlDeviceGetUtilizationRates, handle)
                memory = self._query(nvml.nvmlDeviceGetMemoryInfo, handle)
                power_mw = self._query(nvml.nvmlDeviceGetPowerUsage, handle)
                temp = self._query(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
                clock = self._query(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
                out[index] = {
                    "util_percent": None if util is None else float(util.gpu),
                    "memory_used_bytes": None if memory is None else float(memory.used),
                    "memory_total_bytes": None if memory is None else float(memory.total),
                    "power_w": None if power_mw is None else power_mw / 1000.0,
                    "temperature_c": None if temp is None else float(temp),
                    "sm_clock_mhz": None if clock is None else float(clock),
                }
        except _error_types(nvml) as exc:
            raise self._fail(f"NVML query failed mid-run ({_describe(exc)})") from None
        return out

    def close(self) -> None:
        """Shut NVML down (idempotent; errors on shutdown are ignored)."""
        nvml, self._nvml, self._handles = self._nvml, None, {}
        if nvml is not None:
            with contextlib.suppress(*_error_types(nvml)):
                nvml.nvmlShutdown()

    def _query(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, or ``None`` where the GPU does not support the query or forbids it."""
        try:
            return fn(*args)
        except self._unsupported:
            return None

    def _fail(self, message: str) -> NvmlUnavailable:
        self.close()
        self.error = message
        return NvmlUnavailable(message)


def _error_types(nvml: Any) -> tuple[type[BaseException], ...]:
    base = getattr(nvml, "NVMLError", None)
    return (base, OSError) if isinstance(base, type) else (OSError,)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
