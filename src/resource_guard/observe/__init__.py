"""Observe: what a running training loop does — sampled, timed and profiled without slowing it down.

- :mod:`~resource_guard.observe.monitor`: :class:`RunMonitor`, which ties the parts together;
  :mod:`~resource_guard.observe.outputs` records intervals and writes the files at close.
- :mod:`~resource_guard.observe.sampler`: the background thread (NVML, psutil).
- :mod:`~resource_guard.observe.throughput`: per-step timers, samples/tokens per second, MFU.
- :mod:`~resource_guard.observe.stats`: interval rows → :class:`~resource_guard.report.types.RunStats`.
- :mod:`~resource_guard.observe.growth`: allocated memory at step ends by batch signature, its trend.
- :mod:`~resource_guard.observe.profiling`: the bounded torch.profiler window;
  :mod:`~resource_guard.observe.profile_events` reads its events into records.
- :mod:`~resource_guard.observe.picture`: the memory picture, drawn on a thread during the first step.
- :mod:`~resource_guard.observe.oom`: out-of-memory capture.

Imports :mod:`resource_guard.report` and below; never the front doors.
"""
