"""The guard's backward and optimizer step: loss weighting for accumulation, loss scaling, clipping,
``step`` and ``zero_grad`` when an effective batch is complete.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 1)
    >>> stepper = Stepper((torch.optim.SGD(model.parameters(), lr=0.1),), target=8)
    >>> stepper.backward(model(torch.randn(4, 4)).mean(), micro=4)  # half the effective batch
    False
    >>> stepper.backward(model(torch.randn(4, 4)).mean(), micro=4)
    True
    >>> stepper.optimizer_steps
    1
"""

from __future__ import annotations

import torch

from resource_guard.errors import ConfigurationError
from resource_guard.observe.phases import PhaseClock

__all__ = ["Stepper"]


class Stepper:
    """Backward of micro-batches and the optimizer step of each effective batch of ``target`` samples.

    Args:
        optimizers: the guard's optimizers (several: a GAN's loop, each backward names its own).
        target: samples per effective batch.
        scaler: the ``GradScaler`` of ``16-mixed``, else ``None``.
        clip: the gradient norm to clip to before each step, or ``None``.
    """

    def __init__(
        self,
        optimizers: tuple[torch.optim.Optimizer, ...],
        target: int,
        scaler: torch.amp.GradScaler | None = None,
        clip: float | None = None,
    ) -> None:
        self.optimizers, self.target, self.scaler, self.clip = optimizers, target, scaler, clip
        self.pending = 0  # samples accumulated since the last optimizer step
        self.optimizer_steps = 0
        self.clock: PhaseClock | None = None  # the monitor's phase clock: the step is "optimizer" time

    def backward(
        self, loss: torch.Tensor, micro: int, optimizer: torch.optim.Optimizer | None = None
    ) -> bool:
        """Backward of a micro-batch of ``micro`` samples; True when the optimizer stepped."""
        if len(self.optimizers) > 1 or (optimizer is not None and optimizer is not self.optimizers[0]):
            return self._backward_of(loss, optimizer)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigurationError(f"`g.backward(loss)` needs a scalar loss tensor, got {shape}.")
        size = micro or 1
        scaled = loss if size == self.target else loss * (size / self.target)  # x 1.0: no extra op
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        self.pending += size
        if self.pending >= self.target:
            self.step()
            return True
        return False

    def finish_partial_step(self) -> None:
        """The step of a partial effective batch, its gradients rescaled to that batch's mean."""
        factor = self.target / self.pending
        grads = [p.grad for g in self.optimizers[0].param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
        self.step()

    def _backward_of(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> bool:
        """``g.backward(loss, optimizer=opt)``: backward of the whole batch's loss, then ``opt``'s step."""
        if not any(optimizer is o for o in self.optimizers):
            raise ConfigurationError(
                f"`g.backward(loss, optimizer={type(optimizer).__name__ if optimizer else None})` must "
                f"name one of the guard's {len(self.optimizers)} optimizers."
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigurationError("`g.backward(loss, optimizer=...)` needs a scalar loss tensor.")
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self.step(optimizer, update=False)  # the scaler updates once per batch, in iterate
        return True

    def step(self, optimizer: torch.optim.Optimizer | None = None, update: bool = True) -> None:
        """Unscale and clip (when asked), step and zero ``optimizer`` (default: the first)."""
        optimizer = optimizer if optimizer is not None else self.optimizers[0]
        if self.clock is not None:
            self.clock.switch("optimizer")  # back to "host" when g.backward returns
        if self.scaler is not None:
            if self.clip is not None:
                self.scaler.unscale_(optimizer)
                self._clip_grads(optimizer)
            self.scaler.step(optimizer)
            if update:
                self.scaler.update()
        else:
            if self.clip is not None:
                self._clip_grads(optimizer)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.pending = 0
        self.optimizer_steps += 1

    def _clip_grads(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.clip is not None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, self.clip)
