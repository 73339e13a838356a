"""The parts of the plain-PyTorch front door that :class:`~resource_guard.frontdoors.guard.context.Guard`
loops over: argument checks (:mod:`.args`), planning and set-up (:mod:`.setup`), the batch loop's
splitting and device moves (:mod:`.batches`), the backward and optimizer stepper (:mod:`.stepper`),
evaluation (:mod:`.evaluation`) and the run's summary (:mod:`.summary`).

The entry point stays :mod:`resource_guard.frontdoors.guard.context` (``guard``, ``Guard``).
"""

__all__: list[str] = []
