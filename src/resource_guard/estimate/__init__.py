"""Estimate: the memory of one full training step, traced on fake tensors, and what a device would show.

- :mod:`~resource_guard.estimate.estimator`: :func:`estimate_memory` (checks, trace, fallback).
- :mod:`~resource_guard.estimate.result`: :class:`MemoryEstimate`, the result type.
- :mod:`~resource_guard.estimate.tracer`: live-storage accounting by category, shadow values.
- :mod:`~resource_guard.estimate.fake_world`: the model/optimizer/batch copied onto fake tensors,
  the target's optimizer code paths and attention kernel, isolated global state.
- :mod:`~resource_guard.estimate.cuda_autocast`, :mod:`~resource_guard.estimate.autocast_regions`: CUDA
  autocast emulated on CPU fake tensors, and the autocast regions a model opens, as a GPU honours them.
- :mod:`~resource_guard.estimate.kernels`: real-kernel scratch (oneDNN, CPU flash attention) probes.
- :mod:`~resource_guard.estimate.cpu_support`: what this CPU can run (tiny real probes, cached).
- :mod:`~resource_guard.estimate.quiet`: torch's native log lines and fake-tensor logs kept off the console.
- :mod:`~resource_guard.estimate.fsdp2`, :mod:`~resource_guard.estimate.fsdp2_step`: FSDP2
  (``fully_shard``) modules, estimated per rank from their DTensors and units.
- :mod:`~resource_guard.estimate.sharding`: FSDP's precision policies and per-rank arithmetic (also
  the planner's).
- :mod:`~resource_guard.estimate.analytic`: the fallback when a step cannot be traced.
- :mod:`~resource_guard.estimate.allocator`: the CUDA caching allocator, context and workspaces
  (:class:`DeviceFit`).
- :mod:`~resource_guard.estimate.measure`: the real peak of a CPU step (the ground truth).
- :mod:`~resource_guard.estimate.eval_step`: :func:`estimate_eval_memory`, one evaluation step (eval
  mode, ``no_grad``) over what the run holds, and its real CPU peak.
- :mod:`~resource_guard.estimate.user_step`: a step the user writes (several optimizers, backward and
  ``step`` by hand: a GAN's, manual optimization) as :class:`UserStep`, and its real CPU measurement.

Imports :mod:`resource_guard.step` and :mod:`resource_guard.devices`, nothing above.
"""

from resource_guard.estimate.allocator import DeviceFit, device_fit
from resource_guard.estimate.estimator import estimate_memory
from resource_guard.estimate.eval_step import estimate_eval_memory, measure_eval_step
from resource_guard.estimate.measure import MeasuredStep, measure_training_step
from resource_guard.estimate.result import MemoryEstimate
from resource_guard.estimate.tracer import CATEGORIES
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
