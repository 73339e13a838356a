"""resource_guard: will this training run fit, how should it be configured, and where does the time go."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .allocator import DeviceFit
from .checkpointing import apply_checkpointing
from .context import Guard, guard
from .devices import Catalog, DeviceSpec, load_catalog, parse_bytes, resolve_device
from .errors import ConfigurationError, DoesNotFitError, ResourceGuardError, ResourceGuardWarning, TraceError
from .estimate import CATEGORIES, MemoryEstimate, estimate_memory
from .measure import MeasuredStep, measure_training_step
from .monitor import RunMonitor
from .planner import Plan, plan
from .precision import PRECISIONS, PrecisionSpec, parse_precision
from .report import Finding, Report

if TYPE_CHECKING:
    from .lightning_callback import ResourceGuard

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "PRECISIONS",
    "Catalog",
    "ConfigurationError",
    "DeviceFit",
    "DeviceSpec",
    "DoesNotFitError",
    "Finding",
    "Guard",
    "MeasuredStep",
    "MemoryEstimate",
    "Plan",
    "PrecisionSpec",
    "Report",
    "ResourceGuard",
    "ResourceGuardError",
    "ResourceGuardWarning",
    "RunMonitor",
    "TraceError",
    "apply_checkpointing",
    "estimate_memory",
    "guard",
    "load_catalog",
    "measure_training_step",
    "parse_bytes",
    "parse_precision",
    "plan",
    "resolve_device",
]


def __getattr__(name: str) -> Any:
    # Lightning is imported only when the callback is asked for
    if name == "ResourceGuard":
        from .lightning_callback import ResourceGuard

        return ResourceGuard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
