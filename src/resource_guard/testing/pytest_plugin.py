"""The pytest plugin: a ``memory_budget`` fixture and ``pytest --memory-budgets=update``.

Registered by the package as a ``pytest11`` entry point, so it is active wherever resource-guard is
installed (``-p no:resource_guard.testing.pytest_plugin`` turns it off). A test compares the estimate
of a training step with the budget committed in ``memory_budgets.json`` at the rootdir (the ini
option ``memory_budgets_file`` names another file)::

    def test_gpt_step_memory(memory_budget):
        est = estimate_memory(model, torch.optim.AdamW, batch, precision="bf16-mixed", device="a100-40gb")
        memory_budget.check("gpt-small/a100", est)            # tolerance=0.02: 2% growth allowed

``pytest`` fails such a test when the peak (or one category of it) grew beyond the tolerance, naming
the key, old → new bytes, the change in percent and the category that grew; a key with no budget fails
too. ``pytest --memory-budgets=update`` writes the file (keys the run did not check are kept), to be
reviewed and committed. Under pytest-xdist the workers send their figures to the controller, which
writes the file once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# the plugin is loaded in every pytest run where the package is installed: what it needs of the package
# (and so torch) is imported when a test first checks a budget, never at start-up
if TYPE_CHECKING:
    from resource_guard.estimate import MemoryEstimate
    from resource_guard.testing.budgets import Budget, BudgetCheck

__all__ = ["MemoryBudget", "memory_budget"]

_MODES = ("check", "update")
_UPDATE_HINT = "`pytest --memory-budgets=update` records it"
_WORKER_KEY = "resource_guard_memory_budgets"


@dataclass
class _Session:
    """What the plugin keeps for one pytest session (in ``config.stash``)."""

    path: Path
    update: bool
    recorded: dict[str, Budget] | None = None  # read on first use
    seen: dict[str, Budget] = field(default_factory=dict)  # key -> this run's figures
    owners: dict[str, str] = field(default_factory=dict)  # key -> the test that checked it
    shrank: list[str] = field(default_factory=list)  # messages of the budgets now well below their figure

    def budgets(self) -> dict[str, Budget]:
        if self.recorded is None:
            from resource_guard.testing.budgets import load_budgets

            self.recorded = load_budgets(self.path)
        return self.recorded


_SESSION = pytest.StashKey[_Session]()


class MemoryBudget:
    """The ``memory_budget`` fixture: :meth:`check` an estimate against the committed budget."""

    def __init__(self, session: _Session, nodeid: str) -> None:
        self._session = session
        self._nodeid = nodeid

    @property
    def path(self) -> Path:
        """The budget file."""
        return self._session.path

    def check(self, key: str, estimate: MemoryEstimate, tolerance: float | None = None) -> BudgetCheck:
        """Compare ``estimate`` with the budget recorded under ``key``; fail the test if it grew.

        Args:
            key: names the budget in the file; one key per configuration (model, batch, precision, device).
            estimate: a :class:`~resource_guard.MemoryEstimate` of the step.
            tolerance: growth allowed, as a fraction of the recorded peak (``None``: 2%).

        Returns:
            The :class:`~resource_guard.testing.budgets.BudgetCheck` (with ``--memory-budgets=update``,
            the comparison with the figures being replaced).
        """
        from resource_guard.errors import ConfigurationError
        from resource_guard.estimate import MemoryEstimate
        from resource_guard.testing.budgets import DEFAULT_TOLERANCE, check_budget, check_tolerance

        if not isinstance(key, str) or not key:
            pytest.fail(f"`memory_budget.check(key={key!r})` must be a non-empty string", pytrace=False)
        if not isinstance(estimate, MemoryEstimate):
            pytest.fail(
                f"`memory_budget.check({key!r}, estimate={type(estimate).__name__})` takes a MemoryEstimate "
                "(from `estimate_memory(...)`, or `plan(...).estimate`)",
                pytrace=False,
            )
        s = self._session
        try:
            tolerance = check_tolerance(
                DEFAULT_TOLERANCE if tolerance is None else tolerance, "memory_budget.check"
            )
            result = check_budget(
                key,
                estimate,
                s.budgets().get(key),
                tolerance=tolerance,
                where=str(s.path),
                update_hint=_UPDATE_HINT,
            )
        except ConfigurationError as exc:  # a bad tolerance, a malformed budget file
            pytest.fail(str(exc), pytrace=False)
        owner = s.owners.setdefault(key, self._nodeid)
        if key in s.seen and s.seen[key] != result.budget:
            pytest.fail(
                f"memory budget {key!r} was checked by {owner} with other figures "
                f"({s.seen[key].peak_bytes:,} bytes, now {result.new_peak_bytes:,}): give each "
                "configuration its own key",
                pytrace=False,
            )
        s.seen[key] = result.budget
        if s.update:
            return result
        if result.status == "shrank":
            s.shrank.append(result.message)
        if not result.passed:
            pytest.fail(result.message, pytrace=False)
        return result


@pytest.fixture
def memory_budget(request: pytest.FixtureRequest) -> MemoryBudget:
    """Compare training-step estimates with the committed memory budgets (``memory_budgets.json``)."""
    return MemoryBudget(request.config.stash[_SESSION], request.node.nodeid)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("resource-guard", "memory budgets of training steps (resource_guard)")
    group.addoption(
        "--memory-budgets",
        choices=_MODES,
        default="check",
        dest="memory_budgets",
        help="check (default): fail a `memory_budget.check` whose estimate grew beyond its tolerance; "
        "update: write the estimates to the budget file instead",
    )
    parser.addini(
        "memory_budgets_file",
        help="the memory budget file, relative to the rootdir (default: memory_budgets.json)",
        default="memory_budgets.json",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = Path(str(config.getini("memory_budgets_file")))
    path = path if path.is_absolute() else config.rootpath / path
    config.stash[_SESSION] = _Session(path=path, update=config.getoption("memory_budgets") == "update")


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # a pytest-xdist worker


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    s = config.stash.get(_SESSION, None)
    if s is None:
        return
    if _is_worker(config):  # pytest-xdist: the controller reports and writes (pytest_testnodedown below)
        if s.seen or s.shrank:
            workeroutput: dict[str, Any] = config.workeroutput  # type: ignore[attr-defined]
            seen = {k: b.to_dict() for k, b in s.seen.items()}
            workeroutput[_WORKER_KEY] = json.dumps({"seen": seen, "shrank": s.shrank})
        return
    if s.update and s.seen:
        from resource_guard.testing.budgets import save_budgets

        save_budgets(s.path, {**s.budgets(), **s.seen})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist: a worker finished; take its figures (and notes) for the controller."""
    s = node.config.stash.get(_SESSION, None)
    text = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
    if s is None or text is None:
        return
    from resource_guard.testing.budgets import Budget

    sent = json.loads(text)
    for key, entry in sent["seen"].items():
        s.seen[key] = Budget.from_dict(key, entry, s.path)
    s.shrank += sent["shrank"]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    s = config.stash.get(_SESSION, None)
    if s is None or _is_worker(config):
        return
    if s.update and s.seen:
        old = s.recorded or {}
        new = sorted(k for k in s.seen if k not in old)
        changed = sorted(k for k in s.seen if k in old and old[k] != s.seen[k])
        kept = sorted(k for k in old if k not in s.seen)
        line = (
            f"memory budgets: wrote {len(s.seen)} key(s) to {s.path} ({len(new)} new, {len(changed)} changed"
        )
        line += f"; {len(kept)} not checked in this run, kept)" if kept else ")"
        terminalreporter.write_sep("-", "memory budgets")
        terminalreporter.write_line(line)
        for k in changed:
            terminalreporter.write_line(f"  {k}: {old[k].peak_bytes:,} → {s.seen[k].peak_bytes:,} bytes")
    elif s.shrank:
        terminalreporter.write_sep("-", "memory budgets")
        for message in s.shrank:
            terminalreporter.write_line(message)
