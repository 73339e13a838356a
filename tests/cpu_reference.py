"""One rule for every test that compares an estimate with a real CPU step: where this CPU cannot run the
reference step (oneDNN's bf16 LSTM on an AVX2-only CPU, its fp16 LSTM on most CPUs), that example is
skipped with the reason, decided by the library's own capability check
(:attr:`MemoryEstimate.cpu_unsupported`, probed with a tiny real kernel) — never by catching the
reference's error, which would hide real failures.

Inside a hypothesis test the example is discarded (``assume``) and the reason recorded as an event
(``--hypothesis-show-statistics``), so the other examples still run; elsewhere ``pytest.skip``.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, currently_in_test_context, event

from resource_guard.estimate import MemoryEstimate

__all__ = ["skip_unless_cpu_runs"]


def skip_unless_cpu_runs(est: MemoryEstimate) -> None:
    """Skip (or, under hypothesis, discard) the current example if this CPU cannot run ``est``'s step."""
    if not est.cpu_unsupported:
        return
    reason = "this CPU cannot run the reference step: " + "; ".join(est.cpu_unsupported)
    if currently_in_test_context():
        event(reason)
        assume(False)
    pytest.skip(reason)
