"""The Lightning door: :class:`~.callback.ResourceGuard` and what only Lightning needs.

- :mod:`.callback`: the callback, translating Lightning's hooks into the run's events;
- :mod:`.apply`: what the user fixed, one real batch, the plan applied to the ``Trainer``;
- :mod:`.rebatch`: the train loader re-batched into the plan's micro-batches;
- :mod:`.eval` and :mod:`.eval_split`: validation, test and predict pre-flighted, and an evaluation
  loader whose batches do not fit run as micro-batches that do;
- :mod:`.manual`: the optimizers of ``configure_optimizers`` and manual optimization;
- :mod:`.phases`: where each step's wall time goes under ``Trainer.fit``;
- :mod:`.shapes`: the shape guard in a Lightning run;
- :mod:`.hooks`: the user's step hooks called as Lightning's loops call them;
- :mod:`.internals`: every Lightning private the door relies on, one small function each.

With :mod:`resource_guard.frontdoors.hf`, the only modules of the package that import Lightning.
"""

__all__: list[str] = []
