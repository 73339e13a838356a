"""An injected out-of-memory error (``torch.OutOfMemoryError``, the type CUDA's allocator raises) at step 3,
through both front doors: the report's ``oom`` finding, ``oom.json`` with the last memory figures, on
CUDA (``torch.cuda.*`` mocked) a memory snapshot for https://pytorch.org/memory_viz, and the user's
exception re-raised unchanged. The CPU path runs for real: no snapshot, but the report and the figures.
"""

from __future__ import annotations

import doctest
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fake_cuda import PEAK_BYTES
from fake_cuda import install as install_fake_cuda
from fake_pynvml import FakeGpu
from fake_pynvml import install as install_fake_nvml
from resource_guard.errors import ConfigurationError
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.observe import oom
from resource_guard.observe.monitor import RunMonitor
from resource_guard.report.findings import RunStats, analyze, rule_oom
from test_faults import FAIL_AT, LitNet, Net, Resources, Rows, Seen, check_outputs, fit, guard_run, loader, rg

MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB (fake, injected at step 3)"


def test_docstring_examples_run() -> None:
    assert doctest.testmod(oom).failed == 0


def test_the_private_memory_history_api_is_where_we_expect() -> None:
    """``oom.memory_history`` calls these; a torch release that moves them fails here."""
    import inspect

    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "max_entries"} <= set(params) or "kwargs" in params
    assert "filename" in inspect.signature(torch.cuda.memory._dump_snapshot).parameters
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError


def test_oom_is_recognised_by_type_only() -> None:
    assert oom.is_oom(torch.OutOfMemoryError("x")) and oom.is_oom(torch.cuda.OutOfMemoryError("x"))
    assert not oom.is_oom(RuntimeError(MESSAGE)) and not oom.is_oom(None)


def read_oom(log_dir: Path) -> dict[str, Any]:
    figures = json.loads((log_dir / "oom.json").read_text())
    report = json.loads((log_dir / "report.json").read_text())
    assert report["verdict"] == "oom" and report["summary"]["oom"] == figures
    finding = report["findings"][0]
    assert finding["id"] == "oom" and finding["severity"] == "critical"
    assert f"step {FAIL_AT}" in finding["title"] and "OutOfMemoryError" in finding["title"]
    assert figures["step"] == FAIL_AT and figures["error"] == f"OutOfMemoryError: {MESSAGE}"
    assert figures["capacity_bytes"] and figures["estimated_peak_bytes"]
    assert "oom" in (log_dir / "report.md").read_text()
    return figures


def test_guard_cpu_oom_writes_the_figures_and_re_raises(tmp_path: Path) -> None:
    error = torch.OutOfMemoryError(MESSAGE)
    res = Resources()
    with pytest.raises(torch.OutOfMemoryError) as info:
        guard_run(tmp_path, Net(error), loader(Rows()))
    assert info.value is error
    del info
    res.check()
    figures = read_oom(tmp_path)
    assert figures["device"] == "cpu" and figures["peak_memory_source"] == "rss"
    assert figures["peak_at_oom_bytes"] is None or figures["peak_at_oom_bytes"] > 0
    assert figures["last_logged_peak_bytes"] > 0 and figures["snapshot_path"] is None
    assert not (tmp_path / oom.SNAPSHOT_FILE).exists()
    assert json.loads((tmp_path / "guard.json").read_text())["oom"] is True
    check_outputs(tmp_path, "OutOfMemoryError", min_steps=FAIL_AT - 1)


def test_lightning_cpu_oom_writes_the_figures_and_lightning_re_raises(tmp_path: Path) -> None:
    error = torch.OutOfMemoryError(MESSAGE)
    callback = rg(tmp_path / "rg")
    res = Resources()
    out = fit(LitNet(forward_error=error), Seen(), callback, error=error)
    assert out["is_error"] and out["on_exception_saw_it"]
    res.check()
    figures = read_oom(tmp_path / "rg")
    assert figures["snapshot_path"] is None and figures["peak_memory_source"] == "rss"
    assert callback.report is not None and callback.report.verdict == "oom"


def test_an_error_that_only_reads_like_an_oom_is_not_one(tmp_path: Path) -> None:
    error = RuntimeError(MESSAGE)
    with pytest.raises(RuntimeError) as info:
        guard_run(tmp_path, Net(error), loader(Rows()))
    assert info.value is error
    assert not (tmp_path / "oom.json").exists()
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["oom"] is None


@pytest.mark.parametrize("door", ["guard", "lightning"])
@pytest.mark.parametrize("history", [True, False], ids=["history", "no-history"])
def test_cuda_oom_dumps_a_memory_snapshot_when_history_is_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, door: str, history: bool
) -> None:
    cuda = install_fake_cuda(monkeypatch)
    install_fake_nvml(monkeypatch, [FakeGpu("NVIDIA A100-SXM4-40GB", "GPU-aaaa")])
    error = torch.cuda.OutOfMemoryError(MESSAGE)
    if door == "guard":
        log_dir = tmp_path
        with pytest.raises(torch.OutOfMemoryError) as info:
            guard_run(tmp_path, Net(error), loader(Rows()), profile=False, memory_history=history)
        assert info.value is error
        del info
    else:
        log_dir = tmp_path / "rg"
        out = fit(LitNet(forward_error=error), rg(log_dir, memory_history=history), error=error)
        assert out["is_error"]
    figures = read_oom(log_dir)
    assert figures["device"] == "cuda:0" and figures["peak_memory_source"] == "cuda_allocated"
    assert figures["peak_at_oom_bytes"] == PEAK_BYTES
    snapshot = log_dir / oom.SNAPSHOT_FILE
    if history:
        assert cuda.history == [
            ("record", "all", {"max_entries": oom.HISTORY_MAX_ENTRIES}),
            ("dump", str(snapshot)),
            ("record", None, {}),
        ]
        assert figures["snapshot_path"] == str(snapshot) and snapshot.read_bytes() == b"fake snapshot"
        advice = json.loads((log_dir / "report.json").read_text())["findings"][0]["advice"]
        assert any("memory_viz" in a for a in advice)
    else:
        assert cuda.history == [] and figures["snapshot_path"] is None and not snapshot.exists()


def test_cuda_run_without_oom_stops_the_history_and_dumps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = install_fake_cuda(monkeypatch)
    install_fake_nvml(monkeypatch, [FakeGpu("NVIDIA A100-SXM4-40GB", "GPU-aaaa")])
    guard_run(tmp_path, Net(), loader(Rows(n=4 * 4)), profile=False, memory_history=True)
    assert [h[:2] for h in cuda.history] == [("record", "all"), ("record", None)]
    assert not (tmp_path / "oom.json").exists() and not (tmp_path / oom.SNAPSHOT_FILE).exists()


def test_rule_oom_and_the_stats_round_trip() -> None:
    assert rule_oom(RunStats()) is None
    event = oom.OomEvent("OutOfMemoryError: x", 3, "cuda:0", 10, 8, "cuda_allocated", 9, 16, None)
    stats = RunStats(steps=2, device_kind="cuda", oom=event.to_dict())
    report = analyze(stats)
    assert report.verdict == "oom" and report.findings[0].evidence["peak_at_oom_bytes"] == 10
    assert any("memory_history=True" in a for a in report.findings[0].advice)
    assert RunStats.from_dict(json.loads(json.dumps(stats.to_dict()))) == stats


@pytest.mark.parametrize(
    "make",
    [
        lambda: RunMonitor(None, memory_history="yes"),  # type: ignore[arg-type]
        lambda: ResourceGuard(memory_history=1),  # type: ignore[arg-type]
        lambda: __import__("resource_guard").guard(
            torch.nn.Linear(2, 1), torch.optim.SGD(torch.nn.Linear(2, 1).parameters()), memory_history=None
        ),
    ],
    ids=["RunMonitor", "ResourceGuard", "guard"],
)
def test_memory_history_must_be_a_bool(make: Any) -> None:
    with pytest.raises(ConfigurationError, match="memory_history"):
        make()
