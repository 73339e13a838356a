"""The guard's evaluation: the evaluation step pre-flighted with the plan, and the model's train and
grad mode set for an evaluation loop and restored after it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from resource_guard.frontdoors.eval_preflight import EvalPreflights
from resource_guard.step.training import LossFn, StandInLoss

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = ["EvalMode", "preflight_eval"]


def preflight_eval(
    evals: EvalPreflights,
    model: nn.Module,
    loss_fn: LossFn | None,
    optimizers: tuple[torch.optim.Optimizer, ...],
    plan: Plan,
    batch: Any,
    later: bool = False,
) -> str | None:
    """The line of a new evaluation pre-flight of ``batch`` (``None`` when that shape was checked).

    ``later``: as the step will run between epochs: the optimizer state exists, the gradients were
    freed by the optimizer step's ``zero_grad``; else beside what the run holds now. Raises
    ``DoesNotFitError`` when the evaluation step does not fit.
    """
    from resource_guard.estimate import UserStep

    # the evaluation's forward: the guard's loss function, else (none, or a whole training step) the
    # stand-in loss over the model's output
    own = loss_fn if loss_fn is not None and not isinstance(loss_fn, UserStep) else None
    check = evals.check(
        model,
        batch,
        own if own is not None else StandInLoss(),
        loop="evaluation",
        device=plan.device,
        optimizer=(
            (list(optimizers) if len(optimizers) > 1 else optimizers[0])
            if later or any(o.state for o in optimizers)
            else None
        ),
        gradients_kept=False if later else None,
        precision=plan.precision,
        headroom=plan.headroom,
    )
    return None if check is None else check.line()


class EvalMode:
    """Eval mode and no grad for an evaluation loop; :meth:`restore` puts back what was there.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> mode = EvalMode(model)
        >>> mode.enter(); model.training, torch.is_grad_enabled()
        (False, False)
        >>> mode.restore(); model.training, torch.is_grad_enabled()
        (True, True)
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._restore: tuple[bool, bool] | None = None

    def remember(self) -> None:
        """Note the train and grad mode to restore (before the first batch is asked for)."""
        self._restore = (self.model.training, torch.is_grad_enabled())

    def enter(self) -> None:
        if self._restore is None:
            self.remember()
        self.model.eval()
        torch.set_grad_enabled(False)

    def restore(self) -> None:
        """Back to the remembered modes (a no-op when nothing was remembered)."""
        restore, self._restore = self._restore, None
        if restore is not None:
            self.model.train(restore[0])
            torch.set_grad_enabled(restore[1])
