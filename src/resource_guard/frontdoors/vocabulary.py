"""The settings every door shares, checked with one meaning and in the same words.

``guard(...)``, the Lightning callback ``ResourceGuard(...)`` and the Hugging Face
``ResourceGuardCallback(...)`` (and ``plan_training_args``) take the same names for the same things:

- ``memory_limit``: plan as if each device had only this much memory (bytes, or ``"6GiB"``);
- ``precision``: ``None`` keeps the run's own precision (numerics change only by consent), ``"auto"``
  lets the planner choose, a precision name fixes it;
- ``target_batch_size``: the effective (global) batch, ``micro × accumulation × world size``;
- ``max_seq_len``: the run's longest sequence, the plan is made for it;
- ``log_dir``: where the report goes;
- ``profile``: ``True`` (the default window), ``False`` or a
  :class:`~resource_guard.observe.profiling.ProfileWindow`;
- ``monitor``: run-time monitoring and the report, ``True`` or ``False``;
- ``log_every_n_steps`` / ``log_interval_s``: how often the monitor logs. ``None`` (the default): every
  optimizer step for the first 20, then about every ``log_interval_s`` seconds (2 by default); an int
  ``n``: after step 1 and every ``n``-th step.

:func:`check_shared` refuses a bad value of any of them with ``ConfigurationError`` quoting the call
(``"`ResourceGuardCallback(precision='fp8')` must be None (keep the run's precision), 'auto' or one of
..."``): the wording is the same at every door; only the list of precisions a door can apply differs
(the Trainer's arguments express three).

Example:
    >>> check_shared("guard", precision="bf16")
    'bf16-mixed'
    >>> check_shared("ResourceGuard", monitor="yes")
    Traceback (most recent call last):
    ...
    resource_guard.errors.ConfigurationError: `ResourceGuard(monitor='yes')` must be True or False.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from resource_guard.errors import ConfigurationError
from resource_guard.observe.profiling import ProfileWindow
from resource_guard.step.precision import PRECISIONS, parse_precision

__all__ = ["SHARED", "check_log_dir", "check_shared", "refused"]

SHARED = (
    "memory_limit",
    "precision",
    "target_batch_size",
    "max_seq_len",
    "log_dir",
    "profile",
    "monitor",
    "log_every_n_steps",
    "log_interval_s",
)


def refused(call: str, name: str, value: Any, allowed: str) -> ConfigurationError:
    """The one wording of a refused setting: ```call(name=value)` must be allowed.``"""
    return ConfigurationError(f"`{call}({name}={value!r})` must be {allowed}.")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_shared(
    call: str,
    *,
    memory_limit: Any = None,
    precision: Any = None,
    target_batch_size: Any = None,
    max_seq_len: Any = None,
    log_dir: Any = None,
    profile: Any = True,
    monitor: Any = True,
    log_every_n_steps: Any = None,
    log_interval_s: Any = 2.0,
    precisions: Sequence[str] | None = None,
) -> str | None:
    """Refuse a bad shared setting, quoting ``call``; returns the precision's canonical name (``None``,
    ``"auto"`` or a precision name: ``"bf16"`` becomes ``"bf16-mixed"``).

    ``precisions``: the names this door can apply (default every Lightning precision name).
    """
    from resource_guard.devices import parse_memory_limit

    if memory_limit is not None:
        parse_memory_limit(memory_limit, call)
    names = tuple(precisions) if precisions is not None else tuple(PRECISIONS)
    allowed = f"None (keep the run's precision), 'auto' or one of {', '.join(names)}"
    if precision not in (None, "auto"):
        if not isinstance(precision, (str, int)) or isinstance(precision, bool):
            raise refused(call, "precision", precision, allowed)
        try:
            precision = parse_precision(precision).name
        except ConfigurationError:
            raise refused(call, "precision", precision, allowed) from None
        if precision not in names:
            raise refused(call, "precision", precision, allowed)
    if target_batch_size is not None and not _positive_int(target_batch_size):
        raise refused(call, "target_batch_size", target_batch_size, "a positive int or None")
    if max_seq_len is not None and not _positive_int(max_seq_len):
        raise refused(call, "max_seq_len", max_seq_len, "a positive int or None")
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise refused(call, "log_dir", log_dir, "a directory path or None")
    if not isinstance(profile, (bool, ProfileWindow)):
        raise refused(call, "profile", profile, "True, False or a ProfileWindow")
    if not isinstance(monitor, bool):
        raise refused(call, "monitor", monitor, "True or False")
    if log_every_n_steps is not None and not _positive_int(log_every_n_steps):
        raise refused(call, "log_every_n_steps", log_every_n_steps, "a positive int or None (time-bounded)")
    seconds = isinstance(log_interval_s, (int, float)) and not isinstance(log_interval_s, bool)
    if not seconds or not 0 < log_interval_s < float("inf"):
        raise refused(call, "log_interval_s", log_interval_s, "a number of seconds > 0")
    return precision  # type: ignore[no-any-return]


def check_log_dir(path: str | os.PathLike[str], call: str = "guard") -> None:
    """Make ``path`` (and parents) and prove it writable, or raise a ConfigurationError naming ``call``."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        # one name per process: the ranks of a DDP run check the same log dir at the same moment, and one
        # rank's unlink must not remove the probe another rank is about to unlink
        probe = path / f".resource_guard_write_test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigurationError(
            f"`{call}(log_dir={str(path)!r})` is not writable ({error.strerror or error}); pick another "
            "directory."
        ) from None
