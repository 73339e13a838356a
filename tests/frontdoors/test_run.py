"""The run's lifecycle every door shares (frontdoors/run.py): the agreement across ranks, seen from one
rank with the other ranks' rows given, and the monitor's life from its start to its report."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from resource_guard.errors import (
    ConfigurationError,
    DoesNotFitError,
    PredictedOutOfMemoryError,
    ResourceGuardError,
    ResourceGuardWarning,
)
from resource_guard.frontdoors.run import Run, TorchDistributed, agree, new_monitor


class Ranks:
    """The collective as rank ``rank`` sees it: the other ranks' rows and what each would broadcast."""

    def __init__(self, rank: int, others: dict[int, list[int]], sent: dict | None = None) -> None:
        self.rank, self.world_size = rank, len(others) + 1
        self.others, self.sent, self.broadcasts = others, sent or {}, []

    def all_gather(self, row: list[int]) -> list[list[int]]:
        return [row if r == self.rank else self.others[r] for r in range(self.world_size)]

    def broadcast(self, payload: bytes | None, src: int) -> bytes | None:
        self.broadcasts.append(src)
        return payload if src == self.rank else pickle.dumps(self.sent[src])


OK, DOES_NOT_FIT, PREDICTED_OOM, CONFIG = 0, 1, 2, 3


def test_one_process_gets_its_error_as_raised_and_its_row_back() -> None:
    error = DoesNotFitError("nothing fits", None)
    assert agree([4], error, TorchDistributed()).error is error
    agreed = agree([4, 1], None, TorchDistributed())
    assert agreed.row == (4, 1) and agreed.error is None and agreed.source_rank == 0


def test_the_most_conservative_row_wins_then_the_lowest_rank() -> None:
    # rows: (micro-batch, -checkpointing); rank 2 has the smallest micro-batch
    comm = Ranks(0, {1: [OK, 8, 0], 2: [OK, 4, 1], 3: [OK, 4, 1]})
    agreed = agree([8, 0], None, comm)
    assert agreed.row == (4, 1) and agreed.source_rank == 2 and comm.broadcasts == []
    by_checkpointing = agree([8, 0], None, Ranks(0, {1: [OK, 8, 1]}), key=lambda r: (r[0], -r[1]))
    assert by_checkpointing.row == (8, 1) and by_checkpointing.source_rank == 1


def test_a_failing_rank_stops_every_rank_with_its_message_and_kind() -> None:
    report = {"peak": 123}
    comm = Ranks(0, {1: [DOES_NOT_FIT, 0], 2: [CONFIG, 0]}, {1: ("nothing fits rank 1", report)})
    agreed = agree([8], None, comm)
    assert isinstance(agreed.error, DoesNotFitError) and agreed.source_rank == 1 and agreed.row is None
    assert str(agreed.error) == "pre-flight failed on rank 1 (every rank stops): nothing fits rank 1"
    assert agreed.error.report == report


def test_the_failing_rank_itself_raises_the_shared_error_caused_by_its_own() -> None:
    own = ConfigurationError("bad argument")
    agreed = agree([0], own, Ranks(1, {0: [OK, 8]}))
    assert type(agreed.error) is ConfigurationError and agreed.error.__cause__ is own
    assert str(agreed.error) == "pre-flight failed on rank 1 (every rank stops): bad argument"


def test_a_predicted_out_of_memory_gives_way_to_any_other_failure() -> None:
    """Under auto_find_batch_size a predicted OOM asks for a retry with a smaller batch; a rank that
    cannot start at all must not be retried."""
    sent = {0: ("batch 8 runs out of memory", None), 1: ("boom", None)}
    agreed = agree([0], RuntimeError("boom"), Ranks(1, {0: [PREDICTED_OOM, 0]}, sent))
    assert type(agreed.error) is ResourceGuardError and agreed.source_rank == 1
    only_oom = agree([8], None, Ranks(0, {1: [PREDICTED_OOM, 0]}, sent | {1: ("out of memory.", None)}))
    assert isinstance(only_oom.error, PredictedOutOfMemoryError) and " out of memory." in str(only_oom.error)


class Monitor:
    """A stand-in RunMonitor that records what the run asked of it."""

    def __init__(self, fail: str | None = None) -> None:
        self.notes: list[str] = []
        self.started = self.closed_with = None
        self.fail, self.phases = fail, None
        self.steps = 0

    def note(self, line: str) -> None:
        self.notes.append(line)

    def start(self) -> None:
        if self.fail == "start":
            raise RuntimeError("no sampler")
        self.started = True

    def step_end(self) -> None:
        if self.fail == "step":
            raise RuntimeError("writer died")
        self.steps += 1

    def close(self, exc: BaseException | None = None) -> str:
        self.closed_with = exc
        return f"report after {self.steps} steps"


def test_notes_before_the_start_reach_the_report_and_close_is_once() -> None:
    run, monitor = Run("door"), Monitor()
    run.note("evaluation pre-flighted")
    assert run.start(lambda: monitor, None, notes=["plan reason"]) is monitor
    run.call("step_end")
    removed = []
    run.phases = type("Hooks", (), {"remove": lambda self: removed.append(True)})()
    assert monitor.notes == ["plan reason", "evaluation pre-flighted"] and monitor.started
    error = ValueError("user's")
    assert run.close(error) == "report after 1 steps" and monitor.closed_with is error and removed == [True]
    assert run.close(None) == "report after 1 steps" and monitor.closed_with is error  # once
    assert run.monitor is None and run.phases is None


def test_a_monitor_that_fails_warns_once_and_training_goes_on() -> None:
    run = Run("door")
    with pytest.warns(ResourceGuardWarning, match="door: monitoring is off for this run"):
        assert run.start(lambda: Monitor(fail="start"), None) is None
    run.call("step_end")  # no monitor: nothing to call
    run.start(lambda: Monitor(fail="step"), None)
    with pytest.warns(ResourceGuardWarning, match="door: monitoring stopped: RuntimeError"):
        run.call("step_end")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.call("step_end")  # off after the first failure: no second warning
    assert run.monitor is None and run.close() is None


def test_a_configuration_error_of_the_monitor_stops_the_run_before_any_step() -> None:
    def bad() -> Monitor:
        raise ConfigurationError("log dir not writable")

    with pytest.raises(ConfigurationError, match="not writable"):
        Run("door").start(bad, None)


def test_a_run_ended_without_its_end_event_is_closed_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    registered = []
    monkeypatch.setattr("atexit.register", registered.append)
    monkeypatch.setattr("atexit.unregister", registered.remove)
    run, monitor = Run("door"), Monitor()
    run.start(lambda: monitor, None, close_at_exit=True)
    assert len(registered) == 1
    registered[0]()  # the interpreter exits
    assert "the process exited before the run ended" in str(monitor.closed_with) and registered == []


def test_the_monitor_of_a_plan_holds_the_cpu_peak_against_the_host_ram(tmp_path) -> None:
    import psutil

    from resource_guard import plan
    from resource_guard.step.training import StandInLoss

    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    made = plan(model, optimizer, torch.zeros(4, 8), StandInLoss(), device="cpu", memory_limit="64MiB")
    monitor = new_monitor(made, torch.device("cpu"), tmp_path, profile=False)
    assert monitor.planned_capacity_bytes == made.fit.capacity_bytes == 64 * 2**20
    assert monitor.capacity_bytes == psutil.virtual_memory().total
    assert monitor.estimate is made.estimate and monitor.device_spec is made.device
