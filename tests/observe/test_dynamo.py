"""Tests for resource_guard.observe.dynamo: dynamo's counters read before and after real compilations
(recompiles with the guard that failed, graph breaks with their reason)."""

from __future__ import annotations

import doctest

import torch

from resource_guard.observe import dynamo
from resource_guard.observe.dynamo import compile_counters


def test_docstring_examples_run() -> None:
    assert doctest.testmod(dynamo).failed == 0


def test_the_private_counters_are_where_we_read_them() -> None:
    """``compile_counters`` reads these; a torch release that moves them fails here."""
    import torch._dynamo.utils as utils

    assert hasattr(utils, "counters") and hasattr(utils, "guard_failures")
    assert hasattr(utils, "compilation_time_metrics")


def test_recompiles_and_graph_breaks_of_a_real_compile_are_counted() -> None:
    torch._dynamo.reset()
    start = compile_counters()

    @torch.compile(backend="eager", dynamic=False)
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        print("", end="")  # a graph break
        return y + 1

    for n in (2, 3, 4):
        f(torch.randn(n))
    delta = compile_counters().since(start)
    assert delta.recompiles >= 1 and delta.graph_breaks >= 1 and delta.compile_s > 0
    assert any("size mismatch" in g or "x" in g for g in delta.failed_guards)
    assert delta.break_reasons and "\n" not in delta.break_reasons[0]
    assert 0 < delta.recompile_s <= delta.compile_s
    again = compile_counters()
    assert again.since(again).to_dict()["recompiles"] == 0
