"""The Resource Guard tab's data routes, against runs written for real: the ``guard`` door (a small
loop, twice: once with a slow checkpoint phase) and Lightning (a BoringModel with ``ResourceGuard``).
The routes are called through the plugin's WSGI apps, as TensorBoard serves them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from werkzeug.test import Client

from lightning_run import write_lightning_run
from resource_guard import guard
from resource_guard.cli import main
from resource_guard.tensorboard_plugin import compare_reports, find_runs
from resource_guard.tensorboard_plugin.plugin import TAB_NAME, ResourceGuardPlugin


def _guard_run(log_dir: Path, checkpoint_s: float) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(6)]
    with guard(model, optimizer, device="cpu", profile=False, log_dir=log_dir) as g:
        for x, y in g.iterate(data):
            g.backward(nn.functional.mse_loss(model(x), y))
            with g.phase("checkpoint"):
                time.sleep(checkpoint_s)


def _hf_run(log_dir: Path) -> None:
    """A tiny GPT-2 trained by the Hugging Face Trainer with ``ResourceGuardCallback``, its report in
    ``log_dir``."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from resource_guard import ResourceGuardCallback

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    data = [{"input_ids": torch.arange(16) % 64, "labels": torch.arange(16) % 64}] * 16
    args = TrainingArguments(
        str(log_dir / "out"), use_cpu=True, per_device_train_batch_size=4, max_steps=6, report_to=[],
        save_strategy="no", disable_tqdm=True, logging_steps=2,
    )  # fmt: skip
    callback = ResourceGuardCallback(log_dir=log_dir)
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[callback]).train()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tb_runs")
    _guard_run(root / "fast", checkpoint_s=0.0)
    _guard_run(root / "slow_ckpt", checkpoint_s=0.03)
    write_lightning_run(root / "light", max_steps=12, log_every_n_steps=2)  # the profiler window: steps 8-10
    _hf_run(root / "hf")
    return root


@pytest.fixture(scope="module")
def client(logdir: Path) -> Any:
    from tensorboard.plugins import base_plugin

    plugin = ResourceGuardPlugin(base_plugin.TBContext(logdir=str(logdir)))
    apps = plugin.get_plugin_apps()

    def get(route: str, **args: str) -> Any:
        response = Client(apps[route]).get("/", query_string=args)
        if response.mimetype == "application/json":
            return response.status_code, json.loads(response.get_data(as_text=True))
        return response.status_code, response.get_data()

    get.plugin = plugin  # type: ignore[attr-defined]
    return get


LIGHTNING = "light/lightning_logs/version_0"


def test_runs_are_found_where_each_door_writes(logdir: Path, client: Any) -> None:
    names = [r.name for r in find_runs(logdir)]
    assert names == ["fast", "hf", LIGHTNING, "slow_ckpt"]
    # Lightning's report directory is <trainer.log_dir>/resource_guard; its events are in version_0
    light = next(r for r in find_runs(logdir) if r.name == LIGHTNING)
    assert light.report_dir == logdir / LIGHTNING / "resource_guard"
    assert light.event_dirs() == [logdir / LIGHTNING]
    status, runs = client("/runs")
    assert status == 200
    assert [(r["name"], r["report"], r["guard"]) for r in runs] == [
        ("fast", True, True),
        ("hf", True, False),
        (LIGHTNING, True, False),
        ("slow_ckpt", True, True),
    ]
    plugin = client.plugin
    assert plugin.is_active()
    assert plugin.frontend_metadata().tab_name == TAB_NAME
    assert plugin.frontend_metadata().es_module_path == "/static/index.js"


@pytest.mark.parametrize("run", ["fast", LIGHTNING])
def test_overview_has_the_verdict_in_words_and_facts_in_units(client: Any, run: str, logdir: Path) -> None:
    status, data = client("/overview", run=run)
    assert status == 200
    report = json.loads(next(p for p in (logdir / run).rglob("report.json")).read_text())
    assert data["verdict"] == report["verdict"]
    # the verdict is the title of the finding it names, not its id
    named = next(f for f in report["findings"] if f["id"] == report["verdict"])
    assert data["verdict_text"] == named["title"]
    assert {f["id"] for f in data["findings"]} == {f["id"] for f in report["findings"]}
    facts = {f["name"]: f for f in data["facts"]}
    assert facts["step time"]["unit"] == "ms"
    assert facts["step time"]["value"] == pytest.approx(report["summary"]["step_time_s"] * 1000, abs=1e-3)
    assert facts["steps"]["value"] == report["summary"]["steps"]


def test_findings_ranked_by_the_time_they_cost(client: Any) -> None:
    status, data = client("/overview", run="slow_ckpt")
    assert status == 200
    timed = [f for f in data["findings"] if f["cost_ms"] is not None]
    assert timed, data["findings"]
    assert [f["cost_ms"] for f in timed] == sorted((f["cost_ms"] for f in timed), reverse=True)
    assert data["findings"][: len(timed)] == timed  # those not about time come after
    first = timed[0]
    assert first["id"] == "checkpoint-io"
    assert 0 < first["share_pct"] <= 100
    assert first["gain_pct"] > 0
    assert first["fix"]


def test_step_time_has_one_series_per_phase_that_is_not_always_zero(client: Any) -> None:
    status, data = client("/steps", run="slow_ckpt")
    assert status == 200
    assert "checkpoint" in data["series"]
    assert "evaluation" not in data["series"] and "communication" not in data["series"]
    assert data["bars"] and all(set(b["phases_ms"]) == set(data["series"]) for b in data["bars"])
    for bar in data["bars"][1:]:  # the phases add up to the step (ms), the first step's warm-up aside
        assert sum(bar["phases_ms"].values()) == pytest.approx(bar["step_ms"], rel=0.05)
    assert sum(r["share_pct"] for r in data["table"]) == pytest.approx(100, abs=0.1)
    checkpoint = next(r for r in data["table"] if r["phase"] == "checkpoint")
    assert checkpoint["ms"] >= 25  # the 30 ms sleep, in ms


def test_step_time_of_a_lightning_run(client: Any) -> None:
    status, data = client("/steps", run=LIGHTNING)
    assert status == 200
    assert {"forward", "backward", "optimizer"} <= set(data["series"])
    steps = [b["step"] for b in data["bars"]]
    assert steps[:4] == [1, 2, 4, 6] and all(s % 2 == 0 for s in steps[1:])  # log_every_n_steps=2


def test_memory_against_the_capacity_the_plan_used(client: Any, logdir: Path) -> None:
    status, data = client("/memory", run="fast")
    assert status == 200
    planned = json.loads((logdir / "fast" / "guard.json").read_text())["plan"]
    assert data["capacity_mib"] == pytest.approx(planned["capacity_bytes"] / 2**20, abs=0.01)
    assert data["capacity_source"] == "the plan's"
    assert data["usable_mib"] == pytest.approx(planned["usable_bytes"] / 2**20, abs=0.01)
    assert data["estimate_mib"] == pytest.approx(planned["predicted_peak_bytes"] / 2**20, abs=0.01)
    tags = {s["tag"] for s in data["series"]}
    assert "resource_guard/4_memory/rss_peak_mib" in tags  # a CPU run: the RSS's peak, in MiB
    assert all(isinstance(p[1], float) for s in data["series"] for p in s["points"])


def test_memory_of_a_lightning_run_has_a_capacity_and_its_picture(client: Any) -> None:
    status, data = client("/memory", run=LIGHTNING)
    assert status == 200
    assert data["capacity_mib"] is not None and data["picture"] is True
    status, png = client("/memory.png", run=LIGHTNING)
    assert status == 200 and png[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_from_guard_json_and_from_lightning_text(client: Any) -> None:
    status, data = client("/plan", run="fast")
    assert status == 200 and data["has_plan"]
    config = {c["name"]: c["value"] for c in data["configuration"]}
    assert config["micro-batch"] == 4 and config["device"] == "cpu"
    assert data["reasons"]
    assert any(a["chosen"] for a in data["alternatives"])
    assert {e["name"] for e in data["estimate"]} >= {"method", "target"}
    status, data = client("/plan", run=LIGHTNING)
    assert status == 200 and data["has_plan"]
    assert data["markdown"].startswith("ResourceGuard plan")


def test_compare_names_the_phase_that_changed(client: Any, logdir: Path, capsys: Any) -> None:
    status, data = client("/compare", a="fast", b="slow_ckpt")
    assert status == 200
    assert data["changed_phase"] == "checkpoint"
    assert "checkpoint changed most" in data["headline"]
    assert data["step_ms"]["delta"] > 20
    assert main(["compare", str(logdir / "fast"), str(logdir / "slow_ckpt")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Step time") and "checkpoint changed most" in out


def test_unknown_runs_are_refused(client: Any, logdir: Path, capsys: Any) -> None:
    assert client("/overview", run="../etc")[0] == 404
    assert client("/compare", a="fast", b="nope")[0] == 404
    assert client("/memory.png", run="nope")[0] == 404
    assert main(["compare", str(logdir / "fast"), str(logdir / "nope")]) == 2
    assert "no readable report.json" in capsys.readouterr().err


def test_static_files_only_the_frontend(client: Any) -> None:
    static = Client(client.plugin.get_plugin_apps()["/static/*"])
    page = static.get("/data/plugin/resource_guard/static/index.js")
    assert page.status_code == 200 and page.mimetype == "text/javascript"
    assert b"export async function render()" in page.get_data()
    assert static.get("/data/plugin/resource_guard/static/style.css").mimetype == "text/css"
    assert static.get("/data/plugin/resource_guard/static/plugin.py").status_code == 404


def test_compare_reports_of_identical_runs_changes_nothing() -> None:
    report = {
        "summary": {"step_time_s": 0.1, "phases": {"forward": 0.1}},
        "findings": [],
        "verdict": "healthy",
    }
    data = compare_reports(report, report)
    assert data["changed_phase"] is None and data["step_ms"]["delta"] == 0


def test_ops_of_a_profiled_run_per_step_with_shares(client: Any) -> None:
    """The Lightning run profiles its default window: op classes and top operators in ms per step, each
    share of the profiled step at most 100%, the classes ordered by time."""
    status, data = client("/ops", run=LIGHTNING)
    assert status == 200 and data["profiled"] is True and data["steps"] >= 1
    assert data["classes"] and data["top_ops"]
    times = [c["ms"] for c in data["classes"]]
    assert times == sorted(times, reverse=True) and all(t > 0 for t in times)
    shares = [c["share_pct"] for c in data["classes"]] + [o["share_pct"] for o in data["top_ops"]]
    assert all(s is not None and 0 < s <= 100 for s in shares)
    assert any(o["op"].startswith("aten::") for o in data["top_ops"])
    assert all(o["op"] and o["calls"] >= 1 and o["ms"] > 0 for o in data["top_ops"])


def test_ops_of_a_run_that_profiled_nothing(client: Any) -> None:
    status, data = client("/ops", run="fast")  # profile=False
    assert status == 200 and data == {"run": "fast", "profiled": False}


def test_a_hugging_face_run_is_read_by_every_view(client: Any, logdir: Path) -> None:
    hf = "hf"
    status, overview = client("/overview", run=hf)
    assert status == 200 and overview["verdict_text"]
    status, steps = client("/steps", run=hf)
    assert status == 200 and steps["mean_step_ms"] and steps["mean_step_ms"] > 0
    assert steps["table"] and abs(sum(r["share_pct"] for r in steps["table"]) - 100) < 1
    status, memory = client("/memory", run=hf)
    assert status == 200 and memory["capacity_mib"]
    status, plan = client("/plan", run=hf)  # report_to=[]: the plan's reasons from report.json
    assert status == 200 and plan["has_plan"] and "precision 32-true" in plan["markdown"]
    status, ops = client("/ops", run=hf)
    assert status == 200 and ops["profiled"] in (True, False)
