"""The Resource Guard tab in a real browser: TensorBoard serves a freshly written demo run and a Lightning
run, headless Chromium (Debian's, driven over the DevTools protocol by ``cdp_client``) opens the tab, and
the assertions read the page. A screenshot of each view is kept in the demo run's log dir
(``<tmp>/runs/demo/screenshots/``), as the CI artifact."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdp_client import Browser, chromium_binary
from lightning_run import write_lightning_run
from resource_guard.demo import run_demo

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        chromium_binary() is None,
        reason="no chromium binary on PATH (Debian: apt-get install -y chromium; or set $CHROMIUM)",
    ),
]

LIGHTNING = "light/lightning_logs/version_0"
FRAME = "document.querySelector('iframe') && document.querySelector('iframe').contentDocument"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    run_demo(steps=3, batch_size=4, seq_len=16, log_dir=str(root / "demo"))
    write_lightning_run(root / "light", max_steps=12, log_every_n_steps=1)  # profiled: steps 8-10
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(runs: Path) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(runs), "--port", str(port)]
        + ["--host", "127.0.0.1", "--load_fast=false"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                listing = json.loads(urllib.request.urlopen(f"{url}/data/plugins_listing", timeout=5).read())
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr and proc.poll() is not None else ""
                    pytest.fail(f"TensorBoard did not start on {url}: {err[-2000:]}")
                time.sleep(0.3)
        assert listing["resource_guard"]["enabled"], listing["resource_guard"]
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def page(server: str) -> Iterator[Browser]:
    binary = chromium_binary()
    assert binary is not None
    with Browser(binary, width=1600, height=1200) as browser:
        browser.navigate(f"{server}/#resource_guard")
        browser.wait_for(f"!!({FRAME} && ({FRAME}).querySelector('#rg-main[data-state=ready]'))", 60)
        yield browser


def _route(server: str, path: str) -> Any:
    return json.loads(
        urllib.request.urlopen(f"{server}/data/plugin/resource_guard/{path}", timeout=10).read()
    )


def _show(page: Browser, view: str, run: str = "demo") -> None:
    """Select ``run`` and ``view`` in the tab and wait until the view is drawn."""
    page.evaluate(
        f"(() => {{ const d = {FRAME}; const s = d.querySelector('#run-a');"
        f" if (s.value !== {json.dumps(run)}) {{ s.value = {json.dumps(run)};"
        " s.dispatchEvent(new Event('change')); } })()"
    )
    page.wait_for(f"!!({FRAME}).querySelector('#rg-main[data-state=ready]')")
    page.evaluate(f"({FRAME}).querySelector('nav.views button[data-view={view}]').click()")
    page.wait_for(f"!!({FRAME}).querySelector('#rg-main[data-state=ready][data-view={view}]')")


def _in(page: Browser, js: str) -> Any:
    """``js`` evaluated with ``d`` the tab's document."""
    return page.evaluate(f"(() => {{ const d = {FRAME}; return {js}; }})()")


def _visible_without_scrolling(page: Browser, selector: str) -> bool:
    """The element's box lies inside the 1600x1200 window (the iframe's offset included)."""
    box = page.evaluate(
        "(() => { const f = document.querySelector('iframe'); const o = f.getBoundingClientRect();"
        f" const e = f.contentDocument.querySelector({json.dumps(selector)}); if (!e) return null;"
        " const r = e.getBoundingClientRect();"
        " return {top: o.top + r.top, bottom: o.top + r.bottom, h: r.height, wh: window.innerHeight}; })()"
    )
    return bool(box) and box["h"] > 0 and box["top"] >= 0 and box["bottom"] <= box["wh"]


def _shot(page: Browser, runs: Path, view: str) -> None:
    path = page.screenshot(runs / "demo" / "screenshots" / f"{view}.png")
    assert path.stat().st_size > 10_000


def test_overview_shows_the_verdict_and_the_first_finding(page: Browser, server: str, runs: Path) -> None:
    assert "resource guard" in page.evaluate("document.body.innerText").lower()  # the tab
    _show(page, "overview")
    expected = _route(server, "overview?run=demo")
    assert _in(page, "d.querySelector('#verdict').innerText") == expected["verdict_text"]
    first = expected["findings"][0]
    assert _in(page, "d.querySelector('.finding .title').innerText") == first["title"]
    share = _in(page, "d.querySelector('.finding .share').innerText")
    shown = re.match(r"([\d.]+)% of the step", share)
    assert shown is not None, share
    assert float(shown.group(1)) == pytest.approx(first["share_pct"], abs=0.051)  # one decimal shown
    assert _visible_without_scrolling(page, "#verdict")
    assert _visible_without_scrolling(page, ".finding .share")
    _shot(page, runs, "overview")


def test_step_chart_has_one_series_per_non_empty_phase(page: Browser, server: str, runs: Path) -> None:
    _show(page, "steps")
    expected = _route(server, "steps?run=demo")
    drawn = _in(page, "[...d.querySelectorAll('#step-chart g.series')].map(g => g.dataset.phase)")
    assert drawn == expected["series"]
    assert {"forward", "backward", "optimizer"} <= set(drawn)
    bars = _in(page, "d.querySelectorAll('#step-chart g.series[data-phase=forward] rect').length")
    assert bars == len(expected["bars"]) >= 2
    assert _in(page, "d.querySelectorAll('#share-table tbody tr').length") == len(expected["table"])
    _shot(page, runs, "steps")


@pytest.mark.parametrize("run", ["demo", LIGHTNING])
def test_memory_chart_has_the_capacity_line(page: Browser, server: str, runs: Path, run: str) -> None:
    _show(page, "memory", run)
    expected = _route(server, f"memory?run={run}")
    capacity = _in(page, "d.querySelector('#memory-chart line.limit.capacity')?.dataset.mib")
    assert capacity is not None and float(capacity) == pytest.approx(expected["capacity_mib"])
    if run == "demo":  # the plan's: 256 MiB and its usable line
        assert expected["capacity_mib"] == 256.0
        assert _in(page, "!!d.querySelector('#memory-chart line.limit.usable')")
        assert _in(page, "!!d.querySelector('#memory-chart line.limit.estimate')")
    width = _in(
        page, "d.querySelector('#memory-picture').naturalWidth === d.querySelector('#memory-picture').width"
    )
    assert width  # the picture at full size
    _shot(page, runs, "memory" if run == "demo" else "memory_lightning")


def test_plan_view(page: Browser, runs: Path) -> None:
    _show(page, "plan")
    assert _in(page, "d.querySelectorAll('#plan-alternatives tbody tr.chosen').length") == 1
    assert _in(page, "d.querySelectorAll('#plan-reasons li').length") > 0
    _shot(page, runs, "plan")


def test_compare_names_the_phase_that_changed(page: Browser, server: str, runs: Path) -> None:
    _show(page, "compare")
    expected = _route(server, f"compare?a=demo&b={LIGHTNING}")
    assert expected["changed_phase"] is not None
    headline = _in(page, "d.querySelector('#compare-headline').innerText")
    assert headline == expected["headline"]
    assert f"{expected['changed_phase_label']} changed most" in headline
    row = _in(page, "d.querySelector('#compare-phases tr.changed').dataset.phase")
    assert row == expected["changed_phase"]
    _shot(page, runs, "compare")


def test_ops_view_shows_the_op_classes_and_top_ops(page: Browser, server: str, runs: Path) -> None:
    expected = _route(server, f"ops?run={LIGHTNING}")
    assert expected["profiled"] and expected["classes"]
    _show(page, "ops", run=LIGHTNING)
    assert _in(page, "d.querySelectorAll('#ops-classes tbody tr').length") == len(expected["classes"])
    assert _in(page, "d.querySelectorAll('#ops-top tbody tr').length") == len(expected["top_ops"])
    first = _in(page, "d.querySelector('#ops-classes tbody tr td').innerText")
    assert first == expected["classes"][0]["class"]
    _shot(page, runs, "ops")
    _show(page, "ops")  # the demo's 3 steps end before the profiler's window: said so, not an empty table
    assert "profiled no step" in _in(page, "d.querySelector('#rg-main p.empty').innerText")
