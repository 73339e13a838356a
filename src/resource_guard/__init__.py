"""resource_guard: will this training run fit, how should it be configured, and where does the time go."""

from __future__ import annotations

from .errors import ConfigurationError, DoesNotFitError, ResourceGuardError, ResourceGuardWarning, TraceError
from .precision import PRECISIONS, PrecisionSpec, parse_precision

__version__ = "0.1.0"

__all__ = [
    "PRECISIONS",
    "ConfigurationError",
    "DoesNotFitError",
    "PrecisionSpec",
    "ResourceGuardError",
    "ResourceGuardWarning",
    "TraceError",
    "parse_precision",
]
