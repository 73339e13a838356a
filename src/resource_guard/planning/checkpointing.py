"""Activation checkpointing of a model's repeated blocks, switched on and off without a trace.

Two ways, picked per model:

- A transformers ``PreTrainedModel`` that supports it uses its own switch
  (``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` with
  ``use_reentrant=False``), which checkpoints its decoder/encoder layers the way the library intends.
- Any other model: the repeated blocks are the children of the ``nn.ModuleList`` / ``nn.Sequential``
  whose children all share one class and which holds the most parameters (a transformer's layer
  list, a ResNet's stages). Each block's ``forward`` is replaced, on the instance only, by one that
  runs the class's ``forward`` under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
  when training with gradients enabled. The state dict, module names and parameters stay the same.

:meth:`CheckpointHandle.remove` restores the model exactly: every attribute and hook the switch
added or changed is put back as it was, so ``apply`` then ``remove`` is a no-op. The change lives in
the modules themselves, so it survives ``copy.deepcopy`` (the estimator copies the model onto fake
tensors) and pickling.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]))
    >>> find_checkpoint_blocks(model)
    ('1.0', '1.1', '1.2')
    >>> handle = apply_checkpointing(model)
    >>> handle.method, len(handle.modules)
    ('wrap', 3)
    >>> handle.remove()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from resource_guard.errors import ConfigurationError

__all__ = ["CheckpointHandle", "apply_checkpointing", "find_checkpoint_blocks", "supports_own_switch"]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
)
_STRUCTURE = ("_parameters", "_buffers", "_modules", *_HOOK_DICTS)
_MISSING = object()


def supports_own_switch(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model with its own activation-checkpointing switch."""
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and (
        hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")
    )


def _own_switch_modules(model: nn.Module, *, flagged_only: bool = True) -> tuple[str, ...]:
    """The units transformers' switch checkpoints: its ``GradientCheckpointingLayer`` blocks (v4.52+),
    else every module with a ``gradient_checkpointing`` flag; ``flagged_only``: those switched on."""
    named = [
        (n, m)
        for n, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing") and (not flagged_only or m.gradient_checkpointing is True)
    ]
    layers = [n for n, m in named if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
    return tuple(layers) if layers else tuple(n for n, _ in named)


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_checkpoint_blocks(model: nn.Module) -> tuple[str, ...]:
    """Qualified names of the blocks :func:`apply_checkpointing` would checkpoint (empty: none).

    For a transformers model with its own switch: the modules it would checkpoint (its layers, as
    the ones carrying a ``gradient_checkpointing`` flag). Otherwise: the children of the
    ``ModuleList``/``Sequential`` of ≥ 2 same-class, parameter-holding blocks with the most parameters.
    """
    if supports_own_switch(model):
        return _own_switch_modules(model, flagged_only=False)
    best: tuple[tuple[int, int], str, list[str]] | None = None
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        params = _param_count(container)
        if params == 0:
            continue
        key = (params, len(children))
        if best is None or key > best[0]:
            prefix = f"{name}." if name else ""
            best = (key, name, [prefix + child for child, _ in children])
    return tuple(best[2]) if best is not None else ()


def _checkpointed_forward(
    module: nn.Module, inner: Callable[..., Any] | None, *args: Any, **kwargs: Any
) -> Any:
    """The block's forward under ``torch.utils.checkpoint`` when training with gradients enabled."""
    forward = inner if inner is not None else type(module).forward.__get__(module)
    if not (module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _snapshot(model: nn.Module) -> dict[int, tuple[nn.Module, dict[str, Any], dict[str, list[int]]]]:
    snap = {}
    for m in model.modules():
        attrs = {k: v for k, v in m.__dict__.items() if k not in _STRUCTURE}
        hooks = {h: list(getattr(m, h, {})) for h in _HOOK_DICTS}
        snap[id(m)] = (m, attrs, hooks)
    return snap


class CheckpointHandle:
    """What :func:`apply_checkpointing` changed; :meth:`remove` undoes it exactly (idempotent).

    Attributes:
        modules: qualified names of the checkpointed modules.
        method: ``"transformers"`` (the model's own switch) or ``"wrap"`` (forward wrapped).
        active: False once removed (or when checkpointing was already on and nothing was changed).
    """

    def __init__(self, modules: tuple[str, ...], method: str, undo: Callable[[], None] | None) -> None:
        self.modules = modules
        self.method = method
        self._undo = undo
        self.active = undo is not None

    def remove(self) -> None:
        """Restore the model as it was before :func:`apply_checkpointing`."""
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()
        self.active = False

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"CheckpointHandle(method={self.method!r}, modules={len(self.modules)}, active={self.active})"


def _apply_own_switch(model: nn.Module) -> CheckpointHandle:
    already = _own_switch_modules(model)
    if already:  # the user switched it on: leave it, and leave it on at remove()
        return CheckpointHandle(already, "transformers", None)
    before = _snapshot(model)
    kwargs = {"use_reentrant": False}
    hf: Any = model
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    after = _snapshot(model)

    def undo() -> None:
        for key, (module, attrs, hooks) in after.items():
            old = before.get(key)
            old_attrs, old_hooks = (old[1], old[2]) if old is not None else ({}, {})
            for name, value in attrs.items():
                previous = old_attrs.get(name, _MISSING)
                if previous is _MISSING:
                    module.__dict__.pop(name, None)
                elif previous is not value:
                    module.__dict__[name] = previous
            for hook_dict, ids in hooks.items():
                added = set(ids) - set(old_hooks.get(hook_dict, []))
                table = getattr(module, hook_dict, None)
                for hook_id in added:
                    if table is not None:
                        table.pop(hook_id, None)

    return CheckpointHandle(_own_switch_modules(model), "transformers", undo)


def apply_checkpointing(model: nn.Module, every: int = 1) -> CheckpointHandle:
    """Switch on activation checkpointing of ``model``'s repeated blocks.

    Args:
        model: a transformers model (its own switch is used) or any module with a ``ModuleList`` /
            ``Sequential`` of same-class blocks.
        every: checkpoint every ``every``-th block (blocks 0, k, 2k, ...; selective checkpointing);
            1: all of them. With ``every > 1`` the blocks' forwards are wrapped, also for
            transformers models.

    Returns:
        A :class:`CheckpointHandle`; ``handle.remove()`` restores the model exactly.

    Raises:
        ConfigurationError: the model has no repeated blocks to checkpoint.
    """
    if not isinstance(model, nn.Module):
        raise ConfigurationError(
            f"`apply_checkpointing(model=...)` needs a torch.nn.Module, got {type(model).__name__}"
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigurationError(f"`apply_checkpointing(every={every!r})` must be an int >= 1")
    if supports_own_switch(model) and every == 1:
        return _apply_own_switch(model)
    names = find_checkpoint_blocks(model)[::every]
    if not names:
        raise ConfigurationError(
            f"`apply_checkpointing`: {type(model).__name__} has no repeated blocks (a ModuleList or "
            "Sequential of same-class modules with parameters); checkpoint inside its forward with "
            "torch.utils.checkpoint, or plan with `checkpointing=False`."
        )
    wrapped: list[tuple[nn.Module, Any]] = []
    for name in names:
        block = model.get_submodule(name)
        previous = block.__dict__.get("forward", _MISSING)
        inner = None if previous is _MISSING else previous
        block.forward = functools.partial(_checkpointed_forward, block, inner)  # type: ignore[method-assign]
        wrapped.append((block, previous))

    def undo() -> None:
        for block, previous in wrapped:
            if previous is _MISSING:
                block.__dict__.pop("forward", None)
            else:
                block.__dict__["forward"] = previous

    return CheckpointHandle(names, "wrap", undo)
