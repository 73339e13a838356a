"""Errors and warnings raised by resource_guard.

Every error the package raises on purpose derives from :class:`ResourceGuardError`, so callers can
catch one type. "Does not fit" carries the full report.
"""

from __future__ import annotations

from typing import Any

__all__ = [
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
