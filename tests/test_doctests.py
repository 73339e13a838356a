"""Every docstring example in the package runs as written (STYLE: examples in docs are executed).

Modules whose examples a test of their own runs too stay here as well: this walk is what keeps a new
module's examples from going unrun.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import resource_guard

MODULES = sorted(m.name for m in pkgutil.walk_packages(resource_guard.__path__, "resource_guard."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # an example that writes a log directory writes it here
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=False)
    assert result.failed == 0, capsys.readouterr().out


def test_the_walk_sees_the_package() -> None:
    assert {"resource_guard.frontdoors.guard.context", "resource_guard.estimate.trace.tracer"} <= set(MODULES)
