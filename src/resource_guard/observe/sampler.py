"""The background sampler: one daemon thread reading host (psutil) and GPU (NVML) gauges every interval.

Host gauges: process CPU% and RSS, system CPU% and available RAM. GPU gauges per sampled GPU (see
:mod:`resource_guard.devices.nvml`): utilization, memory used/total, power, temperature, SM clock. The thread
never raises: a failing part (psutil ``AccessDenied``, an NVML error) is switched off and a message is
queued; the owner (:class:`~resource_guard.RunMonitor`) turns queued messages into one
``ResourceGuardWarning`` each *on the training thread* (warnings raised inside a thread would be lost
or, under ``-W error``, kill it). Readings are averaged (and their maximum kept) between two
:meth:`Sampler.drain` calls.

Without GPUs to read (``threaded=False``, what the monitor asks on a CPU run) there is no thread: a
thread waking beside an OpenMP team that fills every core takes a core from it, and the whole team
waits at its next barrier. The owner calls :meth:`Sampler.maybe_sample` at its log boundaries, from the
training thread, which reads at most once per ``interval_s``; the process CPU% of such a reading is
the mean since the previous one (psutil's ``cpu_percent(None)``), so nothing is lost by reading rarely.
:attr:`Sampler.busy_s` is the time spent reading, the sampler's own cost (stated in the report).

Example:
    >>> s = Sampler(interval_s=0.01)
    >>> s.sample_once()
    >>> sorted(s.drain())[:2]
    ['host/available_ram_bytes', 'host/process_cpu_percent']
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from resource_guard.devices.nvml import NvmlDevices, NvmlUnavailable
from resource_guard.errors import ConfigurationError

__all__ = ["Sampler", "peak_rss_bytes", "reset_peak_rss"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def peak_rss_bytes() -> int | None:
    """The process's peak resident set size since the last :func:`reset_peak_rss` (Linux ``VmHWM``).

    ``None`` where ``/proc/self/status`` is not readable (macOS, Windows).
    """
    try:
        text = _STATUS.read_bytes()
        start = text.index(b"VmHWM:") + 6
        return int(text[start : text.index(b"kB", start)]) * 1024
    except (OSError, ValueError):
        return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0, ``echo 5 > /proc/self/clear_refs``).

    Returns False where that is not possible; the caller then falls back to the sampled RSS maximum.
    """
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class _Stats:
    """Running mean and maximum of one gauge."""

    __slots__ = ("total", "count", "peak")

    def __init__(self) -> None:
        self.total, self.count, self.peak = 0.0, 0, float("-inf")

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1
        self.peak = max(self.peak, value)


class Sampler:
    """Samples host and GPU gauges on a daemon thread every ``interval_s`` seconds.

    Args:
        interval_s: seconds between samples (> 0).
        gpu_indices: torch CUDA indices to read through NVML; empty for none.

    Keys of :meth:`drain`: ``host/process_cpu_percent``, ``host/process_rss_bytes``,
    ``host/system_cpu_percent``, ``host/available_ram_bytes`` and ``gpu{i}/<field>``.
    """

    def __init__(
        self, interval_s: float = 1.0, gpu_indices: Sequence[int] = (), *, threaded: bool = True
    ) -> None:
        if not (isinstance(interval_s, (int, float)) and 0 < interval_s < float("inf")):
            raise ConfigurationError(f"`Sampler(interval_s={interval_s!r})` must be a number of seconds > 0")
        self.interval_s = float(interval_s)
        self._gpu_indices = tuple(gpu_indices)
        self._nvml: NvmlDevices | None = None
        self._process: Any = None
        self._host_ok = True
        self._lock = threading.Lock()
        self._stats: dict[str, _Stats] = {}
        self._messages: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.threaded = bool(threaded)
        self.busy_s = 0.0  # seconds spent reading (both modes)
        self._last_read: float | None = None  # time.monotonic() of the last reading

    def start(self) -> None:
        """Start the thread (idempotent). NVML is opened lazily by the thread's first sample. Without a
        thread (``threaded=False``): one reading now, which starts psutil's CPU measurement."""
        if not self.threaded:
            if self._last_read is None:
                self.sample_once()
                with self._lock:
                    self._stats.clear()  # the priming reading's CPU% covers no time
            return
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="resource-guard-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join the thread, then shut NVML down (idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        if self._nvml is not None:
            self._nvml.close()

    def _run(self) -> None:
        self.sample_once()
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def maybe_sample(self, *, force: bool = False) -> bool:
        """Without a thread: one reading if ``interval_s`` has passed since the last (or ``force``).
        With a thread, nothing (the thread reads). Returns whether it read. Never raises."""
        if self.threaded:
            return False
        last = self._last_read
        if not force and last is not None and time.monotonic() - last < self.interval_s:
            return False
        self.sample_once()
        return True

    def sample_once(self) -> None:
        """Take one reading of every enabled part (what the thread does each interval). Never raises."""
        begun = time.perf_counter()
        self._last_read = time.monotonic()
        values: dict[str, float] = {}
        if self._host_ok:
            try:
                values.update(self._host())
            except Exception as exc:  # psutil.AccessDenied, NoSuchProcess, odd platforms
                self._host_ok = False
                self._say(f"host sampling (psutil) disabled: {type(exc).__name__}: {exc}")
        if self._gpu_indices:
            try:
                values.update(self._gpus())
            except NvmlUnavailable as exc:
                self._gpu_indices = ()
                self._say(f"GPU sampling (NVML) disabled: {exc}")
            except Exception as exc:  # a broken pynvml: degrade all the same
                self._gpu_indices = ()
                if self._nvml is not None:
                    self._nvml.close()
                self._say(f"GPU sampling (NVML) disabled: {type(exc).__name__}: {exc}")
        with self._lock:
            for key, value in values.items():
                self._stats.setdefault(key, _Stats()).add(value)
            self.busy_s += time.perf_counter() - begun

    def _host(self) -> dict[str, float]:
        if self._process is None:
            self._process = psutil.Process()
            self._process.cpu_percent(None)  # the first call only starts the measurement
            psutil.cpu_percent(None)
        memory = self._process.memory_info()
        return {
            "host/process_cpu_percent": float(self._process.cpu_percent(None)),
            "host/process_rss_bytes": float(memory.rss),
            "host/system_cpu_percent": float(psutil.cpu_percent(None)),
            "host/available_ram_bytes": float(psutil.virtual_memory().available),
        }

    def _gpus(self) -> dict[str, float]:
        if self._nvml is None:
            self._nvml = NvmlDevices(self._gpu_indices)
        self._nvml.open()
        out = {}
        for index, fields in self._nvml.sample().items():
            out.update({f"gpu{index}/{k}": v for k, v in fields.items() if v is not None})
        return out

    def drain(self) -> dict[str, tuple[float, float]]:
        """``{key: (mean, max)}`` of the readings since the previous drain; resets the accumulators."""
        with self._lock:
            stats, self._stats = self._stats, {}
        return {key: (s.total / s.count, s.peak) for key, s in stats.items() if s.count}

    def pop_messages(self) -> list[str]:
        """Messages about parts that were switched off since the previous call (for warnings)."""
        with self._lock:
            messages, self._messages = self._messages, []
        return messages

    def _say(self, message: str) -> None:
        with self._lock:
            self._messages.append(message)

    def __del__(self) -> None:  # a forgotten sampler must not keep NVML initialised
        with contextlib.suppress(Exception):
            self._stop.set()
