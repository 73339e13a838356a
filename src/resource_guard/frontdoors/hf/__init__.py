"""The Hugging Face ``Trainer`` door: ``plan_training_args`` and :class:`~.trainer.ResourceGuardCallback`.

- :mod:`.plan`: the plan made before the ``Trainer`` is built, from its ``TrainingArguments``;
- :mod:`.trainer`: the callback, translating the Trainer's events into the run's;
- :mod:`.step`: the Trainer's training step rebuilt, as the estimates trace it;
- :mod:`.runtime`: the run-time pieces (optimizer, loader and monitor settings of the Trainer);
- :mod:`.phases`: where each step's wall time goes under ``Trainer.train``.

The only modules of the package that import transformers.
"""

__all__: list[str] = []
