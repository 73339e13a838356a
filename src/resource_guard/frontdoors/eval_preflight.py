"""The pre-flight of an evaluation loop, shared by both front doors: does its step fit beside what the
run holds, and if not, which evaluation batch size would.

:func:`preflight_eval` traces one evaluation step on the loop's own first batch
(:func:`~resource_guard.estimate.eval_step.estimate_eval_memory`: eval mode, ``no_grad``, over the
parameters, the optimizer state and the gradients the run holds then), sets it against the device's
usable memory (the capacity less the headroom, as the training plan is held to), and raises
:class:`~resource_guard.errors.DoesNotFitError` before any evaluation step when it does not fit. The
error names the loop, its batch size, the predicted peak against the usable memory, and the remedy:
the largest evaluation batch size that fits, found by a few more traces (the peak is near-linear in
the batch: traced at 1 and at the loop's size, interpolated, then verified).

Example:
    >>> import torch
    >>> from resource_guard.devices import resolve_device
    >>> model = torch.nn.Linear(256, 256)
    >>> cpu = resolve_device("cpu").with_memory(2**20)
    >>> check = preflight_eval(model, torch.randn(64, 256), loop="validation", device=cpu)
    >>> check.fits, check.batch_size
    (True, 64)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from resource_guard.devices import DeviceSpec
from resource_guard.errors import DoesNotFitError, warn_at_user
from resource_guard.estimate import DeviceFit, MemoryEstimate
from resource_guard.estimate.eval_step import estimate_eval_memory
from resource_guard.step.batching import resize_batch
from resource_guard.step.training import LossFn, OptimizerArg, batch_size_of, iter_tensors

__all__ = ["EvalCheck", "EvalPreflights", "preflight_eval"]

_MiB = 2**20
_SEARCH_TRACES = 4  # at most this many traces beyond the loop's own, to name the largest batch that fits


@dataclass(frozen=True)
class EvalCheck:
    """The pre-flight of one evaluation loop's step.

    Attributes:
        loop: ``"validation"``, ``"test"`` or ``"evaluate"`` (a ``guard``'s), with the dataloader's
            index when there are several (``"validation (dataloader 1)"``).
        batch_size: the loop's batch size (its first batch's), ``None`` when it cannot be told.
        estimate: the evaluation step's estimate on that batch.
        fit: what the device would show for it (``device_total_bytes`` against ``usable_bytes``).
        largest_fitting_batch_size: when it does not fit, the largest batch size that does (0: not even
            one sample), else ``None``.
    """

    loop: str
    batch_size: int | None
    estimate: MemoryEstimate = field(repr=False)
    fit: DeviceFit = field(repr=False)
    largest_fitting_batch_size: int | None = None

    @property
    def fits(self) -> bool:
        """The predicted peak is within the usable memory (the capacity less the headroom)."""
        return self.fit.fits

    @property
    def predicted_peak_bytes(self) -> int:
        return self.fit.device_total_bytes

    @property
    def usable_bytes(self) -> int:
        return self.fit.usable_bytes

    def line(self) -> str:
        """One line for a plan's reasons and the report."""
        resident = self.estimate.assumed_target.rpartition(" over ")[2] or "parameters"
        return (
            f"{self.loop} step, batch size {self.batch_size} (eval mode, no_grad, beside the {resident}): "
            f"predicted peak {self.predicted_peak_bytes / _MiB:,.1f} MiB of {self.usable_bytes / _MiB:,.1f} "
            f"MiB usable on {self.fit.device.name}; " + ("fits" if self.fits else "does not fit")
        )

    def message(self) -> str:
        """Why it does not fit, and the remedy."""
        est = self.estimate
        parts = ", ".join(f"{k} {v / _MiB:,.1f} MiB" for k, v in est.breakdown.items() if v)
        head = (
            f"the {self.loop} step does not fit: batch size {self.batch_size} needs a predicted peak of "
            f"{self.predicted_peak_bytes / _MiB:,.1f} MiB, {self.usable_bytes / _MiB:,.1f} MiB usable on "
            f"{self.fit.device.name} (capacity {self.fit.capacity_bytes / _MiB:,.1f} MiB less the headroom); "
            f"at the peak: {parts}."
        )
        largest = self.largest_fitting_batch_size
        if largest:
            remedy = (
                f" The largest {self.loop} batch size that fits is {largest}: give the evaluation "
                f"DataLoader `batch_size={largest}` or less."
            )
        elif largest == 0:
            resident = sum(est.breakdown[k] for k in ("parameters", "gradients", "optimizer_state", "other"))
            remedy = (
                f" Not even batch size 1 fits: what the run holds ({resident / _MiB:,.1f} MiB of "
                "parameters, buffers, optimizer state and gradients) leaves too little; use a device with "
                "more memory or a smaller model."
            )
        else:
            remedy = " Use a smaller evaluation batch size."
        return head + remedy

    def to_dict(self) -> dict[str, Any]:
        return {
            "loop": self.loop,
            "batch_size": self.batch_size,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "usable_bytes": self.usable_bytes,
            "capacity_bytes": self.fit.capacity_bytes,
            "fits": self.fits,
            "largest_fitting_batch_size": self.largest_fitting_batch_size,
            "estimate": self.estimate.to_dict(),
        }


def preflight_eval(
    model: Any,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    loop: str,
    device: DeviceSpec,
    optimizer: OptimizerArg | None = None,
    gradients_kept: bool | None = None,
    precision: str = "32-true",
    headroom: float = 0.1,
    raise_if_not_fits: bool = True,
) -> EvalCheck:
    """Pre-flight one evaluation step of ``loop`` on ``batch`` against ``device`` (capped as planned).

    ``optimizer``, ``gradients_kept`` and ``precision`` are as for
    :func:`~resource_guard.estimate.eval_step.estimate_eval_memory`.

    Raises:
        DoesNotFitError: the step does not fit (``raise_if_not_fits``); ``err.report`` is the
            :class:`EvalCheck`, with the largest batch size that fits.
    """

    def check(b: Any) -> tuple[MemoryEstimate, DeviceFit]:
        est = estimate_eval_memory(
            model,
            b,
            loss_fn,
            optimizer=optimizer,
            gradients_kept=gradients_kept,
            precision=precision,
            device=device,
        )
        return est, est.for_device(device, headroom=headroom)

    est, fit = check(batch)
    size = batch_size_of(batch)
    found = EvalCheck(loop, size, est, fit)
    if fit.fits:
        return found
    largest = _largest_fitting(check, batch, size, fit) if size else None
    found = EvalCheck(loop, size, est, fit, largest)
    if raise_if_not_fits:
        raise DoesNotFitError(found.message(), found)
    return found


def _largest_fitting(check: Any, batch: Any, size: int, fit: DeviceFit) -> int | None:
    """The largest batch size below ``size`` whose step fits, by interpolation and verification."""
    if size <= 1:
        return 0
    one = check(resize_batch(batch, 1))[1]
    if not one.fits:
        return 0
    low, high = 1, size  # low fits, high does not
    low_bytes, high_bytes = one.device_total_bytes, fit.device_total_bytes
    for _ in range(_SEARCH_TRACES - 1):
        if high - low <= 1:
            break
        slope = (high_bytes - low_bytes) / (high - low)
        guess = low + int((one.usable_bytes - low_bytes) / slope) if slope > 0 else high - 1
        guess = min(max(guess, low + 1), high - 1)
        tried = check(resize_batch(batch, guess))[1]
        if tried.fits:
            low, low_bytes = guess, tried.device_total_bytes
        else:
            high, high_bytes = guess, tried.device_total_bytes
    return low


class EvalPreflights:
    """A front door's evaluation pre-flights: each loop's first batch, once per batch shapes and
    residency (optimizer state present, gradients held), so an evaluation run every epoch is traced
    again only when what it runs beside has changed.

    A :class:`~resource_guard.errors.DoesNotFitError` is raised; any other failure of the pre-flight is
    one warning, and the evaluation runs unchecked (our pre-flight never stops the user's loop).
    """

    def __init__(self) -> None:
        self.checks: list[EvalCheck] = []
        self._seen: dict[Any, EvalCheck] = {}

    def check(
        self,
        model: torch.nn.Module,
        batch: Any,
        loss_fn: LossFn | None,
        *,
        again: bool = False,
        **kwargs: Any,
    ) -> EvalCheck | None:
        """:func:`preflight_eval` with ``kwargs``; ``None`` when not checkable, or when already checked
        (then the earlier check where ``again``)."""
        optimizer = kwargs.get("optimizer")
        shapes = tuple((tuple(t.shape), t.dtype) for t in iter_tensors(batch))
        grads = sum(p.grad is not None for p in model.parameters())
        key = (kwargs.get("loop"), shapes, optimizer is not None, kwargs.get("gradients_kept"), grads)
        if key in self._seen:
            return self._seen[key] if again else None
        try:
            found = preflight_eval(model, batch, loss_fn, **kwargs)
        except DoesNotFitError:
            raise
        except Exception as error:
            loop = kwargs.get("loop", "evaluation")
            warn_at_user(f"resource_guard: the {loop} step was not pre-flighted: {error!r}")
            return None
        self._seen[key] = found
        self.checks.append(found)
        return found
