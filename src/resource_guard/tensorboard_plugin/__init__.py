"""The Resource Guard tab of TensorBoard (``tensorboard --logdir DIR``, tab "Resource Guard"): the
bottleneck report, step time by phase, memory against the plan's capacity, the plan, and two runs
compared, read from what each run wrote in its log dir.

:mod:`~resource_guard.tensorboard_plugin.views` and :mod:`~resource_guard.tensorboard_plugin.compare`
are plain functions of a run's files; :mod:`~resource_guard.tensorboard_plugin.plugin` serves them
(imported by TensorBoard through the ``tensorboard_plugins`` entry point).
"""

from resource_guard.tensorboard_plugin.compare import compare_reports, compare_text
from resource_guard.tensorboard_plugin.runs import RunFiles, find_runs, load_events
from resource_guard.tensorboard_plugin.views import memory, overview, plan, ranked_findings, step_time

__all__ = [
    "RunFiles",
    "compare_reports",
    "compare_text",
    "find_runs",
    "load_events",
    "memory",
    "overview",
    "plan",
    "ranked_findings",
    "step_time",
]
