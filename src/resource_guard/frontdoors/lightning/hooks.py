"""The user's step hooks called as Lightning's loops call them.

Lightning passes ``batch_idx`` to ``training_step`` only when the hook's signature takes it (two
parameters after ``self``, a parameter named ``batch_idx``, or ``*args``), and to
``validation_step``/``test_step``/``predict_step`` likewise, with ``dataloader_idx`` after it when the
loop has more than one dataloader. Lightning's GAN example writes ``training_step(self, batch)``; a
pre-flight that always passed ``batch_idx`` would fail on it with a ``TypeError`` and fall back to the
analytic bound. The check is Lightning's own (``lightning.pytorch.utilities.signature_utils.
is_param_in_hook_signature``, what ``training_epoch_loop`` and ``evaluation_loop`` call).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

__all__ = ["call_eval_step", "call_training_step", "eval_step_args", "training_step_args"]


def training_step_args(hook: Any, batch: Any, batch_idx: int = 0) -> tuple[Any, ...]:
    """The positional arguments Lightning's training loop gives ``hook`` (a bound ``training_step``).

    >>> class M:
    ...     def training_step(self, batch): ...
    >>> training_step_args(M().training_step, "b")
    ('b',)
    """
    if is_param_in_hook_signature(hook, "batch_idx", min_args=2):
        return (batch, batch_idx)
    return (batch,)


def eval_step_args(
    hook: Any, batch: Any, batch_idx: int = 0, dataloader_idx: int | None = None
) -> tuple[Any, ...]:
    """The positional arguments Lightning's evaluation and predict loops give ``hook``: ``batch``,
    ``batch_idx`` unless the signature cannot take it, and ``dataloader_idx`` when the loop has several
    dataloaders (``None`` here: one).

    >>> class M:
    ...     def validation_step(self, batch, batch_idx, dataloader_idx=0): ...
    >>> eval_step_args(M().validation_step, "b", 0, 1)
    ('b', 0, 1)
    """
    args: list[Any] = [batch, batch_idx]
    if dataloader_idx is not None:
        args.append(dataloader_idx)
    if not is_param_in_hook_signature(hook, "batch_idx", min_args=2):
        args.pop(1)
    return tuple(args)


def call_training_step(module: Any, batch: Any, batch_idx: int = 0) -> Any:
    """``module.training_step`` called as Lightning calls it."""
    hook = module.training_step
    return hook(*training_step_args(hook, batch, batch_idx))


def call_eval_step(
    module: Any, name: str, batch: Any, batch_idx: int = 0, dataloader_idx: int | None = None
) -> Any:
    """``module.<name>`` (``validation_step``, ``test_step``, ``predict_step``) called as Lightning
    calls it."""
    hook = getattr(module, name)
    return hook(*eval_step_args(hook, batch, batch_idx, dataloader_idx))
