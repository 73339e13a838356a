"""The README names only what exists: every dotted ``resource_guard.…`` path imports (a module, or an
attribute of one), and every ``.py`` file it names is in the repository (or in the package)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_DOTTED = re.compile(r"\bresource_guard(?:\.[A-Za-z_]\w*)+")
_FILE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)\b")
_PLACEHOLDERS = {"path/to/file.py"}  # the CLI's TARGET syntax, not a file


def _resolves(dotted: str) -> bool:
    """``resource_guard.planning.strategy`` imports; ``resource_guard.project_training`` is an attribute."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _named(pattern: re.Pattern[str], text: str) -> list[str]:
    return sorted({m.group(1) if pattern.groups else m.group(0) for m in pattern.finditer(text)})


def test_every_dotted_path_the_readme_names_imports() -> None:
    names = _named(_DOTTED, README.read_text(encoding="utf-8"))
    assert "resource_guard.planning.strategy" in names
    broken = [name for name in names if not _resolves(name)]
    assert not broken, f"README.md names module paths that do not import: {broken}"


def test_every_file_the_readme_names_exists() -> None:
    files = [f for f in _named(_FILE, README.read_text(encoding="utf-8")) if f not in _PLACEHOLDERS]
    package = ROOT / "src" / "resource_guard"
    missing = [f for f in files if not (ROOT / f).is_file() and not (package / f).is_file()]
    assert len(files) >= 20 and not missing, f"README.md names files that do not exist: {missing}"


def test_the_checks_can_fail() -> None:
    assert _resolves("resource_guard.planning.strategy") and _resolves("resource_guard.project_training")
    assert not _resolves("resource_guard.strategy") and not _resolves("resource_guard.estimate.no_such_thing")
    text = "see `resource_guard.a.b`, and resource_guard.c."
    assert _named(_DOTTED, text) == ["resource_guard.a.b", "resource_guard.c"]
