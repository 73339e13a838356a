"""resource_guard: will this training run fit, how should it be configured, and where does the time go."""

from __future__ import annotations

from .allocator import DeviceFit
from .devices import Catalog, DeviceSpec, load_catalog, parse_bytes, resolve_device
from .errors import ConfigurationError, DoesNotFitError, ResourceGuardError, ResourceGuardWarning, TraceError
from .estimate import CATEGORIES, MemoryEstimate, estimate_memory
from .measure import MeasuredStep, measure_training_step
from .precision import PRECISIONS, PrecisionSpec, parse_precision

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "PRECISIONS",
    "Catalog",
    "ConfigurationError",
    "DeviceFit",
    "DeviceSpec",
    "DoesNotFitError",
    "MeasuredStep",
    "MemoryEstimate",
    "PrecisionSpec",
    "ResourceGuardError",
    "ResourceGuardWarning",
    "TraceError",
    "estimate_memory",
    "load_catalog",
    "measure_training_step",
    "parse_bytes",
    "parse_precision",
    "resolve_device",
]
