"""The two front doors over the core: :func:`guard` (plain PyTorch) and ``ResourceGuard`` (Lightning).

- :mod:`~resource_guard.frontdoors.context`: the :class:`Guard` context manager.
- :mod:`~resource_guard.frontdoors.lightning_callback`: the Lightning callback (with its helpers the
  only modules that import Lightning: :mod:`~resource_guard.frontdoors.lightning_apply` isolates its
  private attributes, :mod:`~resource_guard.frontdoors.lightning_eval` pre-flights validation, test
  and predict, :mod:`~resource_guard.frontdoors.lightning_eval_split` runs an evaluation loader whose
  batches do not fit as micro-batches, :mod:`~resource_guard.frontdoors.lightning_shapes` stops before
  a batch that would not fit).
- :mod:`~resource_guard.frontdoors.hf_plan` and :mod:`~resource_guard.frontdoors.hf_trainer`: the Hugging
  Face ``Trainer`` door (``plan_training_args``, ``ResourceGuardCallback``; the only modules that import
  transformers, with :mod:`~resource_guard.frontdoors.hf_step`, the Trainer's step rebuilt).
- :mod:`~resource_guard.frontdoors.eval_preflight`: an evaluation loop's step against the usable
  memory, shared by both front doors.
- :mod:`~resource_guard.frontdoors.shape_guard`: each batch's shape checked against the plan before it
  runs, for both front doors.

Thin: they plan, apply the plan and run the monitor; the decisions live in the layers below.
"""
