"""The Lightning door's phase timing: where each step's wall time goes under ``Trainer.fit``.

Lightning already marks its own boundaries: every hook, the training step, ``backward``, the optimizer
step, the train loader's ``__next__`` and ``save_checkpoint`` run inside
``trainer.profiler.profile(action_name)`` (what ``SimpleProfiler`` prints). :class:`LightningPhases`
wraps the trainer's profiler's ``start``/``stop`` on the instance (the user's profiler, if any, still
runs) and switches the monitor's :class:`~resource_guard.observe.phases.PhaseClock` by action name
(:func:`classify_action`: the one place that knows Lightning's names; a test fails loudly when they
move). Logging is timed by wrapping ``LightningModule.log``/``log_dict`` and each logger's
``log_metrics``/``save`` on their instances; evaluation from the callback's ``on_validation_start`` to
its ``on_validation_end``. Everything is put back at the end of ``fit``.

So the data wait is the loader's own ``__next__``: evaluation, checkpointing, logging and the module's
own hooks between steps are no longer blamed on data loading.

Example:
    >>> classify_action("[_TrainingEpochLoop].train_dataloader_next")
    'data_wait'
    >>> classify_action("[Strategy]SingleDeviceStrategy.backward")
    'backward'
    >>> classify_action("[LightningModule]Net.on_train_batch_end")
    'host'
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from resource_guard.observe.phases import PhaseClock

__all__ = ["LightningPhases", "classify_action"]

_EXACT = {
    "[_TrainingEpochLoop].train_dataloader_next": "data_wait",
    "run_training_batch": "forward",  # what its nested actions leave: the closure's own work
    "save_checkpoint": "checkpoint",  # Trainer.save_checkpoint, also ModelCheckpoint's saves
}
_SUFFIX = {
    ".training_step": "forward",
    ".backward": "backward",
    ".optimizer_step": "optimizer",
    ".optimizer_zero_grad": "optimizer",
    ".configure_gradient_clipping": "optimizer",
    ".lr_scheduler_step": "optimizer",
}
_HOOK_PREFIXES = ("[LightningModule]", "[Callback]", "[LightningDataModule]")
_STEP_PREFIXES = ("[Strategy]", "[LightningModule]")


@functools.lru_cache(maxsize=1024)
def classify_action(name: str, own: str = "") -> str | None:
    """The phase of one of Lightning's profiler actions (``None``: leave the running phase alone).

    ``own``: this callback's ``state_key`` (the monitor's own hooks are the monitor's time).
    Lightning's action names are not a documented API: they are what its ``SimpleProfiler`` prints;
    ``tests/frontdoors/test_lightning_phases.py`` fails when a name this relies on moves.
    """
    phase = _EXACT.get(name)
    if phase is not None:
        return phase
    if own and name.startswith(f"[Callback]{own}."):
        return None
    if name.startswith(_STEP_PREFIXES):
        hook = name[name.rfind(".") :]
        if hook in _SUFFIX:
            return _SUFFIX[hook]
    if name.startswith("[Callback]") and "Checkpoint" in name.split(".", 1)[0]:
        return "checkpoint"  # ModelCheckpoint's hooks: deciding and saving
    if name.startswith(_HOOK_PREFIXES):
        return "host"  # the user's hooks and other callbacks between and around steps
    return None


class LightningPhases:
    """Switches ``clock`` at Lightning's boundaries during ``fit``; :meth:`remove` puts everything back.

    Args:
        clock: the monitor's phase clock.
        own: the ResourceGuard callback's ``state_key``.
    """

    def __init__(self, clock: PhaseClock, own: str = "") -> None:
        self.clock, self.own = clock, own
        self._stack: list[tuple[str, str]] = []  # (action, phase to go back to)
        self._evaluating: str | None = None  # the phase to go back to after evaluation
        self._wrapped: list[tuple[Any, str, Any]] = []  # (object, attribute, its own instance value)

    # -- installing -------------------------------------------------------------------------------
    def install(self, trainer: Any, pl_module: Any) -> None:
        """Wrap the profiler's start/stop, the module's ``log``/``log_dict`` and the loggers' writes."""
        profiler = trainer.profiler
        self._wrap(profiler, "start", self._started)
        self._wrap(profiler, "stop", self._stopped)
        for name in ("log", "log_dict"):
            self._wrap(pl_module, name, self._as_logging)
        for logger in getattr(trainer, "loggers", ()) or ():
            for name in ("log_metrics", "save"):
                if callable(getattr(logger, name, None)):
                    self._wrap(logger, name, self._as_logging)

    def _wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(obj, name)
        own = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        setattr(obj, name, make(original))
        self._wrapped.append((obj, name, own))

    def remove(self) -> None:
        """Put back every wrapped attribute. Safe to call twice."""
        wrapped, self._wrapped = self._wrapped, []
        for obj, name, own in reversed(wrapped):
            if own is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, own)

    # -- the wrappers ------------------------------------------------------------------------------
    def _started(self, original: Callable[[str], Any]) -> Callable[[str], Any]:
        def start(action_name: str) -> Any:
            phase = classify_action(action_name, self.own)
            if phase is not None and (self._evaluating is None or phase == "checkpoint"):
                self._stack.append((action_name, self.clock.switch(phase)))
            return original(action_name)

        return start

    def _stopped(self, original: Callable[[str], Any]) -> Callable[[str], Any]:
        def stop(action_name: str) -> Any:
            try:
                return original(action_name)
            finally:
                stack = self._stack
                if stack and stack[-1][0] == action_name:
                    self.clock.switch(stack.pop()[1])

        return stop

    def _as_logging(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def logging(*args: Any, **kwargs: Any) -> Any:
            previous = self.clock.switch("logging")
            try:
                return original(*args, **kwargs)
            finally:
                self.clock.switch(previous)

        return logging

    # -- the callback's own boundaries --------------------------------------------------------------
    def step_start(self) -> None:
        """A training batch starts (``on_train_batch_start``): Lightning's own work is ``other``."""
        if self._evaluating is None:
            self.clock.switch("other")

    def evaluation_start(self) -> None:
        """``on_validation_start`` during ``fit``: evaluation until :meth:`evaluation_end`."""
        if self._evaluating is None:
            self._evaluating = self.clock.switch("evaluation")

    def evaluation_end(self) -> None:
        previous, self._evaluating = self._evaluating, None
        if previous is not None:
            self.clock.switch(previous)


_MISSING = object()
