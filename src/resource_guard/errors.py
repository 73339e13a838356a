"""Errors and warnings raised by resource_guard.

Every error the package raises on purpose derives from :class:`ResourceGuardError`, so callers can
catch one type. "Does not fit" carries the full report.
"""

from __future__ import annotations

import re
import sys
import warnings
from typing import Any

__all__ = [
    "warn_at_user",
    "ResourceGuardError",
    "ResourceGuardWarning",
    "ConfigurationError",
    "TraceError",
    "DoesNotFitError",
    "PredictedOutOfMemoryError",
]


class ResourceGuardError(Exception):
    """Base class of every error resource_guard raises on purpose."""


class ResourceGuardWarning(UserWarning):
    """Warnings resource_guard emits (fallbacks, missing hardware, degraded monitoring)."""


class ConfigurationError(ResourceGuardError, ValueError):
    """Bad input: a wrong argument, an unknown device or precision, a malformed catalog."""


class TraceError(ResourceGuardError):
    """The training step could not be traced (the message names the operation)."""


class DoesNotFitError(ResourceGuardError):
    """Nothing fits the device. ``report`` holds needed vs available, what was tried and what would fit."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class PredictedOutOfMemoryError(DoesNotFitError, RuntimeError):
    """The configured batch would run out of memory, predicted before any step, and a smaller one fits.

    Raised by the Hugging Face door under ``TrainingArguments(auto_find_batch_size=True)``: a
    ``RuntimeError`` whose message has accelerate's " out of memory." words, so that accelerate's loop
    lowers the batch and tries again, as after a real out-of-memory error, but without running a step.
    """


# the code between the user's line and a warning: this package and the frameworks that call into it
_NOT_USER = re.compile(
    r"(^|[/\\])(resource_guard|torch|lightning|lightning_fabric|pytorch_lightning|transformers|accelerate)"
    r"[/\\]|^<frozen |[/\\](contextlib|functools|runpy|threading)\.py$"
)


def warn_at_user(message: str, category: type[Warning] = ResourceGuardWarning) -> None:
    """``warnings.warn(message, category)`` located at the user's line: the innermost caller outside
    resource_guard and the frameworks around it (torch, Lightning, transformers, accelerate), whatever
    the depth of the door it came through (a fixed ``stacklevel`` points into the door when the call
    chain changes). The warning filters and ``-W error`` apply as to any warning.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_at_user("no GPU: monitoring the CPU only")
        >>> caught[0].category.__name__, caught[0].filename.endswith("errors.py")
        ('ResourceGuardWarning', False)
    """
    frame = sys._getframe(1)
    level = 2  # warnings.warn's own count: 1 is this function's caller
    while frame.f_back is not None and _NOT_USER.search(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
