"""The package's folders are its layers: each imports only from the layers below it, with no circles.

Every import counts, also those inside functions and under ``if TYPE_CHECKING:``: a circle that only
the type checker sees is still a circle a reader has to untangle.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import resource_guard

PKG = Path(resource_guard.__file__).parent

# lowest first; a module may import from its own layer and the ones before it
LAYERS = (
    ("errors",),
    ("step",),
    ("devices",),
    ("estimate",),
    ("planning",),
    ("report",),
    ("observe",),
    ("frontdoors",),
    ("tensorboard_plugin",),  # reads what the doors wrote
    ("testing",),
    ("cli", "cli_input", "demo"),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules of this package that ``path`` imports, resolved to module names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = importlib.util.resolve_name("." * node.level + base, package)
            for alias in node.names:  # `from pkg import module` imports the module; else the name's module
                found.add(f"{base}.{alias.name}" if _exists(f"{base}.{alias.name}") else base)
    return {m for m in found if m.split(".")[0] == "resource_guard" and _exists(m)}


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) - {_module_name(p)} for p in sorted(PKG.rglob("*.py"))}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) == 1:  # the package's own __init__: the public API, above everything
        return len(LAYERS)
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    return None


def test_every_module_belongs_to_a_layer() -> None:
    assert [m for m in _graph() if _layer(m) is None] == []


def test_no_module_imports_a_higher_layer() -> None:
    bad = [
        f"{m} -> {dep}"
        for m, deps in _graph().items()
        for dep in deps
        if _layer(dep) > _layer(m)  # type: ignore[operator]
    ]
    assert bad == []


def test_no_import_circles() -> None:
    graph = _graph()
    # a package's __init__ re-exports its modules; an edge module -> its own package is the circle
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


@pytest.mark.parametrize("name", resource_guard.__all__)
def test_public_api_imports_from_the_top(name: str) -> None:
    assert getattr(resource_guard, name) is not None


# estimate/'s inner floors, lowest first: a sub-package (or module) imports only from its own floor and
# the ones before it; modules directly in estimate/ not named here (the estimators) are the top floor
ESTIMATE_FLOORS = (
    ("emulate",),  # the target's behaviour: autocast policy, autocast regions, attention kernel
    ("trace",),  # fake tensors, live-storage accounting, recovery
    ("host",),  # the host CPU: measurement, kernel scratch and capability, quiet logs
    ("allocation",),  # what a device shows: the caching allocator, later micro-steps
    ("result",),  # MemoryEstimate
    ("fsdp",),  # per-rank sharding
)


def _estimate_floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["resource_guard", "estimate"] or len(parts) < 3:
        return None
    for i, names in enumerate(ESTIMATE_FLOORS):
        if parts[2] in names:
            return i
    return len(ESTIMATE_FLOORS)


def test_estimate_floors_import_downward_only() -> None:
    bad = [
        f"{m} -> {dep}"
        for m, deps in _graph().items()
        if _estimate_floor(m) is not None
        for dep in deps
        if (_estimate_floor(dep) or 0) > _estimate_floor(m)  # type: ignore[operator]
    ]
    assert bad == []


# frontdoors/'s floors: the run's lifecycle (frontdoors/run*) and the pieces every door shares are under
# the doors; a door imports them and never another door; the run imports no framework
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "peft", "trl")
DOORS = ("guard", "lightning", "hf")


def _door(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["resource_guard", "frontdoors"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in DOORS else "shared"


def _third_party_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_run_lifecycle_imports_no_framework() -> None:
    runs = [
        p
        for p in (PKG / "frontdoors").rglob("*.py")
        if p.relative_to(PKG / "frontdoors").parts[0].startswith("run")
    ]
    assert runs, "frontdoors/run* is where the doors' shared run lifecycle lives"
    bad = {str(p.relative_to(PKG)): sorted(_third_party_imports(p) & set(FRAMEWORKS)) for p in runs}
    assert {k: v for k, v in bad.items() if v} == {}
    # nor any door: it is the floor the doors stand on
    assert [d for p in runs for d in _imports(p) if _door(d) in DOORS] == []


def test_no_door_imports_another_door() -> None:
    bad = [
        f"{m} -> {dep}"
        for m, deps in _graph().items()
        for dep in deps
        if _door(m) in DOORS and _door(dep) in DOORS and _door(m) != _door(dep)
    ]
    assert bad == []
