"""Per-step timers, throughput and MFU maths, and the cross-rank aggregation of interval metrics.

The core that :class:`~resource_guard.RunMonitor` drives (as Lightning's ``ThroughputMonitor``
drives ``fabric/utilities/throughput.py``). Nothing here touches a device on the hot path:
:class:`StepTimer` reads ``time.perf_counter`` only.

Example:
    >>> t = StepTimer(now=0.0)
    >>> t.batch_ready(1.0, samples=8); t.step_end(3.0)
    >>> t.batch_ready(3.5, samples=8); t.step_end(5.0)
    >>> iv = t.take(5.0)
    >>> iv.steps, iv.wall_s, iv.data_wait_s, round(iv.data_wait_share, 3), iv.samples
    (2, 5.0, 1.5, 0.3, 16)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from resource_guard.errors import warn_at_user
from resource_guard.step.training import LossFn, batch_size_of, call_loss_fn, iter_tensors

__all__ = [
    "Interval",
    "StepTimer",
    "aggregate_rows",
    "gather_rows",
    "batch_counts",
    "count_flops",
    "peak_flops_per_s",
]


@dataclass(frozen=True)
class Interval:
    """Timings of the steps between two log boundaries (one rank)."""

    steps: int
    wall_s: float
    data_wait_s: float
    compute_s: float
    samples: int
    tokens: int

    @property
    def data_wait_share(self) -> float:
        return self.data_wait_s / self.wall_s if self.wall_s > 0 else 0.0


class StepTimer:
    """Splits wall time into data wait (previous ``step_end`` → ``batch_ready``) and compute.

    A ``batch_ready`` while a step is still open (micro-batches without a ``step_end`` between them)
    adds no wait: the time since the previous batch is compute, so waits are never over-counted.
    """

    __slots__ = ("_mark", "_begin", "_in_step", "_wait", "_compute", "_steps", "_samples", "_tokens")

    def __init__(self, now: float) -> None:
        self._mark = now
        self._begin = now
        self._in_step = False
        self._wait = self._compute = 0.0
        self._steps = self._samples = self._tokens = 0

    def batch_ready(self, now: float, samples: int = 0, tokens: int = 0) -> None:
        if not self._in_step:
            self._wait += now - self._mark
            self._mark = now
            self._in_step = True
        self._samples += samples
        self._tokens += tokens

    def step_end(self, now: float) -> None:
        self._compute += now - self._mark
        self._mark = now
        self._in_step = False
        self._steps += 1

    @property
    def steps(self) -> int:
        return self._steps

    def resume(self, now: float) -> None:
        """Leave the time since the last event out of the interval (the monitor's own logging work)."""
        if not self._in_step:
            self._begin += now - self._mark
            self._mark = now

    def hold(self) -> tuple[float, ...]:
        """The interval's figures as of the last event, for :meth:`drop_since`."""
        return (self._wait, self._compute, self._steps, self._samples, self._tokens, self._mark)

    def drop_since(self, held: tuple[float, ...], now: float) -> float:
        """Leave everything since ``held`` (a :meth:`hold` of this interval) out of it: its time, steps,
        samples and tokens (steps the profiler slowed). Returns the seconds left out."""
        wait, compute, steps, samples, tokens, mark = held
        self._wait, self._compute = wait, compute
        self._steps, self._samples, self._tokens = int(steps), int(samples), int(tokens)
        self._begin += now - mark
        self._mark = now
        self._in_step = False
        return now - mark

    def take(self, now: float) -> Interval:
        """The interval since the previous ``take`` (or the start); starts the next one at ``now``."""
        interval = Interval(
            self._steps, now - self._begin, self._wait, self._compute, self._samples, self._tokens
        )
        self._begin = now
        self._wait = self._compute = 0.0
        self._steps = self._samples = self._tokens = 0
        return interval


def batch_counts(batch: Any) -> tuple[int, int]:
    """``(samples, tokens)`` of a batch: the shared leading dimension, and the element count of the
    first 2-D integer tensor (token ids ``[batch, sequence]``); 0 where unknown.

    >>> batch_counts({"input_ids": torch.zeros(4, 16, dtype=torch.long), "y": torch.zeros(4)})
    (4, 64)
    """
    tensors = iter_tensors(batch)
    samples = batch_size_of(batch) or 0
    tokens = next(
        (t.numel() for t in tensors if t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool),
        0,
    )
    return samples, tokens


_PEAK_KEY = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}


def peak_flops_per_s(
    peak_tflops: Any, precision: str | None, float32_matmul_precision: str = "highest"
) -> float | None:
    """The device's dense peak FLOP/s for the precision's matmul dtype, ``None`` if the catalog lacks it.

    ``32-true`` uses TF32 when ``torch.get_float32_matmul_precision()`` allows it and the device has it.

    >>> peak_flops_per_s({"bf16": 312.0, "fp32": 19.5}, "bf16-mixed")
    312000000000000.0
    """
    peaks = dict(peak_tflops or {})
    key = _PEAK_KEY.get(precision or "32-true", "fp32")
    if key == "fp32" and float32_matmul_precision != "highest" and "tf32" in peaks:
        key = "tf32"
    value = peaks.get(key)
    return None if not value else float(value) * 1e12


def aggregate_rows(
    row: Sequence[float], device: torch.device | None = None
) -> tuple[list[float], list[float]]:
    """Mean and max of one row of metrics across the ranks, NaN (unknown) ignored.

    Without an initialised process group the row is returned as both. Otherwise every rank must call
    this with rows of the same length: a torchmetrics ``Metric`` whose state is concatenated across
    processes gathers them (one collective), and every rank gets the same result.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        values = [float(v) for v in row]
        return values, values
    rows = torch.tensor(gather_rows(row, device), dtype=torch.float64)
    known = ~torch.isnan(rows)
    counts = known.sum(0)
    sums = torch.where(known, rows, torch.zeros_like(rows)).sum(0)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, math.nan))
    maxes = torch.where(known, rows, torch.full_like(rows, -math.inf)).max(0).values
    maxes = torch.where(counts > 0, maxes, torch.full_like(maxes, math.nan))
    return means.tolist(), maxes.tolist()


def gather_rows(row: Sequence[float], device: torch.device | None = None) -> list[list[float]]:
    """Every rank's ``row``, in rank order (one collective; every rank gets them all).

    Without an initialised process group, ``[row]``. Every rank must call this with rows of the same
    length (``NaN`` for unknown).
    """
    import torch.distributed as dist

    values = [float(v) for v in row]
    if not (dist.is_available() and dist.is_initialized()):
        return [values]
    metric = _RowGather()
    if device is not None:
        metric = metric.to(device)
    metric.update(torch.tensor(values, dtype=torch.float64, device=device))
    rows: list[list[float]] = metric.compute().reshape(-1, len(values)).cpu().tolist()
    return rows


def _row_gather_class() -> type:
    from torchmetrics import Metric
    from torchmetrics.utilities import dim_zero_cat

    class RowGather(Metric):
        """Rows of interval metrics, one per rank, concatenated across processes on ``compute``."""

        full_state_update = False

        def __init__(self) -> None:
            super().__init__()
            self.add_state("rows", default=[], dist_reduce_fx="cat")

        def update(self, row: torch.Tensor) -> None:
            self.rows.append(row.reshape(1, -1))  # type: ignore[union-attr, attr-defined, operator]

        def compute(self) -> torch.Tensor:
            return dim_zero_cat(self.rows)  # type: ignore[attr-defined, arg-type]

    return RowGather


def _RowGather() -> Any:  # noqa: N802 - built lazily: importing torchmetrics costs ~1 s
    global _ROW_GATHER
    if _ROW_GATHER is None:
        _ROW_GATHER = _row_gather_class()
    return _ROW_GATHER()


_ROW_GATHER: type | None = None


def count_flops(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    remedy: str | None = "MFU will not be reported unless flops_per_step is given.",
) -> float | None:
    """FLOPs of one training step (forward + backward) counted on fake tensors, at no real cost.

    Uses ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention) over a copy
    of the model whose parameters are fake tensors; the model, batch and RNG are untouched. Returns
    ``None`` with a ``ResourceGuardWarning`` at the user's line when the step cannot be run on fake
    tensors; ``remedy`` ends it (a door that takes no ``flops_per_step`` passes its own, or ``None``).

    Example:
        >>> count_flops(torch.nn.Linear(4, 2), torch.randn(8, 4), lambda m, b: m(b).sum())
        256.0
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from resource_guard.estimate.trace.fake_world import fake_copy

    try:
        mode = FakeTensorMode(allow_non_fake_inputs=False)
        with mode:
            fake_model, fake_batch = fake_copy(model, batch)
            with FlopCounterMode(display=False) as counter:
                loss = call_loss_fn(fake_model, fake_batch, loss_fn)
                if loss.requires_grad:
                    loss.backward()
        return float(counter.get_total_flops())
    except Exception as exc:
        end = f"; {remedy}" if remedy else "; MFU will not be reported."
        warn_at_user(
            f"count_flops: the step could not be run on fake tensors ({type(exc).__name__}: {exc}){end}"
        )
        return None
