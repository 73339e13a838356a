"""Memory growth and fragmentation (issue #22): allocated memory at step ends at equal batch shapes, the
trend and its rule; the CUDA allocator's retries and reserved-minus-allocated gap (with the fake CUDA).

The acceptance pair trains a small MLP for real on the CPU under ``guard``: one loop keeps an output with
its graph every step (a forward kept for a metric, never backpropagated), the other keeps nothing. The
first must be reported as ``memory-growth``, the second must not. Nothing depends on the machine's speed.
"""

from __future__ import annotations

import doctest
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from fake_cuda import install as install_fake_cuda
from fake_pynvml import FakeGpu
from fake_pynvml import install as install_fake_nvml
from resource_guard import guard
from resource_guard.observe import growth
from resource_guard.observe.growth import (
    MAX_STRIDE,
    MemoryWatch,
    batch_signature,
    cpu_allocated_bytes,
    memory_trend,
)
from resource_guard.observe.monitor import RunMonitor
from resource_guard.report import memory_rules
from resource_guard.report.findings import Report, RunStats, analyze
from resource_guard.report.memory_rules import rule_fragmentation, rule_memory_growth
from resource_guard.report.tensorboard import custom_scalar_layout
from resource_guard.report.terminal import make_console, render_report

MiB = 2**20


@pytest.mark.parametrize("module", [growth, memory_rules])
def test_docstring_examples_run(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# -- the acceptance pair: a kept-graph leak vs a healthy run, for real on the CPU ---------------------------


def train(log_dir: Path, *, leak: bool, steps: int = 80) -> Report:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 768), nn.GELU(), nn.Linear(768, 256), nn.LayerNorm(256), nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(64, 256), torch.randint(0, 10, (64,))) for _ in range(4)]
    kept = []
    with guard(model, optimizer, device="cpu", precision="32-true", log_dir=log_dir, profile=False) as g:
        for x, y in g.iterate(data[i % 4] for i in range(steps)):
            loss = nn.functional.cross_entropy(model(x), y)
            g.backward(loss)
            if leak:  # "for a metric": a second forward, kept with its graph and its saved activations
                kept.append(model(x))
    assert g.report is not None
    return g.report


@pytest.mark.skipif(cpu_allocated_bytes()[1] != "cpu_malloc_in_use", reason="needs glibc's mallinfo2")
def test_a_kept_graph_leak_is_memory_growth_and_a_healthy_run_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a reading at every step end, whatever this machine's speed: how readings are spaced by their cost
    # is test_reads_are_spaced_to_cost_at_most_the_budget's (a fake clock); here only what they show counts
    # (an unbounded budget: with 1.0, a read slower than a 1.2 ms step on a loaded CI host doubled the stride)
    monkeypatch.setattr(growth, "READ_BUDGET", math.inf)
    leaky = train(tmp_path / "leak", leak=True)
    found = leaky.finding("memory-growth")
    assert found is not None, [f.id for f in leaky.findings]
    ev = found.evidence
    # each kept forward holds the saved activations of one 64-row batch: x, the 768-wide linear output
    # and GELU output, the 256-wide linear output and LayerNorm output (float32), at least this much
    kept_per_step = 64 * (256 + 768 + 768 + 256 + 256) * 4
    assert kept_per_step * 0.9 <= ev["bytes_per_step"] <= kept_per_step * 2
    assert ev["r_squared"] > 0.95 and ev["rising_share"] > 0.9 and ev["steps"] >= 40
    assert ev["batch_shapes"] == [[64, 256], [64]] and ev["source"] == "cpu_malloc_in_use"
    assert any(".item()" in a for a in found.advice) and any("list of tensors" in a for a in found.advice)
    report_json = json.loads((tmp_path / "leak" / "report.json").read_text())
    assert "memory-growth" in [f["id"] for f in report_json["findings"]]
    assert "### memory-growth (warning)" in (tmp_path / "leak" / "report.md").read_text()

    healthy = train(tmp_path / "healthy", leak=False)
    assert healthy.finding("memory-growth") is None, healthy.finding("memory-growth")
    trend = healthy.stats.memory_growth
    assert trend is not None and trend["samples"] >= 40  # as many readings as the leak was found from
    assert abs(trend["rise_bytes"]) < memory_rules.GROWTH_MIN_BYTES


# -- the trend ----------------------------------------------------------------------------------------------


def readings(values: list[int], signature: Any = ((8, 16),)) -> list[tuple[int, Any, int]]:
    return [(step, signature, v) for step, v in enumerate(values, start=1)]


def test_a_steady_rise_is_fitted_exactly() -> None:
    t = memory_trend(readings([10 * MiB + 300_000 * s for s in range(40)]), source="cuda_allocated")
    assert t is not None
    assert t.bytes_per_step == pytest.approx(300_000) and t.r_squared == pytest.approx(1.0)
    assert t.rising_share == 1.0 and t.samples == 36 and t.steps == 35  # the first 10% left out


def test_flat_noise_one_jump_and_changing_shapes_are_not_growth() -> None:
    noise = [50 * MiB + (4096 if s % 2 else 0) for s in range(60)]
    jump = [50 * MiB] * 30 + [90 * MiB] * 30  # a cache filled once: one rise, then flat
    for values in (noise, jump):
        t = memory_trend(readings(values), source="cuda_allocated")
        assert t is not None and rule_memory_growth(RunStats(memory_growth=t.to_dict())) is None
    # longer sequences later in the run: more memory, but never twice at one shape
    growing_shapes = [(s, ((8, 16 * s),), 10 * MiB * s) for s in range(1, 40)]
    assert memory_trend(growing_shapes, source="cuda_allocated") is None
    # two shapes alternating, each flat: grouped by shape, no growth
    two = [(s, ((8, 16 if s % 2 else 512),), (10 if s % 2 else 200) * MiB) for s in range(1, 60)]
    t = memory_trend(two, source="cuda_allocated")
    assert (
        t is not None
        and t.bytes_per_step == 0
        and rule_memory_growth(RunStats(memory_growth=t.to_dict())) is None
    )


def test_growth_is_critical_when_capacity_is_reached_within_the_watched_steps_again() -> None:
    t = memory_trend(readings([1024 * MiB + 10 * MiB * s for s in range(50)]), source="cuda_allocated")
    assert t is not None
    roomy = rule_memory_growth(RunStats(memory_growth=t.to_dict(), capacity_bytes=80 * 2**30))
    tight = rule_memory_growth(RunStats(memory_growth=t.to_dict(), capacity_bytes=1800 * MiB))
    assert roomy is not None and roomy.severity == "warning" and roomy.evidence["steps_to_capacity"] > 1000
    assert tight is not None and tight.severity == "critical" and tight.evidence["steps_to_capacity"] < 50


def test_batch_signature_is_shapes_and_dtypes_of_flat_batches_only() -> None:
    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    assert batch_signature((x, y)) == batch_signature([x, y]) == ((x.shape, x.dtype), (y.shape, y.dtype))
    assert batch_signature({"a": x, "n": 3}) == ((x.shape, x.dtype), 3)
    assert batch_signature((x, y.float())) != batch_signature((x, y))
    assert batch_signature(((x, y), y)) is None and batch_signature(object()) is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("read_s", "stride"), [(1e-7, 1), (1.74e-5, 35), (1e-3, MAX_STRIDE)])
def test_reads_are_spaced_to_cost_at_most_the_budget(read_s: float, stride: int) -> None:
    clock = Clock()

    def read() -> int:
        clock.now += read_s
        return 1

    watch = MemoryWatch(read, "cuda_allocated", clock)
    for step in range(1, 401):
        clock.now += 1e-3  # a 1 ms step
        if step >= watch.next_step:
            watch.sample(step, None)
    gaps = {b[0] - a[0] for a, b in zip(watch.samples[-5:], watch.samples[-4:])}
    assert gaps == {stride}  # ceil(read cost / (0.05% of a 1 ms step)), within [1, MAX_STRIDE]


# -- fragmentation and the CUDA readings (fake CUDA) ---------------------------------------------------------


def cuda_guard_run(log_dir: Path, steps: int = 40, done: list[int] | None = None) -> Report:
    """A short guard run; ``done[0]`` counts the steps finished (for a fake allocator that leaks)."""
    done = done if done is not None else [0]
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(steps)]
    with guard(model, optimizer, device="cpu", log_dir=log_dir, profile=False) as g:
        for x, y in g.iterate(data):
            g.backward(nn.functional.mse_loss(model(x), y))
            done[0] += 1
    assert g.report is not None
    return g.report


def test_fragmentation_and_growth_on_cuda_reach_the_report_and_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = install_fake_cuda(monkeypatch)
    install_fake_nvml(monkeypatch, [FakeGpu("NVIDIA A100-SXM4-40GB", "GPU-aaaa")])
    done = [0]
    # 3 MiB more at every step end: torch.cuda.memory_allocated as a leak shows it
    cuda.allocated = lambda: 512 * MiB + 3 * MiB * done[0]
    cuda.stats.update({
        "num_alloc_retries": 3,
        "reserved_bytes.all.current": 30 * 2**30,
        "allocated_bytes.all.current": 18 * 2**30,
    })  # fmt: skip
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    # (an unbounded budget: with 1.0, a read slower than a 1.2 ms step on a loaded CI host doubled the stride)
    monkeypatch.setattr(growth, "READ_BUDGET", math.inf)  # a read at every step end, however fast the step
    report = cuda_guard_run(tmp_path, done=done)

    frag = report.finding("fragmentation")
    assert frag is not None and frag.severity == "warning"
    assert frag.evidence["alloc_retries"] == 3 and frag.evidence["reserved_gap_bytes"] == 12 * 2**30
    assert frag.evidence["expandable_segments"] is False
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in frag.advice[0]
    grow = report.finding("memory-growth")
    assert grow is not None and grow.evidence["source"] == "cuda_allocated"
    assert grow.evidence["bytes_per_step"] == pytest.approx(3 * MiB) and grow.evidence["r_squared"] == 1.0
    assert report.stats.alloc_retries == 3 and report.stats.reserved_bytes == 30 * 2**30

    data = json.loads((tmp_path / "report.json").read_text())
    ids = [f["id"] for f in data["findings"]]
    assert {"fragmentation", "memory-growth"} <= set(ids)
    assert (
        data["summary"]["alloc_retries"] == 3
        and data["summary"]["memory_growth"]["source"] == "cuda_allocated"
    )
    assert Report.from_dict(data).finding("fragmentation") == frag  # the JSON round-trips
    markdown = (tmp_path / "report.md").read_text()
    assert "### fragmentation (warning)" in markdown and "expandable_segments:True" in markdown

    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {
        f"resource_guard/4_memory/{k}" for k in ("allocated_mib", "reserved_mib", "alloc_retries")
    } <= tags
    assert ea.Scalars("resource_guard/4_memory/alloc_retries")[-1].value == 3
    assert ea.Scalars("resource_guard/4_memory/reserved_mib")[-1].value == 30 * 1024  # MiB, not bytes
    allocated = [e.value for e in ea.Scalars("resource_guard/4_memory/allocated_mib")]
    # the leak, as TensorBoard shows it, in its own chart
    assert allocated == sorted(allocated) and allocated[-1] > allocated[0]
    layout = custom_scalar_layout()["resource_guard"]
    assert any(re.match(r, "resource_guard/4_memory/allocated_mib") for r in layout["memory (MiB)"][1])
    text = ea.Tensors("resource_guard/report/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "fragmentation" in text and "memory-growth" in text

    buffer = io.StringIO()
    render_report(report, make_console(buffer, force_terminal=False))
    out = buffer.getvalue()
    assert "fragmentation" in out and "memory-growth" in out and "expandable_segments" in out


def test_fragmentation_rule_gap_alone_is_info_and_advice_follows_the_allocator_config() -> None:
    base = {"device_kind": "cuda", "capacity_bytes": 40 * 2**30, "alloc_retries": 0}
    wide = RunStats(**base, reserved_bytes=36 * 2**30, reserved_gap_bytes=12 * 2**30)
    narrow = RunStats(**base, reserved_bytes=36 * 2**30, reserved_gap_bytes=2 * 2**30)
    loose = RunStats(**base, reserved_bytes=8 * 2**30, reserved_gap_bytes=6 * 2**30)  # far from full
    found = rule_fragmentation(wide)
    assert found is not None and found.severity == "info" and "33%" in found.title
    assert rule_fragmentation(narrow) is None and rule_fragmentation(loose) is None
    on = rule_fragmentation(RunStats(**{**base, "alloc_retries": 1}, expandable_segments=True))
    assert on is not None and "garbage_collection_threshold" in on.advice[0]
    assert rule_fragmentation(RunStats(alloc_retries=5)) is None  # the CPU has no caching allocator
    assert {f.id for f in analyze(wide).findings} == {"fragmentation", "healthy"}


def test_a_failing_memory_read_is_one_warning_and_training_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> tuple[int, str]:
        raise OSError("no mallinfo today")

    mon = RunMonitor(None, profile=False, summary=False)
    mon.start()
    monkeypatch.setattr("resource_guard.observe.monitor.cpu_allocated_bytes", broken)
    with pytest.warns(Warning, match="memory growth disabled: OSError") as record:
        for _ in range(5):
            mon.batch_ready(torch.zeros(2, 3))
            mon.step_end()
    assert len(record) == 1
    report = mon.close()
    assert report is not None and report.stats.steps == 5


@pytest.mark.parametrize("leak", [True, False], ids=["leak", "healthy"])
def test_the_lightning_callback_reports_growth_only_for_a_leak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leak: bool
) -> None:
    from test_faults import BATCH, LitNet, Rows, lit_trainer, loader, rg

    cuda = install_fake_cuda(monkeypatch)
    install_fake_nvml(monkeypatch, [FakeGpu("NVIDIA A100-SXM4-40GB", "GPU-aaaa")])
    # (an unbounded budget: with 1.0, a read slower than a 1.2 ms step on a loaded CI host doubled the stride)
    monkeypatch.setattr(growth, "READ_BUDGET", math.inf)  # a read at every step end, however fast the step

    class Module(LitNet):
        def train_dataloader(self) -> Any:
            return loader(Rows(n=40 * BATCH))

    callback = rg(tmp_path, profile=False)
    trainer = lit_trainer(callback, max_steps=40)
    # what torch.cuda.memory_allocated shows at step ends: 2 MiB more per optimizer step, or flat
    cuda.allocated = lambda: 256 * MiB + (2 * MiB * trainer.global_step if leak else 0)
    trainer.fit(Module())
    report = callback.report
    assert report is not None and report.stats.steps == 40
    found = report.finding("memory-growth")
    if leak:
        assert found is not None and found.evidence["bytes_per_step"] == pytest.approx(2 * MiB)
        assert found.evidence["batch_shapes"] == [[BATCH, 8], [BATCH, 1]]
    else:
        assert found is None and report.stats.memory_growth is not None
        assert report.stats.memory_growth["bytes_per_step"] == 0
