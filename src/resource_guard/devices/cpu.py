"""The host CPU as one profile: what every host-dependent decision reads, a oneDNN cap included.

x86-64 CPUs of one machine kind differ (an AVX2 EPYC, an AVX-512 EPYC with bf16, an AMX Xeon), and
several decisions depend on which one runs: the planner's ``precision="auto"`` on a CPU (native bf16
or fp32), whether bf16/fp16 matmuls go through oneDNN (which packs operands into scratch: the
estimator's kernel allowances), and the lines that name the CPU in warnings, logs and the pytest
header. They all read :func:`cpu_profile`, so they agree, and so a cap plays another CPU completely:

- **The cap.** ``ONEDNN_MAX_CPU_ISA`` (else ``DNNL_MAX_CPU_ISA``, the name oneDNN read before) caps
  oneDNN at an instruction-set level, e.g. ``AVX2``, ``AVX512_CORE``, ``AVX512_CORE_BF16``,
  ``AVX512_CORE_AMX``. The profile's flags are the hardware's flags that level includes, as oneDNN
  masks them: a cap below bf16 means no native bf16 (the fp32 plan); a cap above the hardware changes
  nothing; a value oneDNN does not know is ignored, as oneDNN ignores it (and the summary says so).
- **Read once per process**, as oneDNN reads its cap once: :func:`cpu_profile` is cached.
- **One seam for tests**: :func:`play_cpu` makes the profile another CPU's for a block (``"avx2"``,
  ``"avx512_core_bf16"``...). A played profile changes every decision above; it cannot change what a
  real kernel does, so the probes that run real kernels (:mod:`resource_guard.estimate.host.cpu_support`)
  still answer for the process's own CPU, and say so.

Example:
    >>> flags = "sse4_1 avx avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 amx_tile amx_int8"
    >>> amx = f"model name : Xeon\\nflags : {flags} amx_bf16"
    >>> read_cpu_profile(amx, {}).isa, read_cpu_profile(amx, {}).native_bf16
    ('avx512_core_amx', True)
    >>> capped = read_cpu_profile(amx, {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    >>> capped.isa, capped.native_bf16, capped.hardware_isa, capped.cap_source
    ('avx2', False, 'avx512_core_amx', 'ONEDNN_MAX_CPU_ISA')
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CPU_ISA_FLAGS",
    "ISA_LEVELS",
    "CpuProfile",
    "cpu_profile",
    "play_cpu",
    "process_cpu_profile",
    "read_cpu_profile",
]

_AVX2 = frozenset({"sse4_1", "avx", "avx2"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_BF16 = _AVX512 | {"avx512_vnni", "avx512_bf16"}
_AMX = _BF16 | {"amx_tile", "amx_int8", "amx_bf16"}

#: oneDNN's x86-64 instruction-set levels (the values of ``ONEDNN_MAX_CPU_ISA``, lower case), lowest
#: first, each with the ``/proc/cpuinfo`` flags it uses. A level is not a superset of every level
#: before it (``avx2_vnni`` is not in ``avx512_core``), as in oneDNN's own masks.
ISA_LEVELS: dict[str, frozenset[str]] = {
    "sse41": frozenset({"sse4_1"}),
    "avx": frozenset({"sse4_1", "avx"}),
    "avx2": _AVX2,
    "avx2_vnni": _AVX2 | {"avx_vnni"},
    "avx2_vnni_2": _AVX2 | {"avx_vnni", "avx_vnni_int8", "avx_ne_convert"},
    "avx512_core": _AVX512,
    "avx512_core_vnni": _AVX512 | {"avx512_vnni"},
    "avx512_core_bf16": _BF16,
    "avx10_1_512": _BF16 | {"avx512_fp16"},
    "avx512_core_amx": _AMX,
    "avx10_1_512_amx": _AMX | {"avx512_fp16"},
    "avx10_1_512_amx_fp16": _AMX | {"avx512_fp16", "amx_fp16"},
}
_ALIASES = {"avx512_core_fp16": "avx10_1_512", "avx512_core_amx_fp16": "avx10_1_512_amx"}
_UNCAPPED = ("all", "default", "avx10_2_512", "avx10_2_512_amx_2")  # no level here above them
_KNOWN_FLAGS = frozenset().union(*ISA_LEVELS.values())

#: the flags the summary line marks present or absent (``-``): what decides oneDNN's kernels
CPU_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")
_CAP_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # oneDNN's order: the first one set wins


@dataclass(frozen=True)
class CpuProfile:
    """What decides this CPU's training behaviour, after the oneDNN cap.

    Attributes:
        model: the CPU's name (``/proc/cpuinfo``'s ``model name``, else ``platform.processor()``).
        isa: the highest oneDNN level (:data:`ISA_LEVELS`) the flags in effect reach, e.g. ``"avx2"``;
            ``None`` off x86-64 (Arm) or where the flags are unreadable.
        hardware_isa: the same, before the cap (under :func:`play_cpu`: the process's own level).
        flags: the instruction-set flags in effect (the hardware's, within the cap).
        native_bf16: bf16 arithmetic in hardware (``avx512_bf16``/``amx_bf16``, Arm ``bf16``): what
            makes ``bf16-mixed`` worth choosing on a CPU.
        native_fp16: fp16 arithmetic in hardware (``avx512_fp16``/``amx_fp16``, Arm ``asimdhp``).
        amx: Intel AMX tiles.
        cap: the cap's value as set (``"AVX2"``), ``None`` if none; ``cap_source`` names where it came
            from (``"ONEDNN_MAX_CPU_ISA"``, ``"DNNL_MAX_CPU_ISA"``, ``"play_cpu"``).
        cap_ignored: the cap's value is no oneDNN level, so oneDNN (and this profile) ignore it.
    """

    model: str
    isa: str | None
    hardware_isa: str | None
    flags: frozenset[str]
    native_bf16: bool
    native_fp16: bool
    amx: bool
    cap: str | None = None
    cap_source: str | None = None
    cap_ignored: bool = False

    @property
    def played(self) -> bool:
        """Set by :func:`play_cpu`: not the CPU this process's kernels run on."""
        return self.cap_source == "play_cpu"

    def onednn_runs(self, dtype: torch.dtype) -> bool | None:
        """Whether oneDNN runs ``dtype`` (bf16/fp16) GEMMs here: torch routes them to oneDNN, which packs
        operands into scratch, where oneDNN supports the type (bf16: AVX-512 core or AVX2-VNNI-2; fp16:
        AVX-512 fp16 or AVX2-VNNI-2), else to ATen's own loop. ``None`` off x86-64 (unknown)."""
        if self.isa is None:
            return None
        if dtype == torch.bfloat16:
            return self.flags >= _AVX512 or ISA_LEVELS["avx2_vnni_2"] <= self.flags
        if dtype == torch.float16:
            return "avx512_fp16" in self.flags or ISA_LEVELS["avx2_vnni_2"] <= self.flags
        return False

    def describe_cap(self) -> str:
        """``""``, or ``"ONEDNN_MAX_CPU_ISA=AVX2 (plays avx2 on avx512_core_amx)"`` and the like."""
        if self.cap is None:
            return ""
        said = f"{self.cap_source}={self.cap}"
        if self.cap_ignored:
            return f"{said} (not a oneDNN ISA: ignored)"
        if self.played:
            return f"{said} (played: this process runs on {self.hardware_isa or 'another CPU'})"
        if self.isa == self.hardware_isa:
            return f"{said} (at or above this CPU: no effect)"
        return f"{said} (plays {self.isa} on {self.hardware_isa})"

    def native_bf16_reason(self) -> str:
        """Why ``bf16-mixed`` is or is not chosen on this CPU: the planner's reason text."""
        where = f"the CPU ({self.model}; ISA {self.isa or 'unknown'}"
        where += f"; {self.describe_cap()})" if self.cap else ")"
        if self.native_bf16:
            return f"{where} has native bf16 (avx512_bf16/amx_bf16)"
        return f"{where} has no native bf16 (avx512_bf16/amx_bf16): fp32"

    def summary(self) -> str:
        """One line for logs, warnings and skip reasons: model, ISA, the flags that decide oneDNN's
        kernels (``-`` = absent), native bf16/fp16/AMX, torch's CPU capability and the cap."""
        marks = " ".join(f if f in self.flags else f"-{f}" for f in CPU_ISA_FLAGS)
        yes = {True: "yes", False: "no"}
        line = (
            f"{self.model}; ISA {self.isa or 'unknown'} ({marks}); native bf16 {yes[self.native_bf16]}, "
            f"fp16 {yes[self.native_fp16]}, AMX {yes[self.amx]}; "
            f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
        )
        return f"{line}; {self.describe_cap()}" if self.cap else line


def _level(flags: frozenset[str]) -> str | None:
    return next((name for name, needs in reversed(ISA_LEVELS.items()) if needs <= flags), None)


def _fields(cpuinfo: str | None) -> list[tuple[str, str]]:
    out = []
    for line in (cpuinfo or "").splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        out.append((key, value))
    return out


def read_cpu_profile(cpuinfo: str | None, environ: Mapping[str, str]) -> CpuProfile:
    """The profile of the CPU ``cpuinfo`` describes (``/proc/cpuinfo``'s text), under the cap in ``environ``.

    Pure (no I/O): :func:`cpu_profile` calls it with this machine's ``/proc/cpuinfo`` and ``os.environ``.
    """
    fields = _fields(cpuinfo)
    model = next((v for k, v in fields if k == "model name" and v), "") or platform.processor() or "CPU"
    all_flags = frozenset(f for k, v in fields if k in ("flags", "Features") for f in v.split())
    x86 = any(k == "flags" for k, _ in fields)
    hardware = all_flags & _KNOWN_FLAGS if x86 else all_flags
    flags = hardware
    cap = source = None
    ignored = False
    for var in _CAP_VARS:
        if environ.get(var, "").strip():
            cap, source = environ[var].strip(), var
            break
    if cap is not None and x86:
        name = _ALIASES.get(cap.lower(), cap.lower())
        if name in ISA_LEVELS:
            flags = hardware & ISA_LEVELS[name]
        elif name not in _UNCAPPED:
            ignored = True
    arm_bf16, arm_fp16 = (not x86 and "bf16" in flags), (not x86 and "asimdhp" in flags)
    return CpuProfile(
        model=model,
        isa=_level(flags) if x86 else None,
        hardware_isa=_level(hardware) if x86 else None,
        flags=flags,
        native_bf16=bool(flags & {"avx512_bf16", "amx_bf16"}) or arm_bf16,
        native_fp16=bool(flags & {"avx512_fp16", "amx_fp16"}) or arm_fp16,
        amx="amx_tile" in flags,
        cap=cap,
        cap_source=source,
        cap_ignored=ignored,
    )


def _read_cpuinfo() -> str | None:
    with contextlib.suppress(OSError):
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    return None


@functools.cache
def _process_profile() -> CpuProfile:
    return read_cpu_profile(_read_cpuinfo(), os.environ)


_played: list[CpuProfile] = []


def cpu_profile() -> CpuProfile:
    """This process's CPU profile: read once (oneDNN reads its cap once too), or the one :func:`play_cpu`
    plays. Every host-dependent decision reads it.

    Example:
        >>> cpu_profile() == cpu_profile()
        True
    """
    return _played[-1] if _played else _process_profile()


def process_cpu_profile() -> CpuProfile:
    """The CPU this process's kernels really run on (the oneDNN cap included), even under :func:`play_cpu`."""
    return _process_profile()


@contextlib.contextmanager
def play_cpu(isa: str) -> Iterator[CpuProfile]:
    """Make :func:`cpu_profile` a CPU whose flags are exactly those of oneDNN level ``isa`` (a test seam).

    Example:
        >>> with play_cpu("avx512_core_bf16") as bf16_host:
        ...     cpu_profile().native_bf16, bf16_host.cap_source
        (True, 'play_cpu')
        >>> with play_cpu("AVX2"):
        ...     cpu_profile().native_bf16
        False

    Raises:
        ValueError: ``isa`` is not a level of :data:`ISA_LEVELS`.
    """
    name = _ALIASES.get(isa.lower(), isa.lower())
    if name not in ISA_LEVELS:
        raise ValueError(f"`play_cpu({isa!r})`: not a oneDNN ISA level; one of {', '.join(ISA_LEVELS)}")
    flags = " ".join(sorted(ISA_LEVELS[name]))
    real = _process_profile()
    played = read_cpu_profile(f"model name : played {name}\nflags : {flags}", {})
    played = CpuProfile(**{**played.__dict__, "cap": isa, "cap_source": "play_cpu", "hardware_isa": real.isa})
    _played.append(played)
    try:
        yield played
    finally:
        _played.pop()
