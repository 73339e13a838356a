"""Autocast regions a model opens inside its forward, as CUDA sees them, while CUDA autocast is emulated.

Models open their own regions: ``with torch.autocast(x.device.type, enabled=False)`` around a softmax,
a norm, a loss or a rotary embedding computed in float32 (transformers' ``maybe_autocast``), a nested
``torch.autocast("cuda", dtype=torch.float16)``, ``@torch.cuda.amp.autocast(enabled=False)``, an
autograd ``Function`` under ``torch.amp.custom_fwd(cast_inputs=torch.float32)``. On a GPU these change
what runs in low precision. In an estimate the tensors are CPU fakes, so ``x.device.type`` is
``"cpu"``, and on this CPU-only host ``torch.autocast("cuda")`` switches itself off (with a warning).

So the emulated CUDA autocast state is kept where CUDA keeps it, in the thread-local CUDA autocast
flags (``torch.is_autocast_enabled("cuda")``, ``torch.get_autocast_dtype("cuda")``,
``torch.is_autocast_cache_enabled()``; setting them costs nothing, as no fake tensor carries the
``AutocastCUDA`` dispatch key), and, while :func:`routed` is in force in a thread, in that thread:

- an autocast region (``torch.autocast``, ``torch.amp.autocast``, ``torch.cuda.amp.autocast``,
  ``torch.cpu.amp.autocast``, the decorator forms, ``custom_fwd``/``custom_bwd``'s regions) entered
  for ``"cuda"`` or ``"cpu"`` sets that state as ``torch.autocast.__enter__`` would on a GPU, as
  asked (``enabled=True`` stays on; a ``"cpu"`` region with no dtype takes CUDA's), and restores it
  on exit, exceptions included; the CPU autocast (off for a CUDA target) is not touched;
- ``torch.is_autocast_enabled("cpu")`` / ``torch.get_autocast_dtype("cpu")`` answer for CUDA
  (what ``x.device.type`` asks on a GPU), and ``custom_fwd``'s ``cast_inputs`` casts the fake CPU
  tensors it would cast on CUDA.

The weight-cast cache follows ``aten/src/ATen/autocast_mode.cpp`` (``cached_cast``, torch 2.13): one
cache per thread, keyed by the source tensor only (a weight cast to bfloat16 in the outer region is
returned as is inside a nested float16 region), used only while ``cache_enabled``, and cleared only
when the outermost region exits (``autocast.__exit__``: ``autocast_decrement_nesting() == 0``), not
when a nested ``enabled=False`` region does.

How: ``torch.amp.autocast_mode.autocast.__init__/__enter__/__exit__``, ``torch.is_autocast_enabled``,
``torch.get_autocast_dtype`` and ``torch.amp.autocast_mode._cast`` are wrapped while any thread is
routed (and given back when the last one leaves, also on error); the wrappers do what torch does for
every other thread and device. Regions created before the trace (a decorator applied at import) with
``"cuda"`` and ``enabled=True`` were already switched off by torch on this host: they stay off.
tests/estimate/test_autocast_regions.py fails loudly if these entry points move.

Example:
    >>> from resource_guard.estimate.emulate.cuda_autocast import CudaAutocast
    >>> x, w = torch.randn(2, 4), torch.nn.Parameter(torch.randn(4, 4))
    >>> with CudaAutocast(torch.bfloat16):
    ...     with torch.autocast(x.device.type, enabled=False):  # x.device.type: "cpu" here
    ...         inside = (x @ w).dtype
    ...     outside = (x @ w).dtype
    >>> inside, outside
    (torch.float32, torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.amp.autocast_mode as _amp

__all__ = ["AutocastState", "applied", "emulated_lower", "outer_region", "routed"]

_ROUTED_DEVICES = ("cuda", "cpu")  # "cpu": what ``x.device.type`` says of a fake tensor in the trace
_is_enabled = torch.is_autocast_enabled  # the originals, bound before anything is wrapped
_get_dtype = torch.get_autocast_dtype
_Autocast = _amp.autocast
_original_init = _Autocast.__init__
_original_enter = _Autocast.__enter__
_original_exit = _Autocast.__exit__
_original_cast = _amp._cast


@dataclass(frozen=True)
class AutocastState:
    """The (emulated) CUDA autocast state of this thread."""

    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def now(cls) -> AutocastState:
        return cls(_is_enabled("cuda"), _get_dtype("cuda"), torch.is_autocast_cache_enabled())

    def apply(self) -> None:
        torch.set_autocast_enabled("cuda", self.enabled)
        torch.set_autocast_dtype("cuda", self.dtype)
        torch.set_autocast_cache_enabled(self.cache_enabled)


def emulated_lower() -> torch.dtype | None:
    """The dtype CUDA autocast casts ``linear``/``matmul`` inputs to now, or ``None`` where it is off."""
    return _get_dtype("cuda") if _is_enabled("cuda") else None


class _Thread(threading.local):
    def __init__(self) -> None:
        self.routing = 0  # depth of `routed()` in this thread
        self.nesting = 0  # emulated ``autocast_increment_nesting`` depth
        self.caches: list[dict[int, Any]] = []  # the weight-cast caches of the emulations entered
        self.opened: list[tuple[object, AutocastState]] = []  # routed regions, with the state before


_here = _Thread()


@contextlib.contextmanager
def applied(state: AutocastState) -> Iterator[None]:
    """``state`` in force within, the previous one restored after."""
    saved = AutocastState.now()
    state.apply()
    try:
        yield
    finally:
        saved.apply()


@contextlib.contextmanager
def outer_region(dtype: torch.dtype | None, cache: dict[int, Any]) -> Iterator[None]:
    """The training step's own region (Lightning's ``torch.autocast`` around the forward), emulated.

    ``dtype=None``: no autocast (a ``-true`` precision), so no region: a model's own region inside
    is then the outermost one and clears ``cache`` when it ends. Regions the model opens are routed.
    """
    saved = AutocastState.now()
    _here.caches.append(cache)
    if dtype is not None:
        _here.nesting += 1
        AutocastState(True, dtype, saved.cache_enabled).apply()
    else:
        torch.set_autocast_enabled("cuda", False)
    try:
        with routed():
            yield
    finally:
        saved.apply()
        if dtype is not None:
            _here.nesting -= 1
        for i in range(len(_here.caches) - 1, -1, -1):
            if _here.caches[i] is cache:
                del _here.caches[i]
                break
        cache.clear()


# -- the wrappers ------------------------------------------------------------------------------------
def _init(
    self: Any,
    device_type: str,
    dtype: torch.dtype | None = None,
    enabled: bool = True,
    cache_enabled: bool | None = None,
) -> None:
    if not (_here.routing and device_type in _ROUTED_DEVICES):
        _original_init(self, device_type, dtype, enabled, cache_enabled)
        return
    # built disabled, so this host's missing CUDA (or bf16) does not switch it off; then as asked
    _original_init(self, device_type, dtype, False, cache_enabled)
    self._enabled = enabled


def _enter(self: Any) -> Any:
    if not (_here.routing and getattr(self, "device", None) in _ROUTED_DEVICES):
        return _original_enter(self)
    _here.opened.append((self, AutocastState.now()))
    _here.nesting += 1
    AutocastState(bool(self._enabled), self.fast_dtype, bool(self._cache_enabled)).apply()
    return self


def _exit(self: Any, exc_type: Any, exc_val: Any, exc_tb: Any) -> bool:
    for i in range(len(_here.opened) - 1, -1, -1):
        if _here.opened[i][0] is self:
            break
    else:  # entered outside the routing (or for another device): torch's own exit
        return bool(_original_exit(self, exc_type, exc_val, exc_tb))
    _, saved = _here.opened.pop(i)
    saved.apply()
    _here.nesting -= 1
    if _here.nesting <= 0:  # the outermost region ended: ``torch.clear_autocast_cache()``
        for cache in _here.caches:
            cache.clear()
    return False


def _as_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if _here.routing:
        if args and args[0] == "cpu":
            args = ("cuda", *args[1:])
        elif kwargs.get("device_type") == "cpu":
            kwargs = {**kwargs, "device_type": "cuda"}
    return args, kwargs


@functools.wraps(_is_enabled)
def _is_autocast_enabled(*args: Any, **kwargs: Any) -> bool:
    args, kwargs = _as_cuda(args, kwargs)
    return bool(_is_enabled(*args, **kwargs))


@functools.wraps(_get_dtype)
def _get_autocast_dtype(*args: Any, **kwargs: Any) -> torch.dtype:
    args, kwargs = _as_cuda(args, kwargs)
    return _get_dtype(*args, **kwargs)


@functools.wraps(_original_cast)
def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if _here.routing and device_type == "cuda":  # the tensors CUDA would cast are the fake CPU ones
        device_type = "cpu"
    return _original_cast(value, device_type, dtype)


_PATCHES: tuple[tuple[Any, str, Any, Any], ...] = (
    (_Autocast, "__init__", _original_init, _init),
    (_Autocast, "__enter__", _original_enter, _enter),
    (_Autocast, "__exit__", _original_exit, _exit),
    (torch, "is_autocast_enabled", _is_enabled, _is_autocast_enabled),
    (torch, "get_autocast_dtype", _get_dtype, _get_autocast_dtype),
    (_amp, "_cast", _original_cast, _cast),
)
_lock = threading.Lock()
_users = 0


@contextlib.contextmanager
def routed() -> Iterator[None]:
    """Within, in this thread, autocast regions and queries address the emulated CUDA autocast.

    The wrappers are installed by the first thread in and given back by the last one out; a wrapper
    replaced meanwhile by someone else is left to them.
    """
    global _users
    with _lock:
        if _users == 0:
            for owner, name, _, wrapper in _PATCHES:
                setattr(owner, name, wrapper)
        _users += 1
    _here.routing += 1
    try:
        yield
    finally:
        _here.routing -= 1
        if _here.routing == 0:  # a region entered and never exited: its state is restored by the caller
            _here.nesting -= len(_here.opened)
            _here.opened.clear()
        with _lock:
            _users -= 1
            if _users == 0:
                for owner, name, original, wrapper in _PATCHES:
                    if owner.__dict__.get(name) is wrapper:
                        setattr(owner, name, original)
