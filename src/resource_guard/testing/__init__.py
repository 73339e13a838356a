"""The CI gate where tests live: ``assert_fits``, memory budgets, and the pytest plugin.

- :mod:`~resource_guard.testing.fits`: :func:`assert_fits`, an assertion for any test runner.
- :mod:`~resource_guard.testing.budgets`: the budget file and :func:`check_budget`, shared by the
  plugin and ``resource-guard preflight --budget FILE``.
- :mod:`~resource_guard.testing.pytest_plugin`: the ``memory_budget`` fixture and
  ``pytest --memory-budgets=update`` (registered as a ``pytest11`` entry point; imports pytest, so it
  is not imported here).

Names are imported on first use, so the plugin, loaded in every pytest run where the package is
installed, imports neither torch nor the estimator until a test asks for a budget.

Imports :mod:`resource_guard.planning` and below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from resource_guard.testing.budgets import (
        Budget,
        BudgetCheck,
        check_budget,
        check_budget_file,
        load_budgets,
        save_budgets,
    )
    from resource_guard.testing.fits import assert_fits

__all__ = [
    "Budget",
    "BudgetCheck",
    "assert_fits",
    "check_budget",
    "check_budget_file",
    "load_budgets",
    "save_budgets",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = "fits" if name == "assert_fits" else "budgets"
    value = getattr(importlib.import_module(f"resource_guard.testing.{module}"), name)
    globals()[name] = value
    return value
