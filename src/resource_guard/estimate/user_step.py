"""The estimate of a training step the user writes: several optimizers, backward and ``step`` called by hand.

:func:`~resource_guard.estimate.estimator.estimate_memory` traces a fixed step (forward, loss,
backward, one optimizer's step, ``zero_grad``). A GAN's or an RL agent's step is the user's own code:
the generator's loss, its backward and its optimizer's step, then the discriminator's, each optimizer
with its own state. Such a step is handed over as a :class:`UserStep` in place of ``loss_fn``, with
the list of optimizers in place of ``optimizer``::

    estimate_memory(model, [opt_g, opt_d], batch, UserStep(gan_step))

and ``plan`` takes the same arguments. The function is called once, on the fake copies of the model,
of every optimizer (steady state: each one's state already exists) and of the batch, bundled in a
:class:`StepContext`; it calls :meth:`StepContext.backward` (loss scaling for ``16-mixed``, and the
phase) and each optimizer's ``step``/``zero_grad`` as it would for real. A plain ``loss.backward()``
counts the same bytes; only the breakdown then files backward's temporaries under activations.

While the step runs, each optimizer's ``step`` is the "optimizer" phase (its gradients unscaled first
under ``16-mixed``, as ``GradScaler.unscale_`` does); an optimizer left to choose its code path takes
the target's (foreach on a GPU, the for-loop on a CPU). On a GPU target the forward runs under the
emulated CUDA autocast as in any estimate (:func:`~resource_guard.estimate.trace.fake_world.target_forward`).

:func:`measure_user_step` measures the same step for real on the CPU (the ground truth).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.host.measure import MeasuredStep, allocation_deltas, live_bytes, peak_of
from resource_guard.estimate.host.quiet import quiet_profile
from resource_guard.step.precision import PrecisionSpec, autocast_context, parse_precision

__all__ = [
    "NoOptimizer",
    "StepContext",
    "UserStep",
    "check_optimizers",
    "count_user_step_flops",
    "manual_update_stand_in",
    "measure_user_step",
    "run_user_step",
]


@dataclass(frozen=True)
class StepContext:
    """What a :class:`UserStep` function is given: the model, its optimizers, one batch, and backward.

    In an estimate these are the fake copies; in :func:`measure_user_step`, the real objects.

    Attributes:
        model: the model.
        optimizers: the optimizers, in the order they were passed.
        batch: one batch.
    """

    model: nn.Module
    optimizers: tuple[torch.optim.Optimizer, ...]
    batch: Any
    _backward: Callable[..., None]

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(*args, **kwargs)``, scaled as the run's precision scales it (``16-mixed``)."""
        self._backward(loss, *args, **kwargs)


class UserStep:
    """A whole training step written by the user, passed where ``loss_fn`` goes.

    Args:
        fn: ``fn(step: StepContext) -> None``: runs one training step on ``step.model`` with
            ``step.optimizers`` and ``step.batch``: forward, ``step.backward(loss)``, each optimizer's
            ``step()`` and ``zero_grad()``, as often and in the order the real step does.
        name: how the step is named in messages (default: ``fn``'s name).

    Example:
        >>> g, d = nn.Linear(4, 8), nn.Linear(8, 1)
        >>> model = nn.ModuleDict({"g": g, "d": d})
        >>> opt_g, opt_d = torch.optim.Adam(g.parameters()), torch.optim.Adam(d.parameters())
        >>> def gan_step(s):
        ...     opt_g, opt_d = s.optimizers
        ...     s.backward(-s.model["d"](s.model["g"](s.batch)).mean())
        ...     opt_g.step(); opt_g.zero_grad()
        ...     s.backward(s.model["d"](s.model["g"](s.batch).detach()).mean())
        ...     opt_d.step(); opt_d.zero_grad()
        >>> from resource_guard.estimate import estimate_memory
        >>> est = estimate_memory(model, [opt_g, opt_d], torch.randn(16, 4), UserStep(gan_step), device="cpu")
        >>> est.breakdown["optimizer_state"] >= 2 * 4 * sum(p.numel() for p in model.parameters())
        True
    """

    def __init__(self, fn: Callable[[StepContext], Any], name: str | None = None) -> None:
        if not callable(fn):
            raise ConfigurationError(
                f"`UserStep(fn={fn!r})` must be a callable `fn(step: StepContext) -> None`."
            )
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__

    def __call__(self, model: nn.Module, step: StepContext) -> None:
        """Run the step; called as a loss function is, so the estimate's forward wrapping applies."""
        self.fn(step)

    def __repr__(self) -> str:
        return f"UserStep({self.name})"


class NoOptimizer(torch.optim.Optimizer):
    """An optimizer that never steps and never zeroes: a run with no optimizer (Lightning's
    ``configure_optimizers`` returning ``None``), whose gradients stay allocated; also the inert stand-in
    that :func:`count_user_step_flops` steps."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def manual_update_stand_in(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer a manual-update loop (``optimizer=None``) is estimated with: plain SGD over the
    model's trainable parameters, updating in place and keeping no state (as
    ``p.data.add_(p.grad, alpha=-lr)`` does), its gradients freed at the end of the step (as
    ``model.zero_grad()``, ``set_to_none=True`` by default, frees them before the next forward).

    Unlike :class:`NoOptimizer`, whose gradients stay allocated, this is what pytorch/examples'
    ``word_language_model`` holds; a loop that keeps its gradients instead is seen at its next forward
    (the guard refits the plan with the gradients allocated).

    Example:
        >>> opt = manual_update_stand_in(nn.Linear(4, 2))
        >>> type(opt).__name__, len(opt.state)
        ('SGD', 0)
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=1e-3, foreach=False)


def count_user_step_flops(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], batch: Any, step: UserStep
) -> float:
    """FLOPs of a :class:`UserStep`'s forwards and backwards (the model FLOPs of MFU; no optimizer
    update), counted on fake tensors at no real cost. Raises what the step raises on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from resource_guard.estimate.trace.fake_world import FakeModel, fake_like
    from resource_guard.step.training import map_tensors

    def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)

    with FakeTensorMode(allow_non_fake_inputs=False):
        fake = FakeModel(model, lambda t: t.dtype)
        inert = [
            NoOptimizer([fake.memo[id(p)] for g in o.param_groups for p in g["params"]]) for o in optimizers
        ]
        context = StepContext(
            fake.model, tuple(inert), map_tensors(lambda t: fake_like(t, t.dtype), batch), backward
        )
        with FlopCounterMode(display=False) as counter:
            step.fn(context)
    return float(counter.get_total_flops())


def check_optimizers(
    model: nn.Module, optimizers: Any, loss_fn: Any, who: str, *, recorded: bool = False
) -> list[torch.optim.Optimizer]:
    """The optimizers of a step, refused with the remedy when they do not go with ``loss_fn``.

    A list or tuple of optimizers is a user step's (``loss_fn`` a :class:`UserStep`), or (``recorded``)
    an unchanged loop's whose first step the guard records; each must be a ``torch.optim.Optimizer``
    over ``model``'s parameters.
    """
    if not isinstance(loss_fn, UserStep) and not recorded:
        raise ConfigurationError(
            f"`{who}(optimizer=[...])` got {len(optimizers)} optimizers, but the step that steps them is "
            "not given: pass `loss_fn=UserStep(fn)` whose `fn(step)` calls `step.backward(loss)` and each "
            "optimizer's `step()` as the training loop does (resource_guard.estimate.user_step); or leave "
            f"the loop unchanged under `with {who}(nn.ModuleDict({{...every model...}}), [opt, ...]):` "
            "(no `sample_batch=`, no `g.iterate`), which records its first step."
        )
    if not optimizers:
        raise ConfigurationError(f"`{who}(optimizer=[])`: pass the optimizers the step uses.")
    own = {id(p) for p in model.parameters()}
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigurationError(
                f"`{who}(optimizer=[...])`: item {i} is a {type(opt).__name__}, not a torch.optim.Optimizer "
                "(a list takes optimizer instances, not factories)."
            )
        foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in own]
        if foreign:
            raise ConfigurationError(
                f"`{who}(optimizer=[...])`: optimizer {i} ({type(opt).__name__}) holds {len(foreign)} "
                "parameter(s) that are not the model's; build every optimizer over the model's parameters."
            )
    return list(optimizers)


def run_user_step(
    world: Any,
    step_fn: Callable[[nn.Module, StepContext], Any],
    spec: PrecisionSpec,
    record: Any,
    on_phase: Callable[[str], None],
    loss_scale: float | None,
    device_kind: str,
) -> None:
    """Run a :class:`UserStep` over an estimate's fake world (``FakeStep``), telling ``on_phase`` the phases.

    ``step_fn`` is the user step as :func:`~resource_guard.estimate.trace.fake_world.target_forward` wrapped
    it, ``record`` its :class:`~resource_guard.estimate.trace.fake_world.TargetForward` (backward is not the
    forward: checkpointed blocks recompute under the target's policy).
    """
    foreach = device_kind in ("cuda", "rocm")
    for opt in world.optimizers:  # the target's code path where the optimizer leaves it to torch
        for group in opt.param_groups:
            if group.get("foreach", False) is None and not group.get("fused"):
                group["foreach"] = foreach

    def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        on_phase("optimizer")
        if loss_scale is not None:
            _unscale(opt, loss_scale)

    def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        on_phase("forward")

    def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        on_phase("backward")
        forward, record.in_forward = record.in_forward, False
        try:
            (loss.float() * loss_scale if loss_scale is not None else loss).backward(*args, **kwargs)
        finally:
            record.in_forward = forward
        on_phase("forward")

    hooks = [h for o in world.optimizers for h in _step_hooks(o, before_step, after_step)]
    context = StepContext(world.model, tuple(world.optimizers), world.batch, backward)
    try:
        with autocast_context(spec, "cpu"):
            step_fn(world.model, context)
    finally:
        for hook in hooks:
            hook.remove()
    on_phase("done")


def _step_hooks(opt: torch.optim.Optimizer, before: Callable, after: Callable) -> list[Any]:
    return [opt.register_step_pre_hook(before), opt.register_step_post_hook(after)]


def _unscale(opt: torch.optim.Optimizer, loss_scale: float) -> None:
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, 1.0 / loss_scale)


def measure_user_step(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Any,
    step: UserStep,
    *,
    precision: str = "32-true",
    warmup_steps: int = 1,
) -> MeasuredStep:
    """Run ``warmup_steps`` real steps of ``step`` (so every optimizer's state exists), then measure one more.

    The ground truth of a :class:`UserStep` estimate on the CPU, measured as
    :func:`~resource_guard.estimate.host.measure.measure_training_step` measures the fixed step. The model
    and optimizers are trained for real: pass throwaway copies.
    """
    spec = parse_precision(precision)
    scale = 2.0**16 if spec.loss_scaling else None
    model.train()
    opts = tuple(optimizers)

    def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        (loss.float() * scale if scale is not None else loss).backward(*args, **kwargs)

    hooks = [o.register_step_pre_hook(lambda o, a, k: _unscale(o, scale)) for o in opts] if scale else []
    context = StepContext(model, opts, batch, backward)
    try:
        for _ in range(warmup_steps):
            with autocast_context(spec, "cpu"):
                step.fn(context)
        gc.collect()
        start = live_bytes(model, *opts, batch)
        with quiet_profile() as prof, autocast_context(spec, "cpu"):
            step.fn(context)
    finally:
        for hook in hooks:
            hook.remove()
    deltas = allocation_deltas(prof)
    peak = peak_of(deltas)
    return MeasuredStep(start + peak, start, peak, sum(1 for _, s in deltas if s > 0))
