"""What the Lightning callback estimates: the optimizers of ``configure_optimizers``, and, under manual
optimization, the module's own ``training_step`` as a :class:`~resource_guard.estimate.UserStep`.

With ``automatic_optimization = False`` Lightning hands the step to the module: it calls
``self.optimizers()``, ``self.manual_backward(loss)``, each optimizer's ``step``/``zero_grad``,
``self.toggle_optimizer``, ``self.lr_schedulers()``, ``self.clip_gradients``. The estimate runs that
``training_step`` on the fake copy of the module, detached from the Trainer, with those public methods
answered on the copy itself (instance attributes that shadow the class's methods): the optimizers are
the fake copies of every optimizer ``configure_optimizers`` made (each one's state counted), wrapped
as Lightning wraps them (:class:`~lightning.pytorch.core.optimizer.LightningOptimizer`, so
``isinstance`` checks hold); ``manual_backward`` scales as the precision does; schedulers step nothing;
``self.log`` is skipped as on any detached module. No Lightning private is read or written, and the
real Trainer, module, optimizers and schedulers are not touched.

Every form of ``configure_optimizers`` Lightning accepts (an optimizer, a list or tuple, dicts with
``lr_scheduler``, ``([optimizers], [schedulers])``, ``None``) is read from ``trainer.optimizers``
after Lightning parsed it. ``None`` runs with no optimizer: nothing steps and nothing zeroes, so the
gradients stay allocated from one step to the next, and that is what is estimated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from resource_guard.estimate.user_step import NoOptimizer, StepContext, UserStep, count_user_step_flops
from resource_guard.frontdoors.lightning.hooks import call_training_step

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NoOptimizer", "manual_flops", "manual_step", "optimizers_of", "WHAT_MANUAL_LEAVES"]

WHAT_MANUAL_LEAVES = (
    "manual optimization: applied precision (Lightning's precision plugin, which `manual_backward` and "
    "each optimizer's `step` go through), activation checkpointing and the loader's batch size; "
    "accumulation left alone: it is the module's own code (`training_step` decides when each optimizer "
    "steps), so the micro-batch is the whole batch"
)


def optimizers_of(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[torch.optim.Optimizer]:
    """Every optimizer ``configure_optimizers`` made, in order; a :class:`NoOptimizer` for ``None``.

    Lightning stands in for ``None`` with an optimizer over a tensor of its own; an optimizer that holds
    none of the module's parameters is that stand-in.
    """
    own = {id(p) for p in pl_module.parameters()}
    found = [
        opt
        for opt in trainer.optimizers
        if any(id(p) in own for group in opt.param_groups for p in group["params"])
    ]
    if found:
        return found
    return [NoOptimizer([p for p in pl_module.parameters() if p.requires_grad])]


def manual_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> UserStep:
    """The module's ``training_step`` under manual optimization, as a step the estimate runs on fakes.

    ``trainer`` is read now (its schedulers and gradient-clipping settings); the step itself runs on
    the module's fake copy, detached.
    """
    schedulers = [_Scheduler(config.scheduler) for config in trainer.lr_scheduler_configs]
    clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm)

    def run(step: StepContext) -> None:
        module: Any = step.model  # the LightningModule's fake copy
        _answer_on_the_copy(module, step, schedulers, clip)
        call_training_step(module, step.batch)  # `batch_idx` only where it is taken, as Lightning

    return UserStep(run, name=f"{type(pl_module).__name__}.training_step (manual optimization)")


def manual_flops(
    step: UserStep, pl_module: pl.LightningModule, optimizers: list[Any], batch: Any
) -> float | None:
    """FLOPs of the manual step's forwards and backwards (the model FLOPs of MFU), counted on fake
    tensors; ``None`` with a warning when the step cannot run there. Call with the module detached."""

    from resource_guard.errors import warn_at_user

    try:
        return count_user_step_flops(pl_module, optimizers, batch, step)
    except Exception as exc:  # MFU is a nicety: the run goes on without it
        warn_at_user(
            f"ResourceGuard: the manual step's FLOPs could not be counted ({type(exc).__name__}: {exc}); "
            "MFU will not be reported."
        )
        return None


def _one_or_list(items: list[Any]) -> Any:
    return items[0] if len(items) == 1 else items


def _answer_on_the_copy(module: Any, step: StepContext, schedulers: list[Any], clip: tuple[Any, Any]) -> None:
    """Shadow, on the fake copy only, the LightningModule methods a manual ``training_step`` calls."""
    raw = list(step.optimizers)
    wrapped = [_TracedOptimizer(opt, module) for opt in raw]
    toggled: dict[torch.nn.Parameter, bool] = {}

    def params_of(optimizer: Any) -> list[torch.nn.Parameter]:
        opt = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return [p for group in opt.param_groups for p in group["params"]]

    def toggle_optimizer(optimizer: Any) -> None:
        mine = {id(p) for p in params_of(optimizer)}
        for opt in raw:
            for p in params_of(opt):
                if id(p) not in mine and p not in toggled:
                    toggled[p] = p.requires_grad
                    p.requires_grad_(False)

    def untoggle_optimizer(optimizer: Any) -> None:
        for p, requires_grad in toggled.items():
            p.requires_grad_(requires_grad)
        toggled.clear()

    def clip_gradients(
        optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        value = gradient_clip_val if gradient_clip_val is not None else clip[0]
        algorithm = (gradient_clip_algorithm or clip[1] or "norm").lower()
        if not value:
            return
        params = [p for p in params_of(optimizer) if p.grad is not None]
        if algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, value)
        else:
            torch.nn.utils.clip_grad_norm_(params, value)

    answers = {
        "optimizers": lambda use_pl_optimizer=True: _one_or_list(wrapped if use_pl_optimizer else raw),
        "lr_schedulers": lambda: _one_or_list(schedulers) if schedulers else None,
        "manual_backward": step.backward,
        "toggle_optimizer": toggle_optimizer,
        "untoggle_optimizer": untoggle_optimizer,
        "clip_gradients": clip_gradients,
    }
    for name, answer in answers.items():
        object.__setattr__(module, name, answer)  # an instance attribute, not nn.Module's registry


class _TracedOptimizer(LightningOptimizer):
    """Lightning's optimizer wrapper over a fake optimizer: ``step`` runs the closure and the step
    directly (no strategy; the precision's unscaling is the estimate's own)."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: Any) -> None:
        super().__init__(optimizer)
        self._module = module

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        self._optimizer.step(**kwargs)
        return result

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        self._module.toggle_optimizer(self)
        try:
            yield
        finally:
            self._module.untoggle_optimizer(self)


class _Scheduler:
    """A scheduler as the step sees it: ``step()`` does nothing (the real one is not advanced); the rest
    is read from the real scheduler."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)
