"""Tests for resource_guard.observe.chrome_trace on the real GPU traces in tests/data/traces (HTA's
test data, MIT: syncs on one GPU, NCCL ranks of 2- and 8-GPU jobs; see its README) and on a trace this
CPU writes."""

from __future__ import annotations

import doctest
import gzip
import json
from pathlib import Path

import pytest
import torch

from resource_guard.observe import chrome_trace
from resource_guard.observe.chrome_trace import read_trace, summarize_trace, trace_records
from resource_guard.observe.profiling import ProfileWindow, StepProfiler

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


def test_docstring_examples_run() -> None:
    assert doctest.testmod(chrome_trace).failed == 0


def _count(path: Path, cat: str, names: tuple[str, ...]) -> int:
    events = read_trace(path)["traceEvents"]
    return sum(1 for e in events if e.get("cat") == cat and e.get("name") in names)


def test_the_syncs_of_a_real_gpu_trace_are_counted_and_leave_idle_gaps() -> None:
    path = TRACES / "alexnet-train-syncs.json.gz"
    s = summarize_trace(path)
    blocking = _count(path, "cuda_runtime", ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    assert blocking == 21 and s.syncs_per_step == blocking  # one step: the whole trace
    assert s.op_timeline == "device" and s.sync_idle_us > 0
    assert "no ProfilerStep# spans" in s.notes[0]
    small = summarize_trace(TRACES / "cuda-event-sync.json.gz")
    assert small.steps == 1 and small.step_wall_us == 3154
    assert small.syncs_per_step == 3  # stream, event and device synchronize
    assert 0 < small.sync_idle_us < small.step_wall_us


@pytest.mark.parametrize(("name", "world"), [("ddp2-nccl-allreduce", 2), ("rank3-of-8-nccl", 8)])
def test_nccl_ranks_show_communication_and_its_exposed_part(name: str, world: int) -> None:
    s = summarize_trace(TRACES / f"{name}.json.gz")
    classes = dict(s.op_class_us)
    assert f"of {world} (nccl)" in s.notes[-1]
    assert s.steps >= 3 and s.step_wall_us and s.comm_us > 0
    # the class is the median over the steps, comm_us their mean: within the steps' spread
    spread = dict(s.op_class_spread_us)["communication"]
    assert abs(classes["communication"] - s.comm_us) <= spread + 0.01 * s.comm_us
    assert 0 < s.exposed_comm_us < s.comm_us  # partly overlapped by backward
    assert classes["matmul"] > 0 and classes["elementwise"] > 0
    assert sum(classes.values()) <= 1.2 * s.device_busy_us


def test_self_times_come_from_nesting_per_thread() -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::to", "ts": 10, "dur": 40, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::_to_copy", "ts": 12, "dur": 30, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 15, "dur": 20, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 20, "dur": 10, "tid": 2},  # other thread
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::mm",
                "ts": 200,
                "dur": 10,
                "tid": 1,
            },  # after the step
            {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 5, "tid": 1},
        ]
    }
    records, steps, notes = trace_records(trace)
    own = {(r.name, r.thread): r.duration_us for r in records if not r.name.startswith("Profiler")}
    assert steps == 1 and notes == []
    assert [v for (n, _), v in own.items() if n.startswith("aten::") and n != "aten::mm"] == [
        10.0,
        10.0,
        20.0,
    ]
    assert sum(1 for n, _ in own if n == "aten::mm") == 1


def test_a_trace_written_here_reads_back_like_the_live_window(tmp_path: Path) -> None:
    model = torch.nn.Linear(32, 32)
    prof = StepProfiler(ProfileWindow(skip_first=0, wait=0, warmup=1, active=2), tmp_path)
    prof.start()
    for _ in range(3):
        model(torch.randn(8, 32).double().float()).sum().backward()
        prof.step()
    live = prof.summarize()
    assert live is not None and live.trace_path is not None
    read = summarize_trace(live.trace_path)
    assert read.steps == live.steps == 2
    assert read.step_wall_us == pytest.approx(live.step_wall_us, rel=0.05)
    live_classes, read_classes = dict(live.op_class_us), dict(read.op_class_us)
    for cls in ("matmul", "casts"):
        assert read_classes[cls] == pytest.approx(live_classes[cls], rel=0.35, abs=20.0), cls


def test_a_file_that_is_not_a_trace_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"a": 1}).encode()))
    with pytest.raises(ValueError, match="not a Chrome trace"):
        read_trace(path)
