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
