"""Tensors a model holds outside its parameters and buffers.

``model.parameters()`` and ``model.buffers()`` are not all a model keeps: a module may hold a plain
tensor attribute (a cache it built itself, not registered), and a parameter may be a subclass that
carries more tensors than its own data. Quantized layers are the common case: a bitsandbytes
``Params4bit`` weight is packed 4-bit data plus a ``quant_state`` with its per-block ``absmax`` (and,
double-quantized, a second state), and an ``Int8Params`` weight keeps its row scales ``SCB``. These
tensors are part of the model's memory, and a fake copy of the model must fake them too (a real tensor
cannot be deep-copied inside a ``FakeTensorMode``).

:func:`attached_tensors` finds them: plain tensor attributes of every module, and the tensors inside
every parameter's own attributes, through containers and plain attribute objects, to a bounded depth.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Attached", "attached_tensors"]

_MAX_DEPTH = 4  # a quant_state's nested state2.absmax is at depth 3 from the parameter
_NOT_WALKED = (
    nn.Module,
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    str,
    bytes,
    int,
    float,
    bool,
    torch.dtype,
    torch.device,
)


_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # _parameters, _buffers, _modules, the hook dicts …


@dataclass(frozen=True)
class Attached:
    """One tensor the model holds outside ``parameters()``/``buffers()``, and who holds it."""

    tensor: torch.Tensor
    owner: str  # "parameter" (inside a parameter's attributes) or "module" (a module's attribute)
    alias_of: torch.Tensor | None = None  # the parameter or buffer whose storage it shares (no more bytes)


def attached_tensors(model: nn.Module) -> list[Attached]:
    """Tensors held by ``model`` that are not its parameters or buffers, each once; one that shares a
    parameter's or buffer's storage (an ``Int8Params``' ``CB`` is its own data) names it in ``alias_of``."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    bases = {_storage_key(t): t for t in (*model.parameters(), *model.buffers())}
    bases.pop(None, None)
    seen: dict[int, Any] = {}  # id -> the object, kept alive so that no id is reused
    found: list[Attached] = []

    def collect(obj: Any, owner: str) -> None:
        for t in _walk(obj, 0, seen):
            if id(t) not in own:
                own.add(id(t))
                found.append(Attached(t, owner, bases.get(_storage_key(t))))

    for p in {id(p): p for p in model.parameters()}.values():
        collect(vars(p), "parameter")
    for m in model.modules():
        collect({k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS}, "module")
    return found


def _storage_key(t: torch.Tensor) -> int | None:
    if t.is_meta or not hasattr(t, "untyped_storage"):
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor), or a freed storage
        return None
    return ptr or None


def _walk(obj: Any, depth: int, seen: dict[int, Any]) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth >= _MAX_DEPTH or id(obj) in seen or obj is None or isinstance(obj, _NOT_WALKED):
        return
    seen[id(obj)] = obj
    if isinstance(obj, dict):
        children: Any = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = obj
    elif hasattr(obj, "__dict__") and not callable(obj):
        children = vars(obj).values()
    else:
        return
    for child in list(children):
        yield from _walk(child, depth + 1, seen)
