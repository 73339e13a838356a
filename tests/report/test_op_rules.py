"""Tests for resource_guard.report.op_rules: each finding fires on its cause with its measured share and
predicted step, stays silent without it, and the CPU/GPU distinctions (a CPU .item() is no sync)."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

from resource_guard.report import op_rules
from resource_guard.report.findings import analyze
from resource_guard.report.op_rules import (
    CASTS_SHARE,
    COMM_BOUND_SHARE,
    HOST_SYNC_SHARE,
    rule_casts,
    rule_comm_bound,
    rule_host_sync,
    rule_recompiles,
    rule_threads,
)
from resource_guard.report.rules import RULES
from resource_guard.report.types import ProfileSummary, RunStats

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"  # HTA's recorded GPU traces (MIT)


def test_docstring_examples_run() -> None:
    assert doctest.testmod(op_rules).failed == 0


def test_the_op_rules_run_with_the_others() -> None:
    assert set(op_rules.OP_RULES) <= set(RULES)


def _profile(**kwargs: object) -> ProfileSummary:
    values: dict[str, object] = {"steps": 3, "step_wall_us": 10_000.0, "op_timeline": "host"}
    values.update(kwargs)
    return ProfileSummary(**values)  # type: ignore[arg-type]


def _time_finding_contract(f: object, step_s: float) -> None:
    assert f is not None
    assert any(k.endswith("share") for k in f.evidence)  # type: ignore[attr-defined]
    predicted = f.predicted_step_s  # type: ignore[attr-defined]
    assert predicted is not None and 0 < predicted < step_s
    title = f.title  # type: ignore[attr-defined]
    assert "faster" in title or "x as fast" in title


@pytest.mark.parametrize("share", [CASTS_SHARE - 0.01, CASTS_SHARE + 0.05, 0.4])
def test_casts_fire_from_their_threshold_and_predict_the_step_without_them(share: float) -> None:
    # the recorded steps took 10 ms (the profiler's own work between ops), the run's steps 8 ms: the
    # casts' time is a share of the 8 ms step the user runs
    p = _profile(
        op_class_us=(("matmul", 4000.0), ("casts", share * 8_000)),
        cast_sites=(("train.py:12 (step)", 3.0, share * 8_000),),
    )
    f = rule_casts(RunStats(step_time_s=0.008, profile=p, precision="bf16-mixed"))
    if share < CASTS_SHARE:
        assert f is None
        return
    _time_finding_contract(f, 0.008)
    assert f.evidence["casts_share"] == pytest.approx(share)
    assert f.predicted_step_s == pytest.approx(0.008 * (1 - share))
    assert p.class_share("casts") == pytest.approx(share * 0.8)  # of the recorded step, without the run's
    assert "train.py:12 (step)" in f.advice[0]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true", "bf16-true"])
def test_casts_advise_the_weights_dtype_only_under_autocast(precision: str) -> None:
    """Under autocast the weights are cast every step; without it the copies are the loop's own casts
    or layout copies, and "keep the weights in the compute dtype" would send the user the wrong way."""
    p = _profile(op_class_us=(("matmul", 4000.0), ("casts", 3000.0)))
    f = rule_casts(RunStats(step_time_s=0.01, profile=p, precision=precision))
    assert f is not None
    text = " ".join(f.advice)
    assert ("compute dtype" in text) == precision.endswith("-mixed")
    assert ("Layout copies" in text) != precision.endswith("-mixed")


def test_host_sync_fires_on_a_gpu_timeline_only() -> None:
    gpu = _profile(
        op_timeline="device",
        syncs_per_step=4.0,
        sync_idle_us=1500.0,
        sync_sites=(("train.py:30 (train_step)", 4.0, 800.0),),
    )
    f = rule_host_sync(RunStats(step_time_s=0.01, profile=gpu, device_kind="cuda"))
    _time_finding_contract(f, 0.01)
    assert f is not None and f.evidence["sync_idle_share"] == 0.15 and "4 per step" in f.title
    assert "train.py:30" in f.advice[0]
    cpu = _profile(syncs_per_step=4.0, sync_idle_us=0.0, op_class_us=(("sync", 2000.0),))
    assert rule_host_sync(RunStats(step_time_s=0.01, profile=cpu)) is None  # a CPU .item() waits for nothing
    few = _profile(op_timeline="device", syncs_per_step=1.0, sync_idle_us=HOST_SYNC_SHARE * 10_000 * 0.5)
    assert rule_host_sync(RunStats(profile=few)) is None


def test_comm_bound_on_exposed_communication_only() -> None:
    exposed = _profile(op_timeline="device", comm_us=4000.0, exposed_comm_us=2000.0)
    f = rule_comm_bound(RunStats(step_time_s=0.01, profile=exposed, world_size=8))
    _time_finding_contract(f, 0.01)
    assert (
        f is not None and f.evidence["exposed_comm_share"] == 0.2 and f.evidence["overlapped_fraction"] == 0.5
    )
    hidden = _profile(op_timeline="device", comm_us=4000.0, exposed_comm_us=COMM_BOUND_SHARE * 10_000 * 0.5)
    assert rule_comm_bound(RunStats(step_time_s=0.01, profile=hidden)) is None


def test_the_8_rank_nccl_trace_is_comm_bound_and_the_sync_trace_is_not() -> None:
    from resource_guard.observe.chrome_trace import summarize_trace

    p = summarize_trace(TRACES / "rank3-of-8-nccl.json.gz")
    report = analyze(RunStats(steps=6, profile=p, device_kind="cuda", world_size=8))
    f = report.finding("comm-bound")
    assert f is not None and f.evidence["exposed_comm_share"] == pytest.approx(
        p.exposed_comm_us / p.step_wall_us, abs=1e-4
    )
    assert report.finding("host-sync") is None and report.finding("casts") is None


def _threads(intra: int, cores: int, slowdown: float | None, workers: int = 0) -> dict[str, object]:
    return {
        "intra_op_threads": intra,
        "processes": 1,
        "workers": workers,
        "cores": cores,
        "threads": intra + workers,
        "fitting_threads": max(1, cores - workers),
        "slowdown": slowdown,
    }


def test_threads_warns_with_the_measured_slowdown_and_is_silent_when_they_fit() -> None:
    host = _profile(op_class_us=(("matmul", 6000.0), ("elementwise", 2000.0)))  # ops: 80% of the step
    f = rule_threads(RunStats(step_time_s=0.02, profile=host, threads=_threads(16, 2, 2.0)))
    _time_finding_contract(f, 0.02)
    assert f is not None and f.severity == "warning"
    # the probe ran the step's mix of ops and Python: its slowdown is the whole step's
    assert f.evidence["threads_share"] == pytest.approx(0.5)
    assert "torch.set_num_threads(2)" in f.advice[0] and "OMP_NUM_THREADS=2" in f.advice[0]
    unmeasured = rule_threads(RunStats(threads=_threads(4, 2, None, workers=2)))
    assert unmeasured is not None and unmeasured.severity == "info" and unmeasured.predicted_step_s is None
    assert "fewer DataLoader workers" in unmeasured.advice[-1]
    assert rule_threads(RunStats(threads=_threads(2, 2, None))) is None
    assert rule_threads(RunStats()) is None


def test_recompiles_warn_when_they_cost_and_name_the_failed_guard() -> None:
    compile_info = {
        "recompiles": 6,
        "graph_breaks": 0,
        "recompile_s": 3.0,
        "compile_s": 4.0,
        "failed_guards": ["0/5: tensor 'x' size mismatch at index 1. expected 17, actual 23"],
        "break_reasons": [],
    }
    f = rule_recompiles(RunStats(step_time_s=0.1, duration_s=20.0, compile=compile_info))
    _time_finding_contract(f, 0.1)
    assert f is not None and f.evidence["recompile_share"] == 0.15
    assert "size mismatch at index 1" in f.advice[0] and "mark_dynamic" in f.advice[1]
    cheap = rule_recompiles(RunStats(step_time_s=0.1, duration_s=1000.0, compile=compile_info))
    assert cheap is not None and cheap.severity == "info"
    breaks = {
        **compile_info,
        "recompiles": 0,
        "recompile_s": 0.0,
        "graph_breaks": 2,
        "break_reasons": ["print (2x)"],
    }
    g = rule_recompiles(RunStats(duration_s=20.0, compile=breaks))
    assert g is not None and g.severity == "info" and "print (2x)" in g.advice[-1]
    assert rule_recompiles(RunStats(compile=None)) is None


def test_a_run_without_a_cause_stays_healthy() -> None:
    clean = _profile(
        op_class_us=(("matmul", 7000.0), ("elementwise", 1500.0), ("casts", 300.0), ("sync", 5.0)),
        syncs_per_step=1.0,
    )
    stats = RunStats(
        steps=50,
        step_time_s=0.01,
        profile=clean,
        threads=_threads(2, 2, None),
        compile={"recompiles": 0, "graph_breaks": 0},
    )
    assert analyze(stats).verdict == "healthy"


_ROWS = (
    {"config": "8×4 bf16-mixed", "precision": "bf16-mixed", "micro_batch_size": 8, "accumulation_steps": 4,
     "checkpointing": 0, "predicted_peak_bytes": 3 * 2**30, "fits": True, "chosen": True},
    {"config": "8×4 bf16-true", "precision": "bf16-true", "micro_batch_size": 8, "accumulation_steps": 4,
     "checkpointing": 0, "predicted_peak_bytes": 2 * 2**30, "fits": True, "chosen": False},
)  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "said"),
    [
        (_ROWS, "keep them in it instead (bf16-true, the plan's row '8×4 bf16-true': 2.00 GiB, fits"),
        ((_ROWS[0], {**_ROWS[1], "fits": False}), "ruled out by the plan (the plan's row '8×4 bf16-true'"),
        (_ROWS[:1], "the plan did not evaluate bf16-true"),
        ((), "the plan did not evaluate bf16-true"),
    ],
)
def test_casts_recommend_the_compute_dtype_only_as_the_plan_evaluated_it(rows: tuple, said: str) -> None:
    """Issue #37: the plan chose bf16-mixed and the finding advised bf16-true, which the plan's table
    never evaluated. A configuration is recommended only from a row of the plan that fits, quoted."""
    p = _profile(op_class_us=(("matmul", 4000.0), ("casts", 3000.0)))
    f = rule_casts(RunStats(step_time_s=0.01, profile=p, precision="bf16-mixed", plan_rows=rows))
    assert f is not None
    text = " ".join(f.advice)
    assert said in text, text
    assert ("keep them in it instead" in text) == (rows == _ROWS)


def test_casts_state_the_median_share_with_its_spread_and_a_stall_is_an_event() -> None:
    p = _profile(
        op_class_us=(("matmul", 4000.0), ("casts", 2000.0)),
        op_class_spread_us=(("matmul", 100.0), ("casts", 300.0)),
        stalls=(("aten::copy_", 150_000.0, "train.py:9 (step)"),),
    )
    stats = RunStats(step_time_s=0.01, profile=p)
    f = rule_casts(stats)
    assert f is not None and f.evidence["casts_share"] == 0.2 and f.evidence["casts_share_spread"] == 0.03
    assert "20% (±3 points over 3 profiled steps)" in f.title
    stall = op_rules.rule_stall(stats)
    assert stall is not None and stall.severity == "info" and stall.predicted_step_s is None
    assert "aten::copy_ call took 150.0 ms" in stall.title and "train.py:9 (step)" in stall.title
    assert "%" not in stall.title.split("(")[0]  # no share: an event
    assert op_rules.rule_stall(RunStats(step_time_s=0.01, profile=_profile())) is None


def test_every_share_divides_by_the_untraced_step() -> None:
    """One definition (issue #37): the run's step measured without the profiler, for every rule."""
    gpu = _profile(op_timeline="device", step_wall_us=20_000.0, syncs_per_step=4.0, sync_idle_us=1500.0)
    f = rule_host_sync(RunStats(step_time_s=0.01, profile=gpu, device_kind="cuda"))
    assert f is not None and f.evidence["sync_idle_share"] == 0.15  # of 10 ms, not of the traced 20 ms
    comm = _profile(op_timeline="device", step_wall_us=20_000.0, comm_us=3000.0, exposed_comm_us=1000.0)
    c = rule_comm_bound(RunStats(step_time_s=0.01, profile=comm))
    assert c is not None and c.evidence["exposed_comm_share"] == 0.1
    assert RunStats(profile=comm).step_us() == 20_000.0 and RunStats().step_us() is None


def test_casts_are_raised_only_when_the_share_holds_across_the_window() -> None:
    """A median over the threshold only by the noise of the window's steps flips from run to run
    (issue #37: the demo's casts 45.6%, 11.5%, 11.5%): the median less the spread must reach it."""
    steady = _profile(
        op_class_us=(("matmul", 8000.0), ("casts", 1200.0)), op_class_spread_us=(("casts", 100.0),)
    )
    noisy = _profile(
        op_class_us=(("matmul", 8000.0), ("casts", 1200.0)), op_class_spread_us=(("casts", 400.0),)
    )
    assert rule_casts(RunStats(step_time_s=0.01, profile=steady)) is not None  # 12% ± 1
    assert rule_casts(RunStats(step_time_s=0.01, profile=noisy)) is None  # 12% ± 4: 8% in some steps
