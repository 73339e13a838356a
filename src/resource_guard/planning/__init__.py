"""Planning: choose device, precision, checkpointing, micro-batch × accumulation and strategy from estimates.

- :mod:`~resource_guard.planning.planner`: :func:`plan` and :class:`Plan` (the rules, each with its reason).
- :mod:`~resource_guard.planning.search`: cached traces, the micro-batch search, the alternatives table.
- :mod:`~resource_guard.planning.strategy`: per-rank memory of DDP and FSDP.
- :mod:`~resource_guard.planning.checkpointing`: switching activation checkpointing on and off.
- :mod:`~resource_guard.planning.nofit`: the reasons, and the report when nothing fits.
- :mod:`~resource_guard.planning.shapes`: the step's memory for every batch shape of a run (a cache,
  a fitted :mod:`~resource_guard.planning.surface`, traces); batch signatures and the run's longest
  sequence in :mod:`~resource_guard.planning.worst_case`.

Imports :mod:`resource_guard.estimate` and below. (Named ``planning``, not ``plan``, so the package
never hides the public function :func:`resource_guard.plan`.)
"""
