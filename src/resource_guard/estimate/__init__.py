"""Estimate: the memory of one full training step, traced on fake tensors, and what a device would show.

The estimators, on top:

- :mod:`~resource_guard.estimate.estimator`: :func:`estimate_memory` (checks, trace, fallback).
- :mod:`~resource_guard.estimate.eval_step`: :func:`estimate_eval_memory`, one evaluation step (eval
  mode, ``no_grad``) over what the run holds, and its real CPU peak.
- :mod:`~resource_guard.estimate.user_step`: a step the user writes (several optimizers, backward and
  ``step`` by hand: a GAN's, manual optimization) as :class:`UserStep`, and its real CPU measurement.
- :mod:`~resource_guard.estimate.blocks`: deep models traced at two depths and extrapolated per block.
- :mod:`~resource_guard.estimate.analytic`: the upper bound when a step cannot be traced.
- :mod:`~resource_guard.estimate.result`: :class:`MemoryEstimate`, the result type.

Their floors, each importing only from the ones below it (``tests/test_layers.py``):

- :mod:`~resource_guard.estimate.fsdp`: FSDP's precision policies and per-rank arithmetic (also the
  planner's), and FSDP2 (``fully_shard``) modules estimated per rank from their DTensors and units.
- :mod:`~resource_guard.estimate.allocation`: the CUDA caching allocator, context and workspaces
  (:class:`DeviceFit`), and the later micro-step that starts with its gradients allocated.
- :mod:`~resource_guard.estimate.host`: the host CPU's truth: the real peak of a CPU step
  (:func:`measure_training_step`), real-kernel scratch probes (oneDNN, CPU flash attention), what
  this CPU can run, torch's native log lines kept off the console.
- :mod:`~resource_guard.estimate.trace`: the model, optimizer and batch copied onto fake tensors,
  live-storage accounting by category, in-place and composite operators, per-operator recovery.
- :mod:`~resource_guard.estimate.emulate`: the target's behaviour over CPU fake tensors: CUDA's
  autocast op policy, the autocast regions a model opens, the attention kernel the target picks.

Imports :mod:`resource_guard.step` and :mod:`resource_guard.devices`, nothing above.
"""

from resource_guard.estimate.allocation.allocator import DeviceFit, device_fit
from resource_guard.estimate.estimator import estimate_memory
from resource_guard.estimate.eval_step import estimate_eval_memory, measure_eval_step
from resource_guard.estimate.host.measure import MeasuredStep, measure_training_step
from resource_guard.estimate.result import MemoryEstimate
from resource_guard.estimate.trace.tracer import CATEGORIES
from resource_guard.estimate.user_step import StepContext, UserStep, measure_user_step
from resource_guard.step.training import OptimizerArg

__all__ = [
    "CATEGORIES",
    "DeviceFit",
    "MeasuredStep",
    "MemoryEstimate",
    "OptimizerArg",
    "StepContext",
    "UserStep",
    "device_fit",
    "estimate_eval_memory",
    "estimate_memory",
    "measure_eval_step",
    "measure_training_step",
    "measure_user_step",
]
