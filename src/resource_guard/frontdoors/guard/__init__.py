"""The parts of the plain-PyTorch front door that :class:`~resource_guard.frontdoors.guard.context.Guard`
loops over: argument checks (:mod:`.args`), the first batch planned and applied (:mod:`.first_batch`,
over :mod:`.setup`), the batch loop's splitting and device moves (:mod:`.batches`), the backward and
optimizer stepper (:mod:`.stepper`), evaluation (:mod:`.evaluation`) and the run's summary
(:mod:`.summary`). A loop left as written is the zero-change door (:mod:`.unchanged`, translating the
events of :mod:`.observed`'s hooks and :mod:`.recorded`'s recorded step into the run's).

The entry point stays :mod:`resource_guard.frontdoors.guard.context` (``guard``, ``Guard``).
"""

__all__: list[str] = []
