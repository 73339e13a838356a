"""resource_guard: will this training run fit, how should it be configured, and where does the time go."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from resource_guard.devices import Catalog, DeviceSpec, load_catalog, parse_bytes, resolve_device
from resource_guard.errors import (
    ConfigurationError,
    DoesNotFitError,
    ResourceGuardError,
    ResourceGuardWarning,
    TraceError,
)
from resource_guard.estimate import (
    CATEGORIES,
    DeviceFit,
    MeasuredStep,
    MemoryEstimate,
    UserStep,
    estimate_memory,
    measure_training_step,
)
from resource_guard.frontdoors.context import Guard, guard
from resource_guard.observe.monitor import RunMonitor
from resource_guard.planning.checkpointing import apply_checkpointing
from resource_guard.planning.planner import Plan, plan
from resource_guard.planning.projection import Projection, ProjectionRow, project_training
from resource_guard.planning.steptime import Calibration, Interconnect
from resource_guard.report.findings import Finding, Report
from resource_guard.step.precision import PRECISIONS, PrecisionSpec, parse_precision

if TYPE_CHECKING:
    from resource_guard.frontdoors.lightning_callback import ResourceGuard

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "PRECISIONS",
    "Calibration",
    "Catalog",
    "ConfigurationError",
    "DeviceFit",
    "DeviceSpec",
    "DoesNotFitError",
    "Finding",
    "Guard",
    "Interconnect",
    "MeasuredStep",
    "MemoryEstimate",
    "Plan",
    "PrecisionSpec",
    "Projection",
    "ProjectionRow",
    "Report",
    "ResourceGuard",
    "ResourceGuardError",
    "ResourceGuardWarning",
    "RunMonitor",
    "TraceError",
    "UserStep",
    "apply_checkpointing",
    "estimate_memory",
    "guard",
    "load_catalog",
    "measure_training_step",
    "parse_bytes",
    "parse_precision",
    "plan",
    "project_training",
    "resolve_device",
]


def __getattr__(name: str) -> Any:
    # Lightning is imported only when the callback is asked for
    if name == "ResourceGuard":
        from resource_guard.frontdoors.lightning_callback import ResourceGuard

        return ResourceGuard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
