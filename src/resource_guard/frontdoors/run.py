"""One run's life, whichever door it came through: the pre-flight agreed across ranks, the monitor
started from the plan, fed the run's events, and closed into the report — also on a crash.

Each door translates its framework's events into these (``guard``'s batch loop or the hooks of an
unchanged loop, Lightning's callback hooks, the ``Trainer``'s callback events); what is the same in
every door lives here, once, and imports no framework:

- :func:`agree`: every rank's pre-flight outcome in one collective. When any rank failed, every rank
  raises the same error (the lowest failing rank's message and report); else the most conservative
  rank's figures win. The collective is ``torch.distributed``'s (:class:`TorchDistributed`) or the
  framework's own (Lightning's strategy), behind :class:`Collective`.
- :func:`new_monitor`: the :class:`~resource_guard.observe.monitor.RunMonitor` of a plan: its estimate,
  the capacity the measured peak is held against and the one the plan fitted, the device's facts.
- :class:`Run`: the monitor from its start to its report: notes kept until it starts, every call to it
  guarded (a failure in monitoring never stops training), the door's phase hooks removed and the
  report written once at the end, by the door's end event, its exception event, or the interpreter's
  exit when the framework ended without one.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from resource_guard.errors import (
    ConfigurationError,
    DoesNotFitError,
    PredictedOutOfMemoryError,
    ResourceGuardError,
    warn_at_user,
)

if TYPE_CHECKING:
    from resource_guard.observe.monitor import RunMonitor
    from resource_guard.planning.planner import Plan

__all__ = ["Agreed", "Collective", "Run", "RunEndedEarly", "TorchDistributed", "agree", "new_monitor"]

# what a rank's pre-flight ended with, as one integer of the agreement's row
_OK, _DOES_NOT_FIT, _PREDICTED_OOM, _CONFIG, _OTHER = range(5)
_KINDS: dict[int, Callable[[str, Any], BaseException]] = {
    _DOES_NOT_FIT: lambda message, report: DoesNotFitError(message, report),
    _PREDICTED_OOM: lambda message, report: PredictedOutOfMemoryError(message, report),
    _CONFIG: lambda message, report: ConfigurationError(message),
    _OTHER: lambda message, report: ResourceGuardError(message),
}


class Collective(Protocol):
    """The two collectives the agreement needs, over every rank of the run."""

    rank: int
    world_size: int

    def all_gather(self, row: list[int]) -> list[list[int]]:
        """Every rank's ``row`` (same length on each), in rank order."""
        ...

    def broadcast(self, payload: bytes | None, src: int) -> bytes | None:
        """Rank ``src``'s ``payload`` on every rank."""
        ...


class TorchDistributed:
    """:class:`Collective` over ``torch.distributed``'s default group; one process without one."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._on else 0
        self.world_size = dist.get_world_size() if self._on else 1

    def all_gather(self, row: list[int]) -> list[list[int]]:
        if self.world_size == 1:
            return [list(row)]
        import torch.distributed as dist

        rows: list[Any] = [None] * self.world_size
        dist.all_gather_object(rows, list(row))
        return [list(r) for r in rows]

    def broadcast(self, payload: bytes | None, src: int) -> bytes | None:
        if self.world_size == 1:
            return payload
        import torch.distributed as dist

        box = [payload]
        dist.broadcast_object_list(box, src=src)
        return box[0]


@dataclasses.dataclass(frozen=True)
class Agreed:
    """The agreement: the chosen rank's ``row`` (``None`` on an error), the ``error`` every rank raises
    (``None`` when all succeeded) and the rank either came from."""

    row: tuple[int, ...] | None
    error: BaseException | None
    source_rank: int


def _kind(error: BaseException) -> int:
    if isinstance(error, PredictedOutOfMemoryError):
        return _PREDICTED_OOM
    if isinstance(error, DoesNotFitError):
        return _DOES_NOT_FIT
    if isinstance(error, ConfigurationError):
        return _CONFIG
    return _OTHER


def agree(
    row: Sequence[int],
    error: BaseException | None,
    collective: Collective | None = None,
    *,
    key: Callable[[Sequence[int]], Any] = tuple,
) -> Agreed:
    """Agree on one pre-flight outcome across ranks: a collective every rank must reach, also after its
    own pre-flight failed (``error``). ``row``: this rank's figures (integers, the same length on every
    rank; ignored on an error).

    When a rank failed, every rank gets an error of its kind (does not fit, predicted out of memory,
    configuration, other) with its message and report, from the lowest failing rank — a rank whose
    batch is only predicted to run out of memory gives way to any other failure, so that a retry with a
    smaller batch is not asked for a run that cannot start. With one process the error is returned as
    raised. Else the row with the smallest ``key`` wins (then the lowest rank): each door's most
    conservative plan.
    """
    comm = collective if collective is not None else TorchDistributed()
    mine = [_OK if error is None else _kind(error), *row]
    rows = comm.all_gather(mine)
    failing = sorted(
        (r for r, values in enumerate(rows) if values[0] != _OK),
        key=lambda r: (rows[r][0] == _PREDICTED_OOM, r),
    )
    if failing and len(rows) == 1 and error is not None:
        return Agreed(None, error, 0)  # one process: the error as raised, with its own traceback
    if failing:
        src = failing[0]
        payload: bytes | None = None
        if comm.rank == src:
            assert error is not None
            report = getattr(error, "report", None)
            try:
                payload = pickle.dumps((str(error), report))
            except Exception:  # an unpicklable report: the message alone
                payload = pickle.dumps((str(error), None))
        received = comm.broadcast(payload, src)
        message, report = pickle.loads(received) if received is not None else ("pre-flight failed", None)
        shared = _KINDS[rows[src][0]](
            f"pre-flight failed on rank {src} (every rank stops): {message}", report
        )
        if comm.rank == src:
            shared.__cause__ = error
        return Agreed(None, shared, src)
    best = min(range(len(rows)), key=lambda r: (key(rows[r][1:]), r))
    return Agreed(tuple(rows[best][1:]), None, best)


def host_ram_bytes() -> int:
    from resource_guard.devices import resolve_device

    return resolve_device("cpu").memory_bytes


def new_monitor(
    plan: Plan | None,
    device: torch.device,
    log_dir: str | os.PathLike[str] | None,
    **settings: Any,
) -> RunMonitor:
    """The run monitor of ``plan`` on ``device`` (not started), timing phases at the door's boundaries.

    From the plan: the estimate, the capacity it fitted the step into (the memory picture's line), and
    the device's catalog facts when the plan was made for the device the run runs on. The measured peak
    is held against the plan's capacity on a GPU; on the CPU the monitor measures the process's RSS
    (interpreter and libraries included), which a ``memory_limit`` on tensor bytes is no fair yardstick
    for: the host's RAM is. ``settings``: the rest of :class:`~resource_guard.RunMonitor`'s arguments.
    """
    from resource_guard.observe.monitor import RunMonitor

    from_plan: dict[str, Any] = {}
    if plan is not None:
        from_plan = {
            "estimate": plan.estimate,
            "capacity_bytes": plan.fit.capacity_bytes,
            "planned_capacity_bytes": plan.fit.capacity_bytes,
            "planned_fit": plan.fit,  # one memory story: the plan's capacity, usable line and predicted peak
            "device_spec": plan.device if plan.device.source == "detected" else None,
        }
    if device.type == "cpu":  # the process's RSS is held against the host's RAM, never a tensor cap
        from_plan["capacity_bytes"] = host_ram_bytes()
    return RunMonitor(log_dir, device=device, phase_timing=True, **from_plan, **settings)


class RunEndedEarly(RuntimeError):
    """The run ended without the framework's end event: the error the report is closed with."""


class Run:
    """One run's monitor from its start to its report, for a door named ``door`` (in its warnings)."""

    def __init__(self, door: str) -> None:
        self.door = door
        self.monitor: RunMonitor | None = None
        self.report: Any = None
        self.phases: Any = None  # the door's phase hooks (``remove()``), switching the monitor's clock
        self._notes: list[str] = []  # lines for the report, kept until the monitor starts
        self._errors_before: Any = None  # sys.last_value when the monitor started: an older error
        self.closing: list[Callable[[], Any]] = []  # closed after the monitor (a writer the door made)

    def preflight(
        self,
        preflight: Callable[[], Sequence[int]],
        width: int,
        collective: Collective | None = None,
        *,
        key: Callable[[Sequence[int]], Any] = tuple,
    ) -> Agreed:
        """This rank's ``preflight()`` (its row of ``width`` integers), then the agreement every rank
        reaches also after its own pre-flight failed (:func:`agree`): the door raises ``error`` or
        applies ``row``."""
        try:
            row, error = list(preflight()), None
        except Exception as failure:  # every rank must reach the agreement, also after an error
            row, error = [0] * width, failure
        return agree(row, error, collective, key=key)

    def start(
        self,
        monitor: Callable[[], RunMonitor],
        plan: Plan | None,
        *,
        shapes: Any = None,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        total_steps: int | None = None,
        notes: Iterable[str] = (),
        close_at_exit: bool = False,
    ) -> RunMonitor | None:
        """Build (``monitor()``) and start the run's monitor: the shape guard's figures, the plan's rows
        (the advice quotes the configuration it recommends), the optimizers (their update's cost), the
        steps to come (the ETA) and ``notes`` into its report. ``None`` (one warning) when it cannot
        start; a log dir that cannot be written raises. ``close_at_exit``: a framework that can end a
        run without an end event (an error it does not report) closes it at the interpreter's exit."""
        self.report = None
        try:
            built = monitor()
            built.shape_stats = shapes.stats if shapes is not None else None
            if plan is not None:
                from resource_guard.report.plan_advice import plan_rows

                built.plan_rows = plan_rows(plan)
            built.optimizers = tuple(optimizers)
            built.total_steps = total_steps
            for line in (*notes, *self._notes):
                built.note(line)
            self._notes.clear()
            built.start()
        except ConfigurationError:
            raise
        except Exception as error:
            warn_at_user(f"{self.door}: monitoring is off for this run: {error!r}")
            return None
        self.monitor = built
        if close_at_exit:
            self._errors_before = getattr(sys, "last_value", None)
            atexit.register(self._close_at_exit)
        return built

    def call(self, name: str, *args: Any) -> None:
        """``monitor.<name>(*args)``; on a failure one warning and no monitor from then on."""
        if self.monitor is None:
            return
        try:
            getattr(self.monitor, name)(*args)
        except Exception as error:  # a failure in our monitoring never stops training
            warn_at_user(f"{self.door}: monitoring stopped: {error!r}")
            self.monitor = None

    def phase(self, event: str, *args: Any) -> None:
        """The door's phase hooks told of ``event`` (``phases.<event>(*args)``), when they run."""
        if self.phases is not None:
            getattr(self.phases, event)(*args)

    def note(self, line: str) -> None:
        """A line for the report: now, or when the monitor starts."""
        if self.monitor is None:
            self._notes.append(line)
        else:
            self.call("note", line)

    def ended_early(self, why: str) -> BaseException:
        """The error that ended the run: the one Python kept as uncaught since the monitor started (a
        script's, at exit; a notebook's), else a :class:`RunEndedEarly` saying ``why``."""
        error = getattr(sys, "last_value", None)
        if isinstance(error, BaseException) and error is not self._errors_before:
            return error
        return RunEndedEarly(f"{why} (no end event: an error the {self.door} did not see)")

    def _close_at_exit(self) -> None:
        self.close(self.ended_early("the process exited before the run ended"))

    def close(self, exc: BaseException | None = None) -> Any:
        """The phase hooks removed, the monitor closed (its report written and printed); the report.
        Safe to call twice; never raises."""
        phases, self.phases = self.phases, None
        if phases is not None:
            try:
                phases.remove()
            except Exception as error:
                warn_at_user(f"{self.door}: removing its phase hooks failed: {error!r}")
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            atexit.unregister(self._close_at_exit)
            try:
                self.report = monitor.close(exc)
            except Exception as error:
                warn_at_user(f"{self.door}: monitor close failed: {error!r}")
        closing, self.closing = self.closing, []
        for close in closing:
            try:
                close()
            except Exception as error:
                warn_at_user(f"{self.door}: closing {close!r} failed: {error!r}")
        return self.report
