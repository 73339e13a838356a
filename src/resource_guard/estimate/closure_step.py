"""The step of a closure optimizer (``torch.optim.LBFGS``): ``optimizer.step(closure)``.

LBFGS's step cannot run on fake tensors: it reads the loss and the gradient's norms as Python numbers
(``float(loss)``, ``ys > 1e-10``) to decide what to do next. Its memory does not depend on those values,
though, only on how many flat vectors of the parameters' size (``N`` elements) it holds while the
closure's forward and backward run (``torch/optim/lbfgs.py``):

- between steps, in its state: the history ``old_dirs`` and ``old_stps`` (``history_size`` vectors each
  once the history is full, which is the steady state of a run of more than ``history_size``
  iterations), the direction ``d`` and ``prev_flat_grad``;
- while a later closure evaluation runs inside the step: also the last flat gradient (``flat_grad``),
  the two-loop recursion's ``q`` and the new direction (the state's ``d`` is the last step's until the
  step ends); the scalars ``ro``, ``al``, ``be_i`` (``history_size`` each), ``H_diag`` and the losses;
- with ``line_search_fn="strong_wolfe"``: a copy of the parameters (``x_init``) and the line search's
  gradients (``g``, ``g_prev``, ``g_new`` and a bracket of two) beside them.

The estimate traces the closure's forward and backward (the model's step with a stateless optimizer in
LBFGS's place: parameters, gradients, activations, the outputs the loop keeps) and adds those vectors at
their steady-state count to every point of it: an upper bound of the step ``step(closure)`` runs, which
is reached once the history is full.

Example:
    >>> model = torch.nn.Linear(10, 1)
    >>> extra = closure_state_bytes(torch.optim.LBFGS(model.parameters(), history_size=4))
    >>> extra.bytes == (2 * 4 + 5) * 11 * 4 + (3 * 4 + 8) * 4
    True
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ClosureState", "closure_state_bytes", "needs_closure", "stateless_stand_in", "with_closure_state"]

_STATE_UID = -(1 << 50)  # the id of the vectors' one initial allocation: apart from the trace's storages


def needs_closure(optimizer: Any) -> bool:
    """True when ``optimizer.step`` requires a closure (``torch.optim.LBFGS``, or a ``step(closure)`` with
    no default)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return False
    if isinstance(optimizer, torch.optim.LBFGS):
        return True
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


@dataclass(frozen=True)
class ClosureState:
    """What a closure optimizer holds beside the closure's forward and backward.

    Attributes:
        bytes: the bytes of its vectors and scalars at the steady state (history full).
        vectors: how many flat vectors of the parameters' size that is.
        line: how the bytes were counted, for the estimate's notes.
    """

    bytes: int
    vectors: int
    line: str


def closure_state_bytes(optimizer: torch.optim.Optimizer) -> ClosureState:
    """LBFGS's vectors and scalars while a closure evaluation runs inside its step (module docstring)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    numel = sum(p.numel() for p in params)
    itemsize = max((p.element_size() for p in params), default=4)
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    history = int(group.get("history_size", 100))
    search = group.get("line_search_fn") is not None
    vectors = 2 * history + 5 + (6 if search else 0)
    # 0-d tensors of the parameters' dtype: ro, al and the two-loop's be_i (history_size each); ys,
    # H_diag, gtd, y.dot(y), the step's first loss and the closure's loss, t's and the tolerance tests'
    scalars = 3 * history + 8
    total = vectors * numel * itemsize + scalars * itemsize
    line = (
        f"closure optimizer {type(optimizer).__name__}: its step(closure) traced as the closure's forward "
        f"and backward, with {vectors} flat vectors of the {numel:,} parameters beside them (history_size "
        f"{history}, full: old_dirs, old_stps, prev_flat_grad, flat_grad, q, the old and new d"
        f"{', the strong-Wolfe line search' if search else ''}), {total / 2**20:,.2f} MiB: an upper bound "
        "reached once the history is full"
    )
    return ClosureState(total, vectors, line)


def stateless_stand_in(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer over the same parameters that keeps no state and updates in place (plain SGD): the
    closure's forward and backward are traced with it in the closure optimizer's place."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return torch.optim.SGD(params, lr=1e-3, foreach=False)


def with_closure_state(estimate: Any, state: ClosureState) -> Any:
    """``estimate`` (a :class:`~resource_guard.MemoryEstimate`) with ``state``'s bytes alive throughout:
    one initial allocation, counted as optimizer state."""
    extra = state.bytes
    breakdown = dict(estimate.breakdown)
    breakdown["optimizer_state"] = breakdown.get("optimizer_state", 0) + extra
    return dataclasses.replace(
        estimate,
        peak_bytes=estimate.peak_bytes + extra,
        breakdown=breakdown,
        persistent_bytes=estimate.persistent_bytes + extra,
        phase_peak_bytes={k: v + extra for k, v in estimate.phase_peak_bytes.items()},
        initial_allocations=(*estimate.initial_allocations, (_STATE_UID, extra)),
        timeline=tuple((phase, _plus(figures, extra)) for phase, figures in estimate.timeline),
        warnings=(*estimate.warnings, state.line),
    )


def _plus(figures: tuple[int, ...], extra: int) -> tuple[int, ...]:
    from resource_guard.estimate.trace.tracer import CATEGORIES

    at = CATEGORIES.index("optimizer_state")
    return tuple(v + extra if i == at else v for i, v in enumerate(figures))
