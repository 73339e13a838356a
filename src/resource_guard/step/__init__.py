"""Step: what both the estimator and the front doors need of one training step, and nothing else.

- :mod:`~resource_guard.step.precision`: Lightning's precision names, autocast and loss scaling.
- :mod:`~resource_guard.step.training`: the default loss, one training step (forward, loss, backward,
  optimizer step, ``zero_grad``), tensor walking over nested batches.
- :mod:`~resource_guard.step.batching`: slicing a batch into micro-batches, resizing it, divisors.

Imports only :mod:`resource_guard.errors`.
"""
