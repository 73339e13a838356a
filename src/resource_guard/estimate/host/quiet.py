"""Keep torch's native log lines and internal log records off the user's console.

torch.profiler's Kineto backend prints ``USDT:… SyncActivityProfilerHandler.cpp:52] profiler_start``
(and ``profiler_stop``) straight to file descriptor 2 from C++, where neither ``sys.stderr`` nor the
logging module can reach it; and FakeTensorMode logs every failed meta kernel with
``log.exception`` (``E… fake_tensor.py:…] failed while attempting to run meta``), even when the
caller handles the error. The estimator probes real kernels under the profiler and traces on fake
tensors, so both would reach the console on every estimate.

- :func:`native_stderr_silenced`: fd 2 sent to ``/dev/null`` for the duration, restored on every
  exit path; a lock serialises it across threads; nested use redirects once.
- :func:`quiet_profile`: ``torch.profiler.profile`` recording CPU memory, with only its start and
  stop silenced: what runs inside (the user's code, in
  :func:`~resource_guard.estimate.host.measure.measure_training_step`) keeps its stderr.
- :func:`torch_logs_silenced`: torch's fake-tensor loggers disabled, their state restored after.

Nothing here catches an exception: an error raised inside propagates after fd 2 is restored.

Example:
    >>> import torch
    >>> with quiet_profile() as prof:
    ...     _ = torch.zeros(4)
    >>> prof.profiler is not None
    True
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

import torch

__all__ = ["native_stderr_silenced", "quiet_profile", "torch_logs_silenced"]

_fd_lock = threading.RLock()
_fd_depth = 0

_log_lock = threading.Lock()
_log_depth = 0
_log_saved: dict[str, bool] = {}
#: torch loggers that report errors the estimator expects and handles (a failed fake kernel)
_TORCH_LOGGERS = ("torch._subclasses.fake_tensor",)


def _flush_stderr() -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to ``/dev/null`` inside the block (for native libraries' prints).

    Python's own ``sys.stderr`` buffer is flushed before and after, so what Python code wrote before
    the block is not lost. If fd 2 cannot be duplicated (closed, no ``/dev/null``), nothing is
    silenced and the block still runs.
    """
    global _fd_depth
    with _fd_lock:
        saved = devnull = -1
        if _fd_depth == 0:
            _flush_stderr()
            try:
                saved = os.dup(2)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 2)
            except OSError:
                for fd in (saved, devnull):
                    if fd >= 0:
                        os.close(fd)
                saved = devnull = -1
        _fd_depth += 1
        try:
            yield
        finally:
            _fd_depth -= 1
            if saved >= 0:
                _flush_stderr()
                os.dup2(saved, 2)
                os.close(saved)
                os.close(devnull)


@contextlib.contextmanager
def torch_logs_silenced() -> Iterator[None]:
    """Disable torch's fake-tensor loggers inside the block; their ``disabled`` flags are restored."""
    global _log_depth
    with _log_lock:
        if _log_depth == 0:
            for name in _TORCH_LOGGERS:
                logger = logging.getLogger(name)
                _log_saved[name] = logger.disabled
                logger.disabled = True
        _log_depth += 1
    try:
        yield
    finally:
        with _log_lock:
            _log_depth -= 1
            if _log_depth == 0:
                for name, disabled in _log_saved.items():
                    logging.getLogger(name).disabled = disabled
                _log_saved.clear()


@contextlib.contextmanager
def quiet_profile() -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile`` of CPU activity with memory records; its start/stop lines silenced.

    Raises ``RuntimeError`` before touching anything if a profiler is already running (the user's
    own session: starting a second one would end it).
    """
    if torch._C._autograd._profiler_enabled():
        raise RuntimeError("another torch profiler is active")
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with native_stderr_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with native_stderr_silenced():
            prof.__exit__(None, None, None)
