"""Custom operators traced through their device-agnostic Python kernel.

A library's custom operator (``torch.library``: bitsandbytes' ``gemm_4bit``, a fused layer of some
other package) reaches a fake tensor as one call of its fake rule, which makes its outputs and nothing
else. Its real kernel may allocate more: bitsandbytes' 4-bit matmul dequantizes the whole weight into
a temporary and then runs ``F.linear``. Where the operator has no kernel of its own for the target's
backend (nor for the CPU, which this build can run) but has a ``CompositeExplicitAutograd`` kernel,
the target runs that composite, written in torch operators: the trace runs it too, operator by
operator, so its temporaries are counted. An operator with a backend kernel of its own (native code)
keeps its fake rule (outputs only), as do aten's operators, whose memory the tracer models itself.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CompositeOps"]

_BACKEND_KEY = {"cpu": "CPU", "cuda": "CUDA", "rocm": "CUDA", "mps": "MPS"}
_NATIVE = frozenset({"aten", "prims", "prim", "_c10d_functional", "c10d", "profiler", "quantized"})
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)  # resolves to the composite (checked first)


class CompositeOps:
    """Which custom operators the trace runs through their composite kernel, and how often it did."""

    def __init__(self, device_kind: str, cpu_autocast: torch.dtype | None = None) -> None:
        self._key = _BACKEND_KEY.get(device_kind)
        self._autocast = cpu_autocast
        self._decided: dict[Any, bool] = {}
        self._depth = 0  # composites running now
        self.used: Counter[str] = Counter()

    def applies(self, func: Any) -> bool:
        """``func`` is a custom operator that the target runs as its composite kernel."""
        known = self._decided.get(func)
        if known is None:
            known = self._decided[func] = self._key is not None and _composite_only(func, self._key)
        return known

    def run(
        self, func: Any, mode: TorchDispatchMode, args: tuple, kwargs: dict, *, in_forward: bool
    ) -> tuple[bool, Any]:
        """``(True, outputs)`` of ``func`` run through its composite under ``mode``; ``(False, None)``
        where it does not apply or the composite cannot run on fake tensors (the fake rule stands).

        A kernel runs with the autocast state of its caller, but a dispatch mode runs with autocast
        switched off: the forward's CPU autocast is switched on again for the composite's operators.
        """
        if self._depth and _implicit(func):
            # inside a composite, below autograd: an implicit composite (``linear``) reaches the mode
            # whole; the real kernel decomposes it (``mm`` and its scratch), so does the trace
            with mode:
                out = func.decompose(*args, **kwargs)
            return out is not NotImplemented, out
        if not self.applies(func):
            return False, None
        autocast = self._autocast if in_forward else None
        policy = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
        self._depth += 1
        try:
            with mode, policy:  # re-entered: the composite's operators are tracked one by one
                out = func.redispatch(_CPU, *args, **kwargs)
        except Exception:  # noqa: BLE001 - e.g. a value read: its fake rule is still exact for outputs
            self._decided[func] = False
            return False, None
        finally:
            self._depth -= 1
        self.used[_name(func)] += 1
        return True, out

    def notes(self) -> list[str]:
        """One line per operator traced through its composite kernel."""
        return [
            f"`{name}` ({n}x): traced through its device-agnostic kernel (its temporaries counted)"
            for name, n in sorted(self.used.items())
        ]


def _name(func: Any) -> str:
    overload = func._overloadname
    return func._schema.name + ("" if overload == "default" else f".{overload}")


def _implicit(func: Any) -> bool:
    return isinstance(func, torch._ops.OpOverload) and _has_kernel(func, "CompositeImplicitAutograd")


def _composite_only(func: Any, backend_key: str) -> bool:
    if not isinstance(func, torch._ops.OpOverload) or func.namespace in _NATIVE:
        return False
    if not _has_kernel(func, "CompositeExplicitAutograd"):
        return False
    # no native kernel of its own, on this build's CPU nor on the target's backend
    return not _has_kernel(func, "CPU") and not _has_kernel(func, backend_key)


def _has_kernel(func: Any, key: str) -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(_name(func), key))
    except RuntimeError:  # an operator the dispatcher does not hold (``prim::device``)
        return False
