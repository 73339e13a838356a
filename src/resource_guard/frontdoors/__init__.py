"""The front doors over the core, one package per framework, each a translator of its framework's
events into one run's.

- :mod:`~resource_guard.frontdoors.guard`: plain PyTorch, the :func:`guard` context manager
  (:mod:`~resource_guard.frontdoors.guard.context`) over its parts, and the zero-change observation of
  an unchanged loop (:mod:`~resource_guard.frontdoors.guard.observed`,
  :mod:`~resource_guard.frontdoors.guard.recorded`).
- :mod:`~resource_guard.frontdoors.lightning`: the Lightning ``ResourceGuard`` callback and what only
  Lightning needs (re-batching, evaluation loops, manual optimization, its internals).
- :mod:`~resource_guard.frontdoors.hf`: the Hugging Face ``Trainer`` door (``plan_training_args``,
  ``ResourceGuardCallback``, the Trainer's step rebuilt).
- Shared by the doors: :mod:`~resource_guard.frontdoors.eval_preflight` (an evaluation loop's step
  against the usable memory), :mod:`~resource_guard.frontdoors.shape_guard` (each batch's shape checked
  against the plan before it runs) and :mod:`~resource_guard.frontdoors.vocabulary` (one argument
  vocabulary).

Thin: they plan, apply the plan and run the monitor; the decisions live in the layers below.
"""
