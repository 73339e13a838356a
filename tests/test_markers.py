"""The ``cpu_reference`` marker sits on exactly the tests that run a real CPU training step.

CI reruns ``-m cpu_reference`` under each ``ONEDNN_MAX_CPU_ISA`` cap (``.ci/run``), so a comparison
with a real step that lacks the marker would never meet the other instruction sets, and a marked test
that runs none would cost CI time for nothing. A test runs a real step when it calls
``measure_training_step`` (or ``measure_eval_step``, ``measure_user_step``), or
``tests/cpu_reference.py``'s ``measure_reference`` or ``reference_checked``
(around a real step run elsewhere), itself or through a function of its own module.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REAL_STEP = frozenset(
    {
        "measure_training_step",
        "measure_eval_step",
        "measure_user_step",
        "measure_reference",
        "reference_checked",
    }
)


def _names(node: ast.AST) -> set[str]:
    refs = (n for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute)))
    return {n.id if isinstance(n, ast.Name) else n.attr for n in refs}


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    out: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for node in tree.body:
        for sub in node.body if isinstance(node, ast.ClassDef) else [node]:
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[sub.name] = sub
    return out


def _marked(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        ast.unparse(d.func if isinstance(d, ast.Call) else d) == "pytest.mark.cpu_reference"
        for d in func.decorator_list
    )


def _real_step_tests(tree: ast.Module) -> tuple[set[str], set[str]]:
    """``(tests that run a real step, tests marked cpu_reference)`` of one module."""
    functions = _functions(tree)
    uses = {name: _names(f) for name, f in functions.items()}
    reaching = {name for name, used in uses.items() if used & REAL_STEP}
    while True:
        more = {name for name, used in uses.items() if name not in reaching and used & reaching}
        if not more:
            break
        reaching |= more
    tests = {name for name in functions if name.startswith("test_")}
    return reaching & tests, {name for name in tests if _marked(functions[name])}


def test_cpu_reference_marks_exactly_the_tests_that_run_a_real_cpu_step() -> None:
    missing, extra, found = [], [], 0
    for path in sorted(TESTS.rglob("test_*.py")):
        real, marked = _real_step_tests(ast.parse(path.read_text(encoding="utf-8")))
        where = path.relative_to(TESTS)
        missing += [f"{where}::{name}" for name in sorted(real - marked)]
        extra += [f"{where}::{name}" for name in sorted(marked - real)]
        found += len(real)
    assert not missing, f"run a real CPU step without @pytest.mark.cpu_reference: {missing}"
    assert not extra, f"marked cpu_reference but run no real CPU step: {extra}"
    assert found >= 20  # the walk sees the suite's comparisons (25 when written)


def test_the_walk_follows_helpers_and_reads_the_marker() -> None:
    tree = ast.parse(
        "import pytest\n"
        "def _real(m): return measure_training_step(m, None, None)\n"
        "def _twice(m): return _real(m), _real(m)\n"
        "@pytest.mark.cpu_reference\n"
        "def test_marked(): _twice(1)\n"
        "def test_unmarked(): _real(1)\n"
        "@pytest.mark.cpu_reference\n"
        "def test_idle(): pass\n"
    )
    assert _real_step_tests(tree) == ({"test_marked", "test_unmarked"}, {"test_marked", "test_idle"})
