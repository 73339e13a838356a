"""The README and the docs/ pages name only what exists: every dotted ``resource_guard.…`` path imports (a
module, or an attribute of one), and every ``.py`` file they name is in the repository (or in the
package). One test per page, so that a failure names the page."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_IDS = [str(p.relative_to(ROOT)) for p in PAGES]
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


def _files(page: Path) -> list[str]:
    return [f for f in _named(_FILE, page.read_text(encoding="utf-8")) if f not in _PLACEHOLDERS]


def _exists(name: str) -> bool:
    return (ROOT / name).is_file() or (ROOT / "src" / "resource_guard" / name).is_file()


@pytest.mark.parametrize("page", PAGES, ids=_IDS)
def test_every_dotted_path_a_page_names_imports(page: Path) -> None:
    names = _named(_DOTTED, page.read_text(encoding="utf-8"))
    broken = [name for name in names if not _resolves(name)]
    assert not broken, f"{page.relative_to(ROOT)} names module paths that do not import: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_IDS)
def test_every_file_a_page_names_exists(page: Path) -> None:
    missing = [f for f in _files(page) if not _exists(f)]
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_pages_name_paths_and_files_at_all() -> None:
    """The checks above pass vacuously on a page that names nothing: over all pages they must have
    something to check (the reference moved from the README to docs/, the names with it)."""
    assert len(PAGES) >= 10, [p.name for p in PAGES]
    dotted = {n for page in PAGES for n in _named(_DOTTED, page.read_text(encoding="utf-8"))}
    assert "resource_guard.planning.strategy" in dotted
    files = {f for page in PAGES for f in _files(page)}
    assert len(files) >= 20, sorted(files)
    assert "examples/gpt_small.py" in _files(README)


def test_the_checks_can_fail() -> None:
    assert _resolves("resource_guard.planning.strategy") and _resolves("resource_guard.project_training")
    assert not _resolves("resource_guard.strategy") and not _resolves("resource_guard.estimate.no_such_thing")
    text = "see `resource_guard.a.b`, and resource_guard.c."
    assert _named(_DOTTED, text) == ["resource_guard.a.b", "resource_guard.c"]
    assert _exists("examples/gpt_small.py") and _exists("observe/phases.py") and not _exists("no/such.py")
