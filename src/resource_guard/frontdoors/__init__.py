"""The two front doors over the core: :func:`guard` (plain PyTorch) and ``ResourceGuard`` (Lightning).

- :mod:`~resource_guard.frontdoors.context`: the :class:`Guard` context manager.
- :mod:`~resource_guard.frontdoors.lightning_callback`: the Lightning callback (with
  :mod:`~resource_guard.frontdoors.lightning_apply`, which isolates Lightning's private attributes, and
  :mod:`~resource_guard.frontdoors.lightning_shapes`, the only modules that import Lightning).
- :mod:`~resource_guard.frontdoors.shape_guard`: each batch's shape checked against the plan before it
  runs, for both front doors.

Thin: they plan, apply the plan and run the monitor; the decisions live in the layers below.
"""
