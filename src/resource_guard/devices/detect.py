"""Detection of this machine's devices: CUDA/ROCm GPUs, Apple MPS and the CPU, as :class:`DeviceSpec`.

GPUs come from NVML (no CUDA context is created; ``CUDA_VISIBLE_DEVICES`` is respected), with
``torch.cuda`` as a fallback when NVML is unusable; then ``torch.backends.mps``, and psutil plus the
CPU profile (:mod:`resource_guard.devices.cpu`: ``/proc/cpuinfo`` under the oneDNN cap) for
the CPU. Each probe sits behind a small private function (a seam the tests
replace). Nothing happens at import. :func:`resolve_device` turns a user's device argument into a
local :class:`DeviceSpec` or a catalog entry (:mod:`resource_guard.devices.catalog`).

Example:
    >>> from resource_guard.devices.detect import detect_local_devices
    >>> found = detect_local_devices()
    >>> found[-1].name, found[-1].kind, found[-1].source
    ('cpu', 'cpu', 'detected')
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from resource_guard.devices.catalog import Catalog, DeviceSpec, load_catalog
from resource_guard.devices.cpu import cpu_profile, read_cpu_profile
from resource_guard.errors import ConfigurationError

__all__ = ["cpu_summary", "detect_local_devices", "resolve_device"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _GpuInfo:
    """What a driver says about one GPU (what the seams below return)."""

    name: str
    total_bytes: int
    free_bytes: int | None
    kind: str = "cuda"
    compute_capability: str | None = None
    uuid: str = ""
    unified_memory: bool = False


def _nvml_devices() -> list[_GpuInfo] | None:
    """All physical NVIDIA GPUs in NVML order; None if NVML is unusable. Creates no CUDA context."""
    try:
        import pynvml
    except ImportError:
        return None
    nvml_error: Any = (getattr(pynvml, "NVMLError", OSError), OSError)
    try:
        pynvml.nvmlInit()
    except nvml_error as exc:
        _log.debug("NVML unavailable (%s); GPUs are probed through torch.cuda instead", exc)
        return None
    try:
        gpus = []
        for physical in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(physical)
            name, uuid = (_str(get(handle)) for get in (pynvml.nvmlDeviceGetName, pynvml.nvmlDeviceGetUUID))
            capability = None
            with contextlib.suppress(*nvml_error):
                capability = "{}.{}".format(*pynvml.nvmlDeviceGetCudaComputeCapability(handle))
            try:
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(_GpuInfo(name, int(memory.total), int(memory.free), "cuda", capability, uuid))
            except nvml_error:  # unified-memory GPUs (e.g. GB10) have no dedicated memory to report
                ram = psutil.virtual_memory()
                gpus.append(_GpuInfo(name, ram.total, ram.available, "cuda", capability, uuid, True))
        return gpus
    except nvml_error as exc:
        _log.debug("NVML query failed (%s); GPUs are probed through torch.cuda instead", exc)
        return None
    finally:
        with contextlib.suppress(*nvml_error):
            pynvml.nvmlShutdown()


def _str(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _visible_gpus(physical: list[_GpuInfo], visible: str | None) -> list[_GpuInfo] | None:
    """NVML GPUs in torch index order under ``CUDA_VISIBLE_DEVICES``; None if it cannot be mapped.

    Follows CUDA: entries are indices or ``GPU-<uuid prefix>``; the list ends at the first invalid or
    repeated entry; an empty value hides every GPU. MIG entries are left to torch (None). Assumes the
    PCI-bus order NVML uses (``CUDA_DEVICE_ORDER=PCI_BUS_ID``; the usual order on uniform nodes).
    """
    if visible is None:
        return list(physical)
    chosen: list[int] = []
    for item in (part.strip().lower() for part in visible.split(",")):
        if item.startswith("mig-"):
            return None
        if item.startswith("gpu-"):
            found = [i for i, gpu in enumerate(physical) if gpu.uuid.lower().startswith(item)]
            index = found[0] if len(found) == 1 else -1
        else:
            index = int(item) if item.isdigit() else -1
        if not 0 <= index < len(physical) or index in chosen:
            break
        chosen.append(index)
    return [physical[i] for i in chosen]


def _torch_cuda_built() -> bool:
    return bool(torch.backends.cuda.is_built())


def _torch_cuda_devices() -> list[_GpuInfo]:
    """Fallback when NVML is unusable (ROCm, no driver library): ``torch.cuda`` (creates a context)."""
    if not torch.cuda.is_available():
        return []
    kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free: int | None = None
        total = int(props.total_memory)
        with contextlib.suppress(RuntimeError):
            free, total = (int(n) for n in torch.cuda.mem_get_info(index))
        capability = f"{props.major}.{props.minor}" if kind == "cuda" else None
        gpus.append(_GpuInfo(props.name, total, free, kind, capability))
    return gpus


def _detected(name: str, kind: str, memory_bytes: int, match: DeviceSpec | None, **extra: Any) -> DeviceSpec:
    """A detected device, with the datasheet facts of the catalog entry it matched (if any)."""
    facts: dict[str, Any] = {"aliases": (), "bf16": False}
    if match is not None:
        facts = {f: getattr(match, f) for f in ("vendor", "bf16", "compute_capability", "peak_tflops")}
        facts.update(aliases=(match.name,), memory_bandwidth_gbps=match.memory_bandwidth_gbps)
        facts.update(price_per_hour_usd=match.price_per_hour_usd)
    facts.update({k: v for k, v in extra.items() if v is not None})
    return DeviceSpec(name=name, kind=kind, memory_bytes=memory_bytes, source="detected", **facts)


def _cuda_specs(catalog: Catalog) -> list[DeviceSpec]:
    if not _torch_cuda_built():  # a CPU-only torch cannot use the GPUs NVML would list
        return []
    physical = _nvml_devices()
    gpus = None if physical is None else _visible_gpus(physical, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if gpus is None:
        gpus = _torch_cuda_devices()
    specs = []
    for index, gpu in enumerate(gpus):
        match = catalog.match_hardware_name(gpu.name, memory_bytes=gpu.total_bytes)
        cc = gpu.compute_capability
        bf16 = None if match or not cc else gpu.kind == "cuda" and int(cc.split(".")[0]) >= 8
        vendor = None if match else ("amd" if gpu.kind == "rocm" else "nvidia")
        specs.append(_detected(
            f"cuda:{index}", gpu.kind, gpu.total_bytes, match, display_name=gpu.name, vendor=vendor,
            bf16=bf16, compute_capability=cc, unified_memory=gpu.unified_memory, free_bytes=gpu.free_bytes,
            index=index,
        ))  # fmt: skip
    return specs


def cpu_summary(cpuinfo: str | None = None) -> str:
    r"""One line naming this CPU and what decides its kernels (:meth:`CpuProfile.summary`): model, ISA
    level, flags (``-`` = absent), native bf16/fp16/AMX, torch's CPU capability and a oneDNN cap if one
    is set. For logs, warnings and skip reasons. ``cpuinfo``: another CPU's ``/proc/cpuinfo`` text
    (under this process's cap); by default the profile every decision reads (:func:`cpu_profile`).

    Example:
        >>> cpu_summary("model name : Some CPU\nflags : fpu sse4_1 avx avx2")  # doctest: +ELLIPSIS
        'Some CPU; ISA avx2 (avx2 -avx512f -avx512_bf16 -avx512_fp16 -amx_bf16); native bf16 no, ...'
    """
    profile = cpu_profile() if cpuinfo is None else read_cpu_profile(cpuinfo, os.environ)
    return profile.summary()


def _cpu_spec() -> DeviceSpec:
    """Host RAM, and native bf16 from the CPU profile (:func:`cpu_profile`: the oneDNN cap included)."""
    profile = cpu_profile()
    ram = psutil.virtual_memory()
    return _detected("cpu", "cpu", int(ram.total), None, display_name=profile.model, bf16=profile.native_bf16,
                     free_bytes=int(ram.available))  # fmt: skip


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _mps_spec(catalog: Catalog) -> DeviceSpec:
    """The Apple GPU: unified memory, capped at Metal's recommended working set when torch says so."""
    ram = psutil.virtual_memory()
    total = int(ram.total)
    with contextlib.suppress(AttributeError, RuntimeError):
        total = min(total, int(torch.mps.recommended_max_memory()))
    chip = ""
    if sys.platform == "darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            cmd = ["sysctl", "-n", "machdep.cpu.brand_string"]
            chip = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    match = catalog.match_hardware_name(chip) if chip else None  # no memory filter: RAM varies per Mac
    return _detected("mps", "mps", total, match, display_name=chip or "Apple GPU (MPS)", vendor="apple",
                     unified_memory=True, free_bytes=min(int(ram.available), total))  # fmt: skip


def detect_local_devices(catalog: Catalog | None = None) -> list[DeviceSpec]:
    """The devices of this machine: CUDA/ROCm GPUs (torch index order), then MPS, then always ``cpu``.

    GPUs come from NVML (no CUDA context; ``CUDA_VISIBLE_DEVICES`` respected; NVML shut down before
    returning), or from ``torch.cuda`` when NVML is unusable. Datasheet facts (peaks, bandwidth, bf16)
    come from the catalog entry the driver's name matches. Never raises for missing hardware.
    """
    catalog = catalog if catalog is not None else load_catalog()
    found = _cuda_specs(catalog)
    if _mps_available():
        found.append(_mps_spec(catalog))
    found.append(_cpu_spec())
    return found


def resolve_device(device: str | DeviceSpec | None = "auto", catalog: Catalog | None = None) -> DeviceSpec:
    """Turn a user's device argument into a :class:`DeviceSpec`.

    ``"auto"``/None: the CUDA/ROCm GPU with most free memory, else MPS, else the CPU (all detected).
    ``"cpu"`` (or torch's ``"cpu:N"``), ``"mps"``, ``"cuda"`` (= ``"cuda:0"``), ``"cuda:N"``: that detected
    device. Any other name is looked up in the catalog (no hardware needed), e.g. ``"a100-40gb"`` for a
    pre-flight check.

    Raises:
        ConfigurationError: the device is absent or unknown; the message says what exists.
    """
    if isinstance(device, DeviceSpec):
        return device
    if device is not None and not isinstance(device, str):
        raise ConfigurationError(f"`resolve_device({device!r})` must be a device name, a DeviceSpec or None")
    name = "auto" if device is None else device.strip()
    catalog = catalog if catalog is not None else load_catalog()
    if name.lower() == "auto":
        local = detect_local_devices(catalog)
        gpus = [d for d in local if d.kind in ("cuda", "rocm")]
        if gpus:  # most free memory (capacity if unknown); the lowest index on ties
            return max(
                gpus,
                key=lambda d: (d.memory_bytes if d.free_bytes is None else d.free_bytes, -(d.index or 0)),
            )
        return next((d for d in local if d.kind == "mps"), local[-1])
    if re.fullmatch(r"cpu(?::\d+)?", name.lower()):  # "cpu:0": the Trainer's `args.device` on CPU ranks
        return _cpu_spec()
    if name.lower() == "mps":
        if not _mps_available():
            raise ConfigurationError(
                "`resolve_device('mps')`: no MPS device is available (needs Apple silicon and a PyTorch "
                "build with MPS). Use 'auto' or 'cpu'."
            )
        return _mps_spec(catalog)
    cuda = re.fullmatch(r"cuda(?::(\d+))?", name.lower())
    if cuda is not None:
        gpus = _cuda_specs(catalog)
        wanted = f"cuda:{int(cuda[1] or 0)}"
        for gpu in gpus:
            if gpu.name == wanted:
                return gpu
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"visible: {', '.join(g.name for g in gpus)}" if gpus else "no CUDA device is visible"
        seen += "" if env is None else f" (CUDA_VISIBLE_DEVICES={env!r})"
        raise ConfigurationError(
            f"`resolve_device({device!r})`: {wanted} does not exist, {seen}. Use 'auto' or 'cpu', or a "
            "catalog name such as 'a100-40gb' to plan for hardware you lack."
        )
    try:
        return catalog.get(name)
    except ConfigurationError as exc:
        detected = "'auto', 'cpu', 'cuda', 'cuda:N', 'mps'"
        raise ConfigurationError(f"`resolve_device({device!r})`: {exc} Local devices: {detected}.") from None
