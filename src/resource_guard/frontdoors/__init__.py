"""The two front doors over the core: :func:`guard` (plain PyTorch) and ``ResourceGuard`` (Lightning).

- :mod:`~resource_guard.frontdoors.context`: the :class:`Guard` context manager.
- :mod:`~resource_guard.frontdoors.lightning_callback`: the Lightning callback (the only module that
  imports Lightning; :mod:`~resource_guard.frontdoors.lightning_apply` isolates its private attributes).

Thin: they plan, apply the plan and run the monitor; the decisions live in the layers below.
"""
