"""Tests for resource_guard.observe.profiling: the window setting, a real CPU window, the event summary."""

from __future__ import annotations

import doctest
import gzip
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.observe import profile_events, profiling
from resource_guard.observe.profiling import (
    EventRecord,
    ProfileSummary,
    ProfileWindow,
    StepProfiler,
    summarize_events,
)


def test_docstring_examples_run() -> None:
    assert doctest.testmod(profiling).failed == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"active": 0}, r"ProfileWindow\(active=0\)` must be an int >= 1"),
        ({"wait": -1}, "wait"),
        ({"skip_first": 1.5}, "skip_first"),
        ({"active": 21}, "<= 20"),
        ({"warmup": True}, "warmup"),
    ],
)
def test_window_rejects_bad_settings(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        ProfileWindow(**kwargs)  # type: ignore[arg-type]


def _steps(prof: StepProfiler, n: int, model: nn.Module) -> None:
    for _ in range(n):
        model(torch.randn(4, 12)).sum().backward()
        prof.step()


def test_a_cpu_window_records_exactly_its_steps_and_stops_itself(tmp_path: Path) -> None:
    window = ProfileWindow(skip_first=1, wait=1, warmup=1, active=2)
    prof = StepProfiler(window, tmp_path, trace_name="rank0")
    prof.start()
    model = nn.Linear(12, 10)
    _steps(prof, window.steps_needed, model)
    assert not prof.running and not torch.autograd._profiler_enabled()
    _steps(prof, 3, model)  # later steps are free: nothing is recorded any more
    summary = prof.summarize()
    assert summary is not None and summary.steps == 2 and summary.step_wall_us and summary.step_wall_us > 0
    assert summary.notes == () and summary.device_busy_us == 0.0
    assert any(op == "aten::addmm" for op, _, _ in summary.top_ops)
    assert summary.misaligned_matmuls  # 12 and 10 are not multiples of 8
    path = Path(summary.trace_path or "")
    assert path == tmp_path / "rank0.pt.trace.json.gz"
    assert "traceEvents" in json.loads(gzip.decompress(path.read_bytes()))
    assert prof.summarize() is None  # consumed


def test_a_window_cut_short_keeps_what_it_recorded(tmp_path: Path) -> None:
    prof = StepProfiler(ProfileWindow(skip_first=0, wait=0, warmup=1, active=4), None)
    prof.start()
    _steps(prof, 3, nn.Linear(12, 10))
    prof.stop()
    prof.stop()
    assert not torch.autograd._profiler_enabled()
    summary = prof.summarize()
    assert summary is not None and summary.steps == 2 and summary.trace_path is None
    assert "ended inside the profiler window: 2 of 4" in summary.notes[0]


def test_a_trace_above_the_size_bound_is_deleted(tmp_path: Path) -> None:
    prof = StepProfiler(ProfileWindow(skip_first=0, wait=0, warmup=1, active=1, max_trace_bytes=10), tmp_path)
    prof.start()
    _steps(prof, 2, nn.Linear(12, 10))
    summary = prof.summarize()
    assert summary is not None and summary.trace_path is None and not list(tmp_path.iterdir())
    assert "exceeded max_trace_bytes=10" in summary.notes[0]


def test_stop_before_the_window_records_nothing() -> None:
    prof = StepProfiler(ProfileWindow(skip_first=5), None)
    prof.start()
    _steps(prof, 2, nn.Linear(12, 10))
    prof.stop()
    assert prof.summarize() is None and not torch.autograd._profiler_enabled()
    prof.start()  # a finished profiler does not start again
    assert not prof.running


def test_summarize_events_reads_kernels_copies_and_matmuls() -> None:
    events = [
        EventRecord("ProfilerStep#7", False, 1000.0),
        EventRecord("ProfilerStep#8", False, 3000.0),
        EventRecord("aten::mm", False, 50.0, ((100, 64), (64, 30)), ("float", "float")),
        EventRecord("aten::mm", False, 30.0, ((128, 64), (64, 32)), ("c10::BFloat16", "c10::BFloat16")),
        EventRecord("aten::relu", False, 5.0),
        EventRecord("ampere_sgemm_128x64_nn", True, 40.0),
        EventRecord("elementwise_kernel", True, 4.0),
        EventRecord("elementwise_kernel", True, 6.0),
        EventRecord("Memcpy HtoD (Pageable -> Device)", True, 300.0),
        EventRecord("Memcpy HtoD (Pinned -> Device)", True, 100.0),
        EventRecord("Memset (Device)", True, 2.0),
    ]
    s = summarize_events(events, steps=2)
    assert s.step_wall_us == 2000.0 and s.device_busy_us == pytest.approx(452.0 / 2)
    assert s.kernel_count == 1.5 and s.median_kernel_us == 6.0
    assert (s.h2d_us, s.h2d_pageable_us) == (200.0, 150.0)
    assert (s.matmul_us, s.fp32_matmul_us) == (40.0, 25.0)
    assert s.misaligned_matmuls == (("aten::mm", ((100, 64), (64, 30))),)
    assert s.top_ops[0] == ("aten::mm", 1, 40.0)


def test_summary_round_trips_through_a_dict() -> None:
    s = summarize_events([EventRecord("aten::mm", False, 9.0, ((3, 5), (5, 7)), ("float", "float"))], steps=1)
    s = ProfileSummary(**{**s.__dict__, "notes": ("x",), "trace_path": "t.gz"})
    again = ProfileSummary.from_dict(json.loads(json.dumps(s.to_dict())))
    assert again == s


def _line_of(marker: str) -> int:
    return next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if marker in text)


def test_the_fast_reading_of_the_window_gives_the_summary_torchs_event_list_gives() -> None:
    """The window is read straight from the profiler's results (issue #40: ``prof.events()`` built a tree
    of every Python frame, 2 s of a close); the summary must not change."""
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    prof = StepProfiler(ProfileWindow(skip_first=0, wait=0, warmup=1, active=2), None, device_type="cpu")
    prof.start()
    for _ in range(4):
        x = torch.randn(8, 64).to(torch.float64).float()  # casts with a call site in this file
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()
        prof.step()
    prof.stop()
    captured = prof._captured
    fast = profile_events.kineto_records(captured)
    assert fast is not None
    slow = profile_events.function_event_records(captured)
    a, b = summarize_events(fast, 2), summarize_events(slow, 2)
    assert a.step_wall_us == pytest.approx(b.step_wall_us)
    assert dict(a.op_class_us) == pytest.approx(dict(b.op_class_us), abs=0.11)
    assert [(op, n) for op, n, _ in a.top_ops] == [(op, n) for op, n, _ in b.top_ops]
    # the same copies and scalar reads; the fast reading names each one's line of the call (issue #37),
    # torch's list only the line its function starts at
    for fast_sites, slow_sites in ((a.cast_sites, b.cast_sites), (a.sync_sites, b.sync_sites)):
        assert sum(n for _, n, _ in fast_sites) == sum(n for _, n, _ in slow_sites)
        assert sum(us for _, _, us in fast_sites) == pytest.approx(
            sum(us for _, _, us in slow_sites), abs=0.5
        )
    assert a.syncs_per_step == b.syncs_per_step
    here = Path(__file__).name
    assert {site.split(" ")[0] for site, _, _ in a.cast_sites} > {f"{here}:{_line_of('.float()  # casts')}"}
    assert a.matmul_us == pytest.approx(b.matmul_us) and a.fp32_matmul_us == pytest.approx(b.fp32_matmul_us)
    assert len(fast) < len(slow)  # the library's Python frames are left out
