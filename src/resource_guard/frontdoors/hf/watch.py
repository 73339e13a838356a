"""The batches of a ``Trainer`` run, seen by the model: the Trainer shows no callback its batches, so
the door watches the model's forwards (``register_forward_pre_hook(with_kwargs=True)`` and a forward
hook with ``always_call=True``, public PyTorch) and translates them into its events: a training
batch about to run (on the device, as the model receives it), an evaluation batch about to run, a
forward that ended, a training forward that raised.

The door's own traces of the model run inside :meth:`ModelWatch.tracing`: the hooks ignore them, the
Trainer's autocast is off (the estimate emulates the precision itself) and grad mode is on.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from resource_guard.frontdoors.hf.runtime import ModelHook, without_accelerate_autocast

__all__ = ["ModelWatch", "as_planned"]


class ModelWatch:
    """Hooks on one model, calling ``on_train(kwargs)`` / ``on_eval(kwargs)`` before its forwards,
    ``on_end(training)`` after them and ``on_error(error, training)`` when one raised."""

    def __init__(
        self,
        on_train: Callable[[dict[str, Any]], None],
        on_eval: Callable[[dict[str, Any]], None],
        on_end: Callable[[bool], None],
        on_error: Callable[[BaseException | None, bool], None],
    ) -> None:
        self._on_train, self._on_eval, self._on_end, self._on_error = on_train, on_eval, on_end, on_error
        self.model: nn.Module | None = None
        self._hooks: tuple[Any, ...] = ()
        self._inside = False  # our own traces call the model: the hooks ignore them

    def watch(self, model: nn.Module) -> None:
        """Watch ``model`` (a new one replaces the one watched)."""
        if self.model is model and self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self.model = model
        self._hooks = (
            model.register_forward_pre_hook(ModelHook(self._before), with_kwargs=True),
            model.register_forward_hook(ModelHook(self._after), always_call=True),
        )

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Our own traces: the hooks ignore them; the Trainer's autocast (when a check runs inside its
        forward) is off, as the estimate emulates the precision itself; grad mode on (the estimates
        trace a step and decide eval mode themselves)."""
        inside, self._inside = self._inside, True
        try:
            with contextlib.ExitStack() as stack:
                for kind in ("cpu", "cuda"):
                    if torch.is_autocast_enabled(kind):
                        stack.enter_context(torch.autocast(kind, enabled=False))
                if self.model is not None:
                    stack.enter_context(without_accelerate_autocast(self.model))
                stack.enter_context(torch.enable_grad())  # an evaluation loop runs under no_grad
                yield
        finally:
            self._inside = inside

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._inside or module is not self.model:
            return
        (self._on_train if module.training else self._on_eval)(kwargs)

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """After every forward, also one that raised (``always_call``: then ``output`` is ``None`` and
        the error is being handled)."""
        if self._inside or module is not self.model:
            return
        if output is not None:
            self._on_end(module.training)
        else:
            self._on_error(sys.exc_info()[1], module.training)


def as_planned(
    kwargs: dict[str, Any], keys: dict[str, tuple[torch.Size, torch.dtype]]
) -> dict[str, Any] | None:
    """The forward's keyword tensors as the planned batch (its tensors' ``keys``) had them: the Trainer's
    extra arguments (``num_items_in_batch``) left out; labels the Trainer took out for its own loss (label
    smoothing) put back as the tensor of the planned batch's shape and dtype (``input_ids``) the forward
    has. ``None`` when the batch cannot be matched (the check then skips it)."""
    if not keys:
        return None
    batch: dict[str, Any] = {}
    for key, planned in keys.items():
        if key in kwargs:
            batch[key] = kwargs[key]
            continue
        twin = next((k for k, p in keys.items() if k in kwargs and p == planned), None)
        if twin is None:
            return None
        batch[key] = kwargs[twin]
    return batch
