"""resource_guard: will this training run fit, how should it be configured, and where does the time go."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from resource_guard.devices import Catalog, DeviceSpec, load_catalog, parse_bytes, resolve_device
    from resource_guard.errors import (
        ConfigurationError,
        DoesNotFitError,
        PredictedOutOfMemoryError,
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
        estimate_eval_memory,
        estimate_memory,
        measure_training_step,
    )
    from resource_guard.frontdoors.guard.context import Guard, guard
    from resource_guard.frontdoors.hf.plan import plan_training_args
    from resource_guard.frontdoors.hf.trainer import ResourceGuardCallback
    from resource_guard.frontdoors.lightning.callback import ResourceGuard
    from resource_guard.observe.monitor import RunMonitor
    from resource_guard.planning.checkpointing import apply_checkpointing
    from resource_guard.planning.planner import Plan, plan
    from resource_guard.planning.projection import Projection, ProjectionRow, project_training
    from resource_guard.planning.steptime import Calibration, Interconnect
    from resource_guard.report.findings import Finding, Report
    from resource_guard.step.precision import PRECISIONS, PrecisionSpec, parse_precision

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
    "PredictedOutOfMemoryError",
    "Projection",
    "ProjectionRow",
    "Report",
    "ResourceGuard",
    "ResourceGuardCallback",
    "ResourceGuardError",
    "ResourceGuardWarning",
    "RunMonitor",
    "TraceError",
    "UserStep",
    "apply_checkpointing",
    "estimate_eval_memory",
    "estimate_memory",
    "guard",
    "load_catalog",
    "measure_training_step",
    "parse_bytes",
    "parse_precision",
    "plan",
    "plan_training_args",
    "project_training",
    "resolve_device",
]


# name -> the module that defines it: imported on first use (PEP 562), so that `import resource_guard`
# (and the pytest plugin it registers, active in every pytest run where the package is installed) costs
# nothing until a name is used; torch and Lightning load with the first name that needs them
_EXPORTS = {
    "Catalog": "resource_guard.devices",
    "DeviceSpec": "resource_guard.devices",
    "load_catalog": "resource_guard.devices",
    "parse_bytes": "resource_guard.devices",
    "resolve_device": "resource_guard.devices",
    "ConfigurationError": "resource_guard.errors",
    "DoesNotFitError": "resource_guard.errors",
    "PredictedOutOfMemoryError": "resource_guard.errors",
    "ResourceGuardError": "resource_guard.errors",
    "ResourceGuardWarning": "resource_guard.errors",
    "TraceError": "resource_guard.errors",
    "CATEGORIES": "resource_guard.estimate",
    "DeviceFit": "resource_guard.estimate",
    "MeasuredStep": "resource_guard.estimate",
    "MemoryEstimate": "resource_guard.estimate",
    "UserStep": "resource_guard.estimate",
    "estimate_eval_memory": "resource_guard.estimate",
    "estimate_memory": "resource_guard.estimate",
    "measure_training_step": "resource_guard.estimate",
    "Guard": "resource_guard.frontdoors.guard.context",
    "guard": "resource_guard.frontdoors.guard.context",
    "RunMonitor": "resource_guard.observe.monitor",
    "apply_checkpointing": "resource_guard.planning.checkpointing",
    "Plan": "resource_guard.planning.planner",
    "plan": "resource_guard.planning.planner",
    "Projection": "resource_guard.planning.projection",
    "ProjectionRow": "resource_guard.planning.projection",
    "project_training": "resource_guard.planning.projection",
    "Calibration": "resource_guard.planning.steptime",
    "Interconnect": "resource_guard.planning.steptime",
    "Finding": "resource_guard.report.findings",
    "Report": "resource_guard.report.findings",
    "PRECISIONS": "resource_guard.step.precision",
    "PrecisionSpec": "resource_guard.step.precision",
    "parse_precision": "resource_guard.step.precision",
    "ResourceGuard": "resource_guard.frontdoors.lightning.callback",
    "ResourceGuardCallback": "resource_guard.frontdoors.hf.trainer",  # transformers, lazily
    "plan_training_args": "resource_guard.frontdoors.hf.plan",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
