"""The CI gate where tests live: ``assert_fits``, memory budgets, and the pytest plugin.

- :mod:`~resource_guard.testing.fits`: :func:`assert_fits`, an assertion for any test runner.
- :mod:`~resource_guard.testing.budgets`: the budget file and :func:`check_budget`, shared by the
  plugin and ``resource-guard preflight --budget FILE``.
- :mod:`~resource_guard.testing.pytest_plugin`: the ``memory_budget`` fixture and
  ``pytest --memory-budgets=update`` (registered as a ``pytest11`` entry point; imports pytest, so it
  is not imported here).

Imports :mod:`resource_guard.planning` and below.
"""

from __future__ import annotations

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
