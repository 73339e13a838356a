"""One rule for every test that compares an estimate with a real CPU step (marked ``cpu_reference``).

Where this CPU cannot run the reference step (oneDNN's LSTM under bf16 autocast without AVX-512, under
fp16 autocast on most CPUs), the example is skipped with the reason, decided by the library's own
capability answer (:attr:`MemoryEstimate.cpu_unsupported`: each module call probed as the step makes
it, :mod:`resource_guard.estimate.host.cpu_support`) — never by catching the reference's error, which
would hide real failures. A reference step that raises after the library said it runs fails the
test, naming the probe as wrong: that is a bug of the library on this CPU, not of the test.

Inside a hypothesis test the example is discarded (``assume``) and the reason recorded as an event
(``--hypothesis-show-statistics``), so the other examples still run; elsewhere ``pytest.skip``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import assume, currently_in_test_context, event

from resource_guard.devices import cpu_summary
from resource_guard.estimate import MemoryEstimate, measure_training_step
from resource_guard.estimate.host.measure import MeasuredStep

__all__ = ["measure_reference", "reference_checked", "skip_unless_cpu_runs"]


def skip_unless_cpu_runs(est: MemoryEstimate) -> None:
    """Skip (or, under hypothesis, discard) the current example if this CPU cannot run ``est``'s step."""
    if not est.cpu_unsupported:
        return
    reason = "this CPU cannot run the reference step: " + "; ".join(est.cpu_unsupported)
    if currently_in_test_context():
        event(reason)
        assume(False)
    pytest.skip(reason)


def measure_reference(est: MemoryEstimate, model: Any, optimizer: Any, batch: Any, loss_fn: Any = None,
                      **kwargs: Any) -> MeasuredStep:  # fmt: skip
    """The real CPU step ``est`` estimated, measured (:func:`measure_training_step`, same arguments).

    Skipped where the library says this CPU cannot run it; a kernel error after the library said it
    runs (or could not tell) is an ``AssertionError`` naming the probe (:func:`reference_checked`).
    """
    skip_unless_cpu_runs(est)
    with reference_checked(est):
        return measure_training_step(model, optimizer, batch, loss_fn, **kwargs)


@contextmanager
def reference_checked(est: MemoryEstimate) -> Iterator[None]:
    """Around a real CPU step of ``est``'s case that the library did not say this CPU cannot run: a
    kernel error inside is an ``AssertionError`` that names the probe as wrong (or missing)."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        if est.cpu_unknown:
            said = "had no probe for " + "; ".join(est.cpu_unknown) + " (add one)"
        else:
            said = "said this CPU runs the step: the probe is wrong"
        raise AssertionError(
            f"the real CPU step raised {type(exc).__name__}: {first!r}, but resource_guard's CPU "
            f"capability check (resource_guard.estimate.host.cpu_support) {said}. This CPU: {cpu_summary()}"
        ) from exc
