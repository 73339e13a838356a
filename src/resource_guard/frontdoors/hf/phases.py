"""The Trainer door's phase timing: where each step's wall time goes under ``transformers.Trainer.train``.

The same phases as the other doors (:data:`~resource_guard.report.types.PHASES`), switched on the
monitor's :class:`~resource_guard.observe.phases.PhaseClock` at the Trainer's public boundaries:

- ``data_wait``: inside the train loader's ``__next__`` only (:func:`time_loader_next`);
- ``forward``: from the model's forward pre-hook (a training forward) to its forward hook;
- ``backward``: from there to the next event (``on_substep_end``, or the optimizer's step pre-hook): the
  loss, ``backward`` and the gradient clipping;
- ``optimizer``: from the optimizer's step pre-hook (``Optimizer.register_step_pre_hook``) to
  ``on_step_end`` (the step, the learning-rate scheduler, ``zero_grad``);
- ``logging``, ``evaluation``, ``checkpoint``: the Trainer announces these at their end (``on_log``,
  ``on_evaluate``, ``on_save``), after ``on_step_end``: the time since the previous boundary is charged to
  them when they end (:meth:`PhaseClock.charge_to`); evaluation also starts at its first eval-mode forward
  (the evaluation loop), and the ``on_log`` of its metrics is evaluation;
- ``host``: the rest between steps (the Trainer's own bookkeeping, other callbacks' hooks).

So evaluation and checkpoints every N steps are phases of their own, never data wait.

Example:
    >>> ticks = iter([1.0, 1.5, 3.5])
    >>> clock = PhaseClock(now=0.0, clock=lambda: next(ticks))
    >>> phases = TrainerPhases(clock)
    >>> phases.step_end()  # at 1.0: 1 s of "other" (before the first boundary)
    >>> phases.logged()  # at 1.5: logging since on_step_end
    >>> phases.saved()  # at 3.5: the checkpoint since on_log
    >>> totals = clock.take(4.0)
    >>> totals["logging"], totals["checkpoint"], totals["host"]
    (0.5, 2.0, 0.5)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from resource_guard.observe.phases import PhaseClock

__all__ = ["TrainerPhases", "time_loader_next"]


class TrainerPhases:
    """Switches ``clock`` at the Trainer's boundaries during ``train``; :meth:`remove` undoes the hooks.

    The callback calls the methods named after its events; :meth:`install` adds the optimizer's step
    hooks and times the train loader's ``__next__``.

    Args:
        clock: the monitor's phase clock.
    """

    def __init__(self, clock: PhaseClock) -> None:
        self.clock = clock
        self._evaluating = False
        self._undo: list[Callable[[], None]] = []
        self.notes: list[str] = []

    def install(self, optimizer: Any, loader: Any) -> None:
        """The optimizer's step pre-hook (public since torch 2.0) and the train loader's ``__next__``."""
        register = getattr(optimizer, "register_step_pre_hook", None)
        if callable(register):
            handle = register(lambda *_: self.optimizer_start())
            self._undo.append(handle.remove)
        undo = time_loader_next(loader, self.clock) if loader is not None else None
        if undo is None:
            self.notes.append("the train loader's __next__ is not timed: its wait counts as host time")
        else:
            self._undo.append(undo)

    def remove(self) -> None:
        """Undo the hooks. Safe to call twice."""
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            fn()

    # -- the training step -------------------------------------------------------------------------
    def forward_start(self, training: bool) -> None:
        """The model's forward pre-hook: a training forward, or the evaluation loop's first batch."""
        if training:
            if not self._evaluating:
                self.clock.switch("forward")
        elif not self._evaluating:  # the evaluation loop began with its loader: all of it is evaluation
            self._evaluating = True
            self.clock.charge_to("evaluation", then="evaluation")

    def forward_end(self, training: bool) -> None:
        """The model's forward hook: the loss and backward follow."""
        if training and not self._evaluating:
            self.clock.switch("backward")

    def optimizer_start(self) -> None:
        if not self._evaluating:
            self.clock.switch("optimizer")

    def substep_end(self) -> None:
        """``on_substep_end``: a micro-step of an accumulation ended."""
        if not self._evaluating:
            self.clock.switch("host")

    def step_end(self) -> None:
        """``on_step_end``: the optimizer step, scheduler and ``zero_grad`` are done."""
        if not self._evaluating:
            self.clock.switch("host")

    # -- between steps: announced at their end -----------------------------------------------------
    def logged(self) -> None:
        """``on_log``: the time since the previous boundary was logging (the loss's gather and ``.item()``,
        the loggers); inside an evaluation, its metrics' log is evaluation."""
        if not self._evaluating:
            self.clock.charge_to("logging")

    def evaluated(self) -> None:
        """``on_evaluate``: the evaluation ended (begun at its first forward, else since the previous
        boundary)."""
        if self._evaluating:
            self._evaluating = False
            self.clock.switch("host")
        else:
            self.clock.charge_to("evaluation")

    def saved(self) -> None:
        """``on_save``: the time since the previous boundary was saving the checkpoint."""
        if self._evaluating:  # a save announced inside an evaluation: the evaluation ended before it
            self._evaluating = False
            self.clock.switch("host")
        self.clock.charge_to("checkpoint")


def time_loader_next(loader: Any, clock: PhaseClock) -> Callable[[], None] | None:
    """Time the ``__next__`` of the iterators ``loader`` hands out as ``data_wait``; the undo, or ``None``
    when the loader cannot be wrapped.

    The Trainer iterates the loader it shows its callbacks (``train_dataloader`` at ``on_train_begin``),
    but offers no hook around a batch's fetch: the instance's class is swapped for a subclass whose
    ``__iter__`` wraps the iterator (the one seam of this door's timing; ``__iter__`` is looked up on the
    type). accelerate's ``DataLoaderShard`` (which poses as its base loader's class) iterates its
    ``base_dataloader``, a torch ``DataLoader``: that is the one timed, its fetch being the wait (the
    shard's copy to the device is host time). ``tests/frontdoors/test_hf_phases.py`` fails if the Trainer
    stops iterating that loader.
    """
    loader = getattr(loader, "base_dataloader", loader)
    cls = type(loader)
    if getattr(cls, "_resource_guard_timed", False) or not hasattr(loader, "__dict__"):
        return None
    original_iter = cls.__iter__

    def __iter__(self: Any) -> Iterator[Any]:
        return _TimedIterator(original_iter(self), clock)

    try:
        timed = type(cls.__name__, (cls,), {"__iter__": __iter__, "_resource_guard_timed": True})
        timed.__module__ = cls.__module__
        timed.__qualname__ = cls.__qualname__
        loader.__class__ = timed
    except (TypeError, AttributeError):  # instances that cannot change class (C types, a __class__ property)
        return None

    def undo() -> None:
        if type(loader) is timed:
            loader.__class__ = cls

    return undo


class _TimedIterator:
    """An iterator whose ``__next__`` runs as ``data_wait``; everything else is the wrapped iterator's."""

    def __init__(self, inner: Iterator[Any], clock: PhaseClock) -> None:
        self._inner, self._clock = inner, clock

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        previous = self._clock.switch("data_wait")
        try:
            return next(self._inner)
        finally:
            self._clock.switch(previous)

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
