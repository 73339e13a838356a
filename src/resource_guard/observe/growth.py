"""Memory growth: allocated memory read at step ends, grouped by batch signature, and its trend.

A step that keeps something it should not (a loss or an output kept with its graph, a list of tensors)
leaves more memory allocated at the end of each step than at the end of the one before, at the same
batch shapes. :class:`MemoryWatch` reads the allocated bytes at some step ends (never inside a step,
where activations come and go) with the batch's signature (:func:`batch_signature`); :func:`memory_trend`
fits a line through the readings of the most common signature and says how steep and how steady the
rise is. The report's ``memory-growth`` rule (:mod:`resource_guard.report.rules`) judges it.

What "allocated" is:

- CUDA: ``torch.cuda.memory_allocated`` (the caching allocator's live tensor bytes).
- CPU: the bytes ``malloc`` has handed out and not taken back (glibc ``mallinfo2``: ``uordblks``, the
  in-use heap chunks, + ``hblkhd``, the ``mmap``'d chunks), which is where PyTorch's CPU allocator puts
  every tensor. It costs about 1 µs and moves with live tensors only. The process's RSS was the other
  candidate: it also counts pages the allocator freed but kept (glibc does not give back a heap that is
  not free at its top), so a leak that reuses freed pages does not show and a healthy run climbs as the
  heap is first touched; and it costs ~12 µs through psutil. PyTorch has no CPU allocator statistics
  (c10 counts CPU bytes only while the memory profiler runs), and the profiler is far too costly to leave
  on. Where ``mallinfo2`` is missing (not glibc, or a preloaded jemalloc/tcmalloc that answers 0) the
  RSS is used, and the evidence says so (``source``).

Reads are spaced so that they cost at most :data:`READ_BUDGET` of the step time (the stride adapts to
the measured cost of a read and the measured step time).

Example:
    >>> samples = [(s, ((8, 16),), 1000 + 100 * s) for s in range(1, 41)]
    >>> t = memory_trend(samples, source="cuda_allocated")
    >>> round(t.bytes_per_step), t.rising_share, round(t.r_squared, 3)
    (100, 1.0, 1.0)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "READ_BUDGET",
    "MemoryTrend",
    "MemoryWatch",
    "batch_signature",
    "cpu_allocated_bytes",
    "memory_trend",
]

READ_BUDGET = 0.0005  # share of the step time the memory reads may cost (0.05%)
MAX_STRIDE = 64  # at least one reading every 64 steps
MAX_SAMPLES = 4096  # then every other reading is dropped and the stride doubles
MIN_SAMPLES = 6  # readings at one signature needed before a trend is fitted


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd")
        + ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _mallinfo2() -> Callable[[], Any] | None:
    """glibc's ``mallinfo2`` (2.33+), or None where this C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn  # type: ignore[no-any-return]


_MALLINFO2: Callable[[], Any] | None = None
_MALLINFO2_LOOKED = False


def cpu_allocated_bytes() -> tuple[int, str]:
    """``(bytes, source)``: the process's ``malloc`` bytes in use (``"cpu_malloc_in_use"``), else its
    resident set size (``"rss"``). See the module docstring for why."""
    global _MALLINFO2, _MALLINFO2_LOOKED
    if not _MALLINFO2_LOOKED:
        _MALLINFO2, _MALLINFO2_LOOKED = _mallinfo2(), True
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        in_use = int(info.uordblks) + int(info.hblkhd)
        if in_use > 0:  # a preloaded allocator leaves glibc's arenas empty: 0
            return in_use, "cpu_malloc_in_use"
    import psutil

    return int(psutil.Process().memory_info().rss), "rss"


def batch_signature(batch: Any) -> tuple[Any, ...] | None:
    """``(shape, dtype)`` of each tensor of a flat batch (a tensor, or a tuple, list or dict of tensors
    and plain values), about 0.5 µs; ``None`` for nested or other batches (see ``iter_tensors``).

    >>> batch_signature((torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)))
    ((torch.Size([8, 4]), torch.float32), (torch.Size([8]), torch.int64))
    """
    if isinstance(batch, torch.Tensor):
        return ((batch.shape, batch.dtype),)
    kind = type(batch)
    if kind is tuple or kind is list:
        parts: Any = batch
    elif kind is dict:
        parts = batch.values()
    else:
        return None
    out: list[Any] = []
    for value in parts:
        if isinstance(value, torch.Tensor):
            out.append((value.shape, value.dtype))
        elif value is None or isinstance(value, (int, float, str, bool)):
            out.append(value if not isinstance(value, str) else None)
        else:
            return None
    return tuple(out)


@dataclass(frozen=True)
class MemoryTrend:
    """The fitted trend of allocated memory at step ends, at one batch signature.

    Attributes:
        bytes_per_step: slope of the least-squares line through the readings.
        steps: steps between the first and the last reading used.
        samples: readings used (after the warm-up ones).
        r_squared: how well a straight line explains the readings (1: a steady rise).
        rising_share: share of consecutive readings that went up.
        first_bytes / last_bytes: the first and the last reading used.
        signature: the batch shapes the readings share (``None``: shapes unknown).
        source: what was read: ``"cuda_allocated"``, ``"cpu_malloc_in_use"`` or ``"rss"``.
    """

    bytes_per_step: float
    steps: int
    samples: int
    r_squared: float
    rising_share: float
    first_bytes: int
    last_bytes: int
    signature: tuple[tuple[int, ...], ...] | None
    source: str

    @property
    def rise_bytes(self) -> int:
        """The fitted rise over the readings: ``bytes_per_step × steps``."""
        return int(self.bytes_per_step * self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_step": round(self.bytes_per_step, 1),
            "steps": self.steps,
            "samples": self.samples,
            "rise_bytes": self.rise_bytes,
            "r_squared": round(self.r_squared, 4),
            "rising_share": round(self.rising_share, 4),
            "first_bytes": self.first_bytes,
            "last_bytes": self.last_bytes,
            "batch_shapes": None if self.signature is None else [list(s) for s in self.signature],
            "source": self.source,
        }


def memory_trend(
    samples: Sequence[tuple[int, Hashable, int]], *, source: str, warmup_share: float = 0.1
) -> MemoryTrend | None:
    """The trend of ``(step, signature, bytes)`` readings at their most common signature.

    The first readings of that signature (``warmup_share`` of them, at least one) are left out: the
    first steps create the optimizer state and warm the allocator. ``None`` with fewer than
    :data:`MIN_SAMPLES` readings left.
    """
    groups: dict[Hashable, list[tuple[int, int]]] = {}
    for step, signature, value in samples:
        groups.setdefault(signature, []).append((step, value))
    if not groups:
        return None
    signature, points = max(groups.items(), key=lambda kv: len(kv[1]))
    points = points[max(1, math.ceil(len(points) * warmup_share)) :]
    if len(points) < MIN_SAMPLES:
        return None
    xs = [float(s) for s, _ in points]
    ys = [float(v) for _, v in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    if sxx == 0:
        return None
    slope = sxy / sxx
    r_squared = (sxy * sxy) / (sxx * syy) if syy > 0 else 0.0
    rising = sum(b > a for a, b in zip(ys, ys[1:])) / (n - 1)
    return MemoryTrend(
        bytes_per_step=slope,
        steps=int(xs[-1] - xs[0]),
        samples=n,
        r_squared=r_squared,
        rising_share=rising,
        first_bytes=int(ys[0]),
        last_bytes=int(ys[-1]),
        signature=_shapes(signature),
        source=source,
    )


def _shapes(signature: Hashable) -> tuple[tuple[int, ...], ...] | None:
    """The tensor shapes of a signature: :func:`batch_signature`'s ``(shape, dtype)`` pairs, or shapes."""
    if not isinstance(signature, tuple):
        return None
    out = []
    for part in signature:
        if isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], torch.Size):
            out.append(tuple(part[0]))
        elif isinstance(part, tuple) and all(isinstance(d, int) for d in part):
            out.append(tuple(part))
    return tuple(out)


class MemoryWatch:
    """Reads allocated memory at some step ends, spaced to cost at most :data:`READ_BUDGET` of a step.

    Args:
        read: returns the allocated bytes now.
        source: what ``read`` reads (see :class:`MemoryTrend`).
        clock: ``time.perf_counter``, or a fake in tests.

    The owner calls :meth:`due` at every step end (an int comparison) and :meth:`sample` when it is.
    """

    __slots__ = ("_read", "source", "_clock", "next_step", "_stride", "_last", "samples")

    def __init__(
        self, read: Callable[[], int], source: str, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._read, self.source, self._clock = read, source, clock
        self.next_step = 1
        self._stride = 1
        self._last: tuple[int, float] | None = None  # (step, time) of the previous reading
        self.samples: list[tuple[int, Hashable, int]] = []

    def sample(self, step: int, signature: Hashable) -> None:
        """Read now (the end of ``step``) and schedule the next reading. May raise what ``read`` raises."""
        start = self._clock()
        value = self._read()
        end = self._clock()
        self.samples.append((step, signature, int(value)))
        if self._last is not None and step > self._last[0]:
            step_s = (start - self._last[1]) / (step - self._last[0])
            if step_s > 0:
                wanted = math.ceil((end - start) / (READ_BUDGET * step_s))
                self._stride = max(1, min(MAX_STRIDE, wanted, self._stride * 2))
        self._last = (step, end)
        if len(self.samples) >= MAX_SAMPLES:
            del self.samples[::2]
            self._stride = min(MAX_STRIDE * 2, self._stride * 2)
        self.next_step = step + self._stride

    def trend(self) -> MemoryTrend | None:
        """:func:`memory_trend` of the readings so far."""
        return memory_trend(self.samples, source=self.source)
