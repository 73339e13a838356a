"""Report: measured facts of a run → findings with advice → markdown, JSON and TensorBoard.

- :mod:`~resource_guard.report.types`: :class:`RunStats`, :class:`ProfileSummary`, :class:`Finding`.
- :mod:`~resource_guard.report.rules`: one pure function per finding, thresholds documented.
- :mod:`~resource_guard.report.findings`: :func:`analyze`, :class:`Report`, ``resource-guard report``.
- :mod:`~resource_guard.report.markdown`: ``report.md`` and the TensorBoard text.
- :mod:`~resource_guard.report.tensorboard`: the TensorBoard writer and the memory picture.

Knows nothing of how the facts were measured; imports :mod:`resource_guard.estimate` and below.
"""
