"""An unchanged loop with several optimizers (a GAN's): its first step recorded, then replayed.

A loop such as pytorch/examples' ``dcgan`` calls its models one by one (``netD(real)``, ``netG(noise)``,
``netD(fake.detach())``, ``netD(fake)``), computes its losses outside them, and steps two optimizers.
No single forward shows that step, so it cannot be pre-flighted at the first forward as a one-optimizer
loop is. Wrapped as ``with guard(nn.ModuleDict({"G": netG, "D": netD}), [optimizerD, optimizerG]):``
(the model: a container of every model the optimizers train) and otherwise unchanged, the guard
records the loop's first step through public hooks only:

- each forward of one of the container's children (:class:`Forward`): which child, its inputs (a fresh
  tensor of the loop's, such as the real batch or the noise, or an output of an earlier forward, as it
  is or detached: ``netD(fake.detach())``), and its outputs;
- each backward (:class:`Backward`): the forward whose outputs the backward reached first (the one the
  loss was computed from);
- each optimizer's ``step`` and each ``zero_grad`` (of an optimizer or of a child), by a wrapper on the
  instance's method, removed when the recording ends.

Once every optimizer has stepped, the step is replayed on the estimate's fake copies as a
:class:`~resource_guard.estimate.user_step.UserStep` (:func:`replay_step`): the same forwards on inputs
of the same shapes, the stand-in loss over the outputs each backward reached
(:class:`~resource_guard.step.training.StandInLoss`; a loss the model returns is used as is), the same
steps and ``zero_grad`` calls. It runs twice, so that the second pass starts with the gradients the
first left allocated, as every later step of the loop does, and with the first pass's outputs held
until the same forward of the second pass replaces them (``fake = netG(noise)``). The plan of that
step is the pre-flight: made after the first step, checked before the second step's first forward.

Example:
    >>> import torch
    >>> from torch import nn
    >>> models = nn.ModuleDict({"g": nn.Linear(4, 8), "d": nn.Linear(8, 1)})
    >>> opt_d = torch.optim.SGD(models["d"].parameters(), lr=0.1)
    >>> opt_g = torch.optim.SGD(models["g"].parameters(), lr=0.1)
    >>> rec = StepRecorder(models, (opt_d, opt_g))
    >>> rec.start()
    >>> noise = torch.randn(2, 4)
    >>> fake = models["g"](noise)
    >>> models["d"](fake.detach()).sum().backward(); opt_d.step()
    >>> models["d"](fake).sum().backward(); opt_g.step()
    >>> rec.stop()
    >>> [type(e).__name__ for e in rec.events]
    ['Forward', 'Forward', 'Backward', 'Step', 'Forward', 'Backward', 'Step']
    >>> rec.events[1].inputs, rec.events[4].inputs
    ((('out', 0, 0, True),), (('out', 0, 0, False),))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Backward", "Forward", "Step", "StepRecorder", "ZeroGrad", "recorded_children", "replay_step"]


@dataclass(frozen=True)
class Forward:
    """A child's forward: ``child`` (its name in the container), ``inputs`` (one leaf a positional or keyword
    argument: ``("batch", i)`` the loop's i-th fresh tensor, ``("out", k, j, detached)`` the j-th tensor
    of forward k's output, ``("value", v)`` anything else) and the structure to rebuild them."""

    child: str
    inputs: tuple[Any, ...]
    spec: Any


@dataclass(frozen=True)
class Backward:
    """A backward that first reached forward ``forward``'s outputs (the loss was computed from them)."""

    forward: int


@dataclass(frozen=True)
class Step:
    """Optimizer ``optimizer`` (its index in the guard's list) stepped."""

    optimizer: int


@dataclass(frozen=True)
class ZeroGrad:
    """``zero_grad`` of optimizer ``optimizer`` (an index), or of child ``child`` (a name)."""

    optimizer: int | None = None
    child: str | None = None
    set_to_none: bool = True


Event = Forward | Backward | Step | ZeroGrad


def recorded_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The models a container holds (its direct children), as the loop calls them."""
    return list(model.named_children())


class StepRecorder:
    """Records one step of an unchanged loop with several optimizers (see the module docstring).

    ``start()`` installs the hooks and wrappers, ``stop()`` removes them; :attr:`events` is the step, and
    :attr:`fresh` the loop's own tensors its forwards took (the real batch, the noise), in order.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.model, self.optimizers = model, tuple(optimizers)
        self.children = recorded_children(model)
        self.events: list[Event] = []
        self.fresh: list[torch.Tensor] = []
        self._outputs: list[list[torch.Tensor]] = []  # each forward's output tensors, in leaf order
        self._handles: list[Any] = []
        self._patched: list[Any] = []
        self._depth = 0  # forwards of watched children running (a child calling another is one forward)
        self._in_backward_of: int | None = None

    # -- installation --------------------------------------------------------------------------------
    def start(self) -> None:
        for name, child in self.children:
            self._handles.append(child.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(child.register_forward_hook(self._post))
            self._patch(child, ZeroGradOf(child=name))
        for i, optimizer in enumerate(self.optimizers):
            self._handles.append(optimizer.register_step_pre_hook(self._stepped(i)))
            self._patch(optimizer, ZeroGradOf(optimizer=i))

    def stop(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        patched, self._patched = self._patched, []
        for obj in patched:
            vars(obj).pop("zero_grad", None)  # the class's method again
        self._outputs = []

    def _patch(self, obj: Any, which: ZeroGradOf) -> None:
        method = obj.zero_grad
        events = self.events

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            to_none = kwargs.get("set_to_none", args[0] if args else True)
            events.append(ZeroGrad(which.optimizer, which.child, bool(to_none)))
            return method(*args, **kwargs)

        object.__setattr__(obj, "zero_grad", zero_grad)  # on the instance; nn.Module's setattr not needed
        self._patched.append(obj)

    # -- hooks -------------------------------------------------------------------------------------------
    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._depth += 1
            if self._depth > 1:
                return
            leaves, spec = tree_flatten((args, kwargs))
            self.events.append(Forward(name, tuple(self._source(x) for x in leaves), spec))

        return hook

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        index = len(self._outputs)
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        self._outputs.append(tensors)
        for t in tensors:
            if t.requires_grad:
                t.register_hook(self._reached(index))

    def _reached(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            # one backward reaches several forwards' outputs (the loss's first, then upstream): the
            # first one reached since the last other event is the one the loss came from
            if not self.events or not isinstance(self.events[-1], Backward):
                self.events.append(Backward(index))

        return hook

    def _stepped(self, i: int) -> Callable[..., None]:
        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.events.append(Step(i))

        return hook

    def _source(self, x: Any) -> tuple[Any, ...]:
        """Where a forward's input comes from (see :class:`Forward`)."""
        if not isinstance(x, torch.Tensor):
            return ("value", x)
        for k, tensors in enumerate(self._outputs):
            for j, t in enumerate(tensors):
                if x is t:
                    return ("out", k, j, False)
                if (
                    x.shape == t.shape
                    and x.dtype == t.dtype
                    and x.numel()
                    and x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                ):
                    return ("out", k, j, not x.requires_grad)  # ``t.detach()`` (or a same-shaped view)
        self.fresh.append(x)
        return ("batch", len(self.fresh) - 1)


@dataclass(frozen=True)
class ZeroGradOf:
    """Whose ``zero_grad`` a wrapper records."""

    optimizer: int | None = None
    child: str | None = None


def replay_step(events: Sequence[Event], passes: int = 2) -> Callable[[Any], None]:
    """The recorded step as a :class:`~resource_guard.estimate.user_step.UserStep` function: ``fn(step)``
    runs the events on ``step.model`` (the container), ``step.optimizers`` and ``step.batch`` (the
    loop's fresh tensors, in order), ``passes`` times."""
    from resource_guard.step.training import StandInLoss, _own_loss

    recorded = tuple(events)

    def fn(step: Any) -> None:
        children = dict(step.model.named_children())
        held: list[Any] = []  # the last pass's outputs: the loop's variables hold them until reassigned
        losses: list[torch.Tensor] = []  # every backward's loss, held as `errD_real = ...` holds it
        for _ in range(passes):
            outputs: list[Any] = []
            flat: list[list[torch.Tensor]] = []
            targets: list[torch.Tensor] = []
            for event in recorded:
                if isinstance(event, Forward):
                    leaves = [_input(src, step.batch, flat) for src in event.inputs]
                    args, kwargs = tree_unflatten(leaves, event.spec)
                    out = children[event.child](*args, **kwargs)
                    if len(outputs) < len(held):  # ``fake = netG(noise)``: the old one goes now
                        held[len(outputs)] = None
                    outputs.append(out)
                    flat.append([t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
                elif isinstance(event, Backward):
                    out = outputs[event.forward]
                    own = _own_loss(out)
                    if own is None:  # a loss the loop computes outside the model, against a target of
                        # the output's shape that it holds through the step (dcgan's `label`)
                        targets.extend(torch.zeros_like(t) for t in flat[event.forward])
                    loss = own if own is not None else StandInLoss().stand_in(out)
                    step.backward(loss)
                    losses.append(loss.detach())  # the loop's variable holds it into the next step
                elif isinstance(event, Step):
                    step.optimizers[event.optimizer].step()
                elif event.optimizer is not None:
                    step.optimizers[event.optimizer].zero_grad(set_to_none=event.set_to_none)
                elif event.child is not None:
                    children[event.child].zero_grad(set_to_none=event.set_to_none)
            held = [_detached(out) for out in outputs]
            del outputs, flat, targets

    return fn


def _detached(out: Any) -> Any:
    """An output as a loop's variable holds it after the step: its tensors, their graph freed."""
    leaves, spec = tree_flatten(out)
    return tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in leaves], spec)


def _input(src: tuple[Any, ...], batch: Sequence[torch.Tensor], flat: list[list[torch.Tensor]]) -> Any:
    if src[0] == "batch":
        return batch[src[1]]
    if src[0] == "out":
        t = flat[src[1]][src[2]]
        return t.detach() if src[3] else t
    return src[1]
