"""The examples in the docstrings of resource_guard.testing run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["budgets", "fits"])
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"resource_guard.testing.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
