"""Tests for resource_guard.report: each rule on its own, the verdict, rendering and ``report_command``."""

from __future__ import annotations

import dataclasses
import doctest
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resource_guard.observe.profiling import ProfileSummary
from resource_guard.report import findings as report_module
from resource_guard.report.findings import (
    FINDING_IDS,
    Report,
    RunStats,
    analyze,
    report_command,
    rule_alignment,
    rule_estimate_drift,
    rule_host_to_device,
    rule_input_bound,
    rule_launch_bound,
    rule_memory_pressure,
    rule_precision,
)

GiB = 2**30
GPU = RunStats(steps=100, device="cuda:0", device_kind="cuda", tensor_cores=True, bf16_supported=True)


def test_docstring_examples_run() -> None:
    assert doctest.testmod(report_module).failed == 0


# -- input-bound -----------------------------------------------------------------------------------


def test_input_bound_fires_from_the_threshold_on() -> None:
    assert rule_input_bound(RunStats(data_wait_share=0.049)) is None
    assert rule_input_bound(RunStats(data_wait_share=None)) is None
    f = rule_input_bound(RunStats(data_wait_share=0.05))
    assert f is not None and f.id == "input-bound" and f.severity == "warning"
    assert rule_input_bound(RunStats(data_wait_share=0.3)).severity == "critical"  # type: ignore[union-attr]
    assert rule_input_bound(RunStats(data_wait_share=0.08, stall_threshold=0.1)) is None


def test_input_bound_advice_compares_workers_with_the_available_cores() -> None:
    stats = RunStats(data_wait_share=0.4, loader_info={"num_workers": 0}, available_cores=8, cpu_count=16)
    advice = rule_input_bound(stats).advice  # type: ignore[union-attr]
    assert "num_workers from 0 to about 7" in advice[0] and "8 cores" in advice[0] and "= 16" in advice[0]
    assert "persistent_workers=True" in advice[-1] and "prefetch_factor" in advice[-1]
    assert not any("pin_memory" in a for a in advice)  # a CPU run: pinning does not apply


def test_input_bound_advice_on_a_gpu_with_workers() -> None:
    loader = {"num_workers": 3, "pin_memory": False, "persistent_workers": False, "prefetch_factor": 2}
    stats = dataclasses.replace(GPU, data_wait_share=0.2, loader_info=loader, available_cores=4)
    advice = " | ".join(rule_input_bound(stats).advice)  # type: ignore[union-attr]
    assert "already uses the 4 available cores" in advice
    assert "pin_memory=True" in advice and "persistent_workers=True" in advice
    assert "prefetch_factor from 2 to 4" in advice


def test_input_bound_without_loader_info_advises_no_setting_it_could_not_read() -> None:
    """Issue #37: plain guard passed no loader settings and DCGAN (num_workers=2) was told "set
    num_workers (about 1 here)". Unread settings are said to be unread, and none is advised."""
    advice = " | ".join(rule_input_bound(RunStats(data_wait_share=0.2, available_cores=2)).advice)  # type: ignore[union-attr]
    assert "were not readable" in advice and "about" not in advice
    assert "persistent_workers=True" not in advice and "prefetch_factor=4" not in advice
    read = {"num_workers": 2, "pin_memory": False, "persistent_workers": False, "prefetch_factor": 2}
    stats = RunStats(data_wait_share=0.2, available_cores=2, loader_info=read)
    advice = " | ".join(rule_input_bound(stats).advice)  # type: ignore[union-attr]
    assert "num_workers=2 already uses the 2 available cores" in advice and "Raise DataLoader" not in advice


@given(share=st.floats(0, 1), threshold=st.floats(0.001, 0.999))
def test_input_bound_iff_share_reaches_threshold(share: float, threshold: float) -> None:
    f = rule_input_bound(RunStats(data_wait_share=share, stall_threshold=threshold))
    assert (f is not None) == (share >= threshold)


# -- the other rules -------------------------------------------------------------------------------


def _profile(**kwargs: object) -> ProfileSummary:
    return ProfileSummary(steps=3, **kwargs)  # type: ignore[arg-type]


def test_launch_bound_needs_low_utilization_and_small_or_many_kernels() -> None:
    tiny = dataclasses.replace(
        GPU, gpu_util_percent=30.0, profile=_profile(kernel_count=200, median_kernel_us=6.0)
    )
    f = rule_launch_bound(tiny)
    assert (
        f is not None
        and any("torch.compile" in a for a in f.advice)
        and any("CUDA graphs" in a for a in f.advice)
    )
    assert rule_launch_bound(dataclasses.replace(tiny, gpu_util_percent=80.0)) is None
    big = _profile(kernel_count=50, median_kernel_us=900.0)
    assert rule_launch_bound(dataclasses.replace(tiny, profile=big)) is None
    many = _profile(kernel_count=5000, median_kernel_us=900.0)
    assert rule_launch_bound(dataclasses.replace(tiny, profile=many)) is not None
    assert rule_launch_bound(RunStats(gpu_util_percent=None)) is None


def test_memory_pressure_above_ninety_percent() -> None:
    assert rule_memory_pressure(RunStats(peak_memory_bytes=9 * GiB, capacity_bytes=10 * GiB)) is None
    f = rule_memory_pressure(RunStats(peak_memory_bytes=int(9.5 * GiB), capacity_bytes=10 * GiB))
    assert f is not None and f.severity == "warning" and f.evidence["fraction"] == 0.95
    assert any("checkpointing" in a for a in f.advice) and any("bf16" in a for a in f.advice)
    assert rule_memory_pressure(RunStats(peak_memory_bytes=None, capacity_bytes=10)) is None


def test_precision_only_for_full_fp32_on_tensor_cores() -> None:
    f = rule_precision(dataclasses.replace(GPU, precision="32-true", tf32_supported=True))
    assert (
        f is not None
        and "bf16-mixed" in f.advice[0]
        and 'set_float32_matmul_precision("high")' in f.advice[1]
    )
    no_bf16 = rule_precision(dataclasses.replace(GPU, bf16_supported=False))
    assert no_bf16 is not None and "16-mixed" in no_bf16.advice[0]
    assert rule_precision(dataclasses.replace(GPU, precision="bf16-mixed")) is None
    assert rule_precision(dataclasses.replace(GPU, float32_matmul_precision="high")) is None
    assert rule_precision(dataclasses.replace(GPU, tensor_cores=False)) is None
    assert rule_precision(RunStats(precision="32-true")) is None  # CPU


def test_host_to_device_share_of_the_step() -> None:
    p = _profile(step_wall_us=1000.0, h2d_us=200.0, h2d_pageable_us=200.0)
    f = rule_host_to_device(dataclasses.replace(GPU, profile=p))
    assert f is not None and f.evidence["h2d_share"] == 0.2 and "non_blocking=True" in f.advice[0]
    assert "pageable" in f.advice[1]
    small = _profile(step_wall_us=1000.0, h2d_us=50.0)
    assert rule_host_to_device(dataclasses.replace(GPU, profile=small)) is None


def test_alignment_on_gpus_only() -> None:
    p = _profile(misaligned_matmuls=(("aten::mm", ((100, 60), (60, 30))),))
    f = rule_alignment(dataclasses.replace(GPU, profile=p))
    assert f is not None and f.severity == "info" and "multiples of 8" in f.advice[0]
    assert rule_alignment(RunStats(profile=p)) is None


def test_alignment_needs_a_tenth_of_the_matmul_time() -> None:
    shapes = (("aten::mm", ((100, 60), (60, 30))),)
    minor = _profile(misaligned_matmuls=shapes, matmul_us=100.0, misaligned_matmul_us=5.0)
    assert rule_alignment(dataclasses.replace(GPU, profile=minor)) is None
    major = _profile(misaligned_matmuls=shapes, matmul_us=100.0, misaligned_matmul_us=40.0)
    f = rule_alignment(dataclasses.replace(GPU, profile=major))
    assert f is not None and f.evidence["share_of_matmul_time"] == 0.4


def test_estimate_drift_only_against_the_allocator_peak() -> None:
    drift = RunStats(peak_memory_bytes=120, estimated_peak_bytes=100, peak_memory_source="cuda_allocated")
    f = rule_estimate_drift(drift)
    assert f is not None and f.evidence["error"] == 0.2
    assert rule_estimate_drift(dataclasses.replace(drift, peak_memory_bytes=104)) is None
    assert rule_estimate_drift(dataclasses.replace(drift, peak_memory_source="rss")) is None


# -- verdict and rendering -------------------------------------------------------------------------


def test_healthy_when_nothing_is_wrong_and_info_findings_do_not_hide_it() -> None:
    assert analyze(RunStats(data_wait_share=0.01)).verdict == "healthy"
    p = _profile(misaligned_matmuls=(("aten::mm", ((100, 60), (60, 30))),))
    r = analyze(dataclasses.replace(GPU, profile=p, precision="bf16-mixed"))
    assert [f.id for f in r.findings] == ["healthy", "alignment"]


def test_findings_are_sorted_by_severity_and_ids_are_stable() -> None:
    stats = dataclasses.replace(
        GPU,
        data_wait_share=0.5,
        peak_memory_bytes=int(9.2 * GiB),
        capacity_bytes=10 * GiB,
        precision="32-true",
    )
    r = analyze(stats)
    assert r.verdict == "input-bound" and [f.severity for f in r.findings][0] == "critical"
    assert {f.id for f in r.findings} <= set(FINDING_IDS) and r.finding("healthy") is None


def test_report_round_trips_through_json_and_renders_markdown() -> None:
    p = _profile(step_wall_us=10.0, top_ops=(("aten::mm", 3, 7.5),), trace_path="x.gz")
    loader = {"num_workers": 0}
    stats = RunStats(9, data_wait_share=0.5, step_time_s=0.01, loader_info=loader, profile=p, notes=("n1",))
    r = analyze(stats)
    data = json.loads(json.dumps(r.to_dict()))
    assert data["verdict"] == "input-bound" and data["findings"][0]["id"] == "input-bound"
    assert set(data["findings"][0]) == {"id", "severity", "title", "evidence", "advice", "predicted_step_s"}
    again = Report.from_dict(data)
    assert again == r
    md = r.to_markdown()
    assert "**Verdict: input-bound**" in md and "num_workers" in md and "| aten::mm | 3 | 7.5 |" in md
    assert "Note: n1" in md and "10.00 ms" in r.to_markdown()
    assert "verdict input-bound" in r.summary_line()


# -- report_command --------------------------------------------------------------------------------


def _write(directory: Path) -> Report:
    r = analyze(RunStats(steps=3, data_wait_share=0.6))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(r.to_dict()))
    return r


def test_report_command_prints_tables_markdown_or_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = _write(tmp_path / "lightning_logs" / "version_0")
    assert report_command(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "verdict input-bound" in out and "**" not in out and "\x1b[" not in out
    assert report_command(str(tmp_path), as_markdown=True) == 0
    assert capsys.readouterr().out.strip() == r.to_markdown().strip()
    assert report_command(str(tmp_path / "lightning_logs" / "version_0"), as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "input-bound"


def test_report_command_without_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_command(str(tmp_path)) == 2
    assert "no report.json" in capsys.readouterr().err
    (tmp_path / "report.json").write_text("{not json")
    assert report_command(str(tmp_path)) == 2
    assert "not a readable report" in capsys.readouterr().err


def test_cli_report_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from resource_guard.cli import main

    r = _write(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    assert f"verdict {r.verdict}" in capsys.readouterr().out
    assert main(["report", str(tmp_path), "--markdown"]) == 0
    assert f"**Verdict: {r.verdict}**" in capsys.readouterr().out
    assert main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"][0]["id"] == "input-bound"
    assert main(["report", str(tmp_path / "missing")]) == 2


# -- memory: like with like ------------------------------------------------------------------------

MiB = 2**20


def _rows(stats: RunStats) -> dict[str, str]:
    from resource_guard.report.markdown import summary_rows

    return dict(summary_rows(stats))


def test_cpu_rss_is_labelled_the_whole_process_and_not_set_beside_the_estimate() -> None:
    stats = RunStats(
        steps=12,
        peak_memory_bytes=965 * MiB,
        peak_memory_source="rss",
        estimated_peak_bytes=222 * MiB,
        capacity_bytes=16 * GiB,
    )
    md = analyze(stats).to_markdown()
    assert "peak memory (rss)" not in md and "| estimated peak |" not in md
    rows = _rows(stats)
    assert rows["process RSS peak (whole process)"] == "965.00 MiB"
    assert rows["pre-flight tensor estimate (not comparable with RSS)"] == "222.00 MiB"
    assert not any("vs estimate" in name for name in rows)
    names = list(rows)  # the estimate is not the RSS row's neighbour
    assert (
        names.index("pre-flight tensor estimate (not comparable with RSS)")
        - names.index("process RSS peak (whole process)")
        > 1
    )
    assert "not compared" in md  # the note says why
    assert rule_estimate_drift(stats) is None


def test_cuda_allocator_peak_is_set_beside_the_estimate_of_the_same_quantity() -> None:
    stats = dataclasses.replace(
        GPU, peak_memory_bytes=240 * MiB, peak_memory_source="cuda_allocated", estimated_peak_bytes=200 * MiB
    )
    rows = _rows(stats)
    names = list(rows)
    at = names.index("peak allocated (max_memory_allocated)")
    assert names[at + 1 : at + 3] == ["estimated allocated peak", "measured vs estimate"]
    assert rows["measured vs estimate"] == "+20.0%"
    drift = analyze(stats).finding("estimate-drift")
    assert drift is not None and drift.evidence["error"] == 0.2


def test_healthy_advice_agrees_with_the_plan_s_micro_batch() -> None:
    """Issue #37: a healthy run was told "scale the batch" right after the plan capped the micro-batch
    at the largest that fits. A larger micro-batch is advised only from a plan row that fits."""
    chosen = {"config": "16×2 32-true", "precision": "32-true", "micro_batch_size": 16, "fits": True,
              "chosen": True, "predicted_peak_bytes": 2**30}  # fmt: skip
    larger = {**chosen, "config": "32×1 32-true", "micro_batch_size": 32, "chosen": False}
    capped = analyze(RunStats(steps=10, step_time_s=0.1, plan_rows=(chosen, {**larger, "fits": False})))
    text = capped.findings[0].advice[0]
    assert capped.verdict == "healthy" and "largest that fits" in text and "'16×2 32-true'" in text
    assert "larger micro-batch" not in text
    roomy = analyze(RunStats(steps=10, step_time_s=0.1, plan_rows=(chosen, larger))).findings[0].advice[0]
    assert "a larger micro-batch (the plan's row '32×1 32-true'" in roomy
    unplanned = analyze(RunStats(steps=10, step_time_s=0.1)).findings[0].advice[0]
    assert "Scale the batch" not in unplanned and "plan a larger batch before" in unplanned


def test_a_busy_machine_is_named_first_and_the_code_can_still_be_healthy() -> None:
    node = {"other_cores": 1.0, "contention_share": 0.4, "cores": 2, "own_threads": 1}
    threads = {"intra_op_threads": 1, "processes": 1, "workers": 0, "cores": 2, "threads": 1,
               "fitting_threads": 1, "node": node}  # fmt: skip
    r = analyze(RunStats(steps=10, step_time_s=0.1, threads=threads))
    assert [f.id for f in r.findings][:2] == ["cpu-contention", "healthy"] and r.verdict == "cpu-contention"
    # a cause in the code comes before the machine's, whichever costs more: it is what the user can change,
    # and it is the same verdict on an idle machine (issue #37: the same run, the same verdict)
    slow_input = analyze(RunStats(steps=10, step_time_s=0.1, data_wait_share=0.2, threads=threads))
    assert slow_input.finding("healthy") is None
    assert [f.id for f in slow_input.findings][:2] == ["input-bound", "cpu-contention"]
