"""Devices: the catalog shipped with the package, this machine's devices, and turning a name into one.

- :mod:`~resource_guard.devices.catalog`: :class:`DeviceSpec`, :class:`Catalog`, ``catalog.yaml``,
  byte sizes (``parse_bytes`` / ``format_bytes``, ``memory_limit``).
- :mod:`~resource_guard.devices.cpu`: the host CPU as one :class:`CpuProfile` (ISA level,
  native bf16/fp16, AMX, the ``ONEDNN_MAX_CPU_ISA`` cap) that every host-dependent decision reads;
  :func:`play_cpu` plays another CPU (tests).
- :mod:`~resource_guard.devices.detect`: local CUDA/ROCm (NVML first, no CUDA context), MPS and CPU;
  :func:`resolve_device`.
- :mod:`~resource_guard.devices.nvml`: the NVML handles the monitor samples.

Imports only :mod:`resource_guard.errors`.
"""

from resource_guard.devices.catalog import (
    DEVICE_KINDS,
    PEAK_DTYPES,
    Catalog,
    DeviceSpec,
    format_bytes,
    load_catalog,
    parse_bytes,
    parse_memory_limit,
)
from resource_guard.devices.cpu import CpuProfile, cpu_profile, play_cpu
from resource_guard.devices.detect import cpu_summary, detect_local_devices, resolve_device

__all__ = [
    "DEVICE_KINDS",
    "PEAK_DTYPES",
    "Catalog",
    "CpuProfile",
    "cpu_profile",
    "cpu_summary",
    "DeviceSpec",
    "detect_local_devices",
    "format_bytes",
    "load_catalog",
    "parse_bytes",
    "parse_memory_limit",
    "play_cpu",
    "resolve_device",
]
