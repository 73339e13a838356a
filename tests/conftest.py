"""Shared pytest fixtures and hooks.

The report header names this CPU as the library sees it (its CPU profile, the ``ONEDNN_MAX_CPU_ISA``
cap included), so a failure report names the hardware every host-dependent decision read.

``--play-cpu ISA`` runs every test under another CPU's profile (:func:`resource_guard.devices.play_cpu`,
e.g. ``--play-cpu avx512_core_bf16`` on an AVX2 machine): the decisions that read the profile (the
planner's ``precision="auto"``, the kernel allowances) are that CPU's, while real kernels stay this
machine's (so the ``cpu_reference`` tests, which compare with a real step, keep this machine's profile).
It finds tests whose expectation depends on the CPU. A single test pins a CPU the same way,
``with play_cpu("avx2"):``.

Test isolation (issue #17: the suite passes in any order, ``pytest-randomly``'s default, and in parallel,
``-n 2``): every test starts from the same torch RNG state, and process-wide state that a test or the code
under test could leave behind is put back after it. State that code must never leave changed (torch's
global switches, the working directory) also fails the test that changed it, so a leak is found where
it happens rather than in whichever test runs next.

Hypothesis runs without its two clocks (the 200 ms per-example ``deadline`` and the ``too_slow`` health
check): on a busy machine they fail a test for the machine's load, not for the code.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from resource_guard.devices import cpu as cpu_module
from resource_guard.devices import cpu_summary, play_cpu

pytest_plugins = ("pytester",)  # tests/testing/ runs pytest in temporary projects

# torch.compile's on-disk kernel cache (TorchInductor: /tmp/torchinductor_<user>) outlives the process and
# is shared by every process of the user. A library whose compile was cut short (a killed run, a timed-out
# test) stays there truncated, and a later run with the same kernel loads it: "ImportError: ... .so: file
# too short" (CI, a serial run after earlier ones on the machine); two xdist workers compiling the same
# kernel at once did the same. Each pytest process (controller or worker) compiles into a fresh cache of its
# own, removed at exit; subprocesses it starts inherit it (xdist workers, which inherit the controller's,
# make their own). A cache the user names is kept.
_OWN_CACHE = "RESOURCE_GUARD_TESTS_INDUCTOR_CACHE"
if (
    "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    or os.environ.get(_OWN_CACHE) == os.environ["TORCHINDUCTOR_CACHE_DIR"]
):
    _worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _cache = tempfile.mkdtemp(prefix=f"torchinductor_{os.getuid()}_{_worker}_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ[_OWN_CACHE] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

settings.register_profile("no-clock", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("no-clock")


def _torch_state() -> dict[str, Any]:
    return {
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
        "intra-op threads": torch.get_num_threads(),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "anomaly detection": torch.is_anomaly_enabled(),
        "cpu autocast": torch.is_autocast_enabled("cpu"),
        "cwd": os.getcwd(),
    }


def _restore_torch_state(state: dict[str, Any]) -> None:
    torch.set_default_dtype(state["default dtype"])
    torch.set_grad_enabled(state["grad enabled"])
    torch.set_num_threads(state["intra-op threads"])
    torch.set_float32_matmul_precision(state["float32 matmul precision"])
    torch.use_deterministic_algorithms(state["deterministic algorithms"])
    torch.set_anomaly_enabled(state["anomaly detection"])
    torch.set_autocast_enabled("cpu", state["cpu autocast"])
    os.chdir(state["cwd"])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--play-cpu",
        default=None,
        metavar="ISA",
        help="run every test under another CPU profile (resource_guard.devices.play_cpu): avx512_core_bf16",
    )


@pytest.fixture(autouse=True)
def _played_cpu(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test under the CPU profile ``--play-cpu`` names (none: this machine's), but those that compare
    an estimate with a real step (marker ``cpu_reference``): the real kernels are this machine's, so the
    estimate must be for this machine too (CI plays other CPUs for them with ``ONEDNN_MAX_CPU_ISA``)."""
    isa = None if request.node.get_closest_marker("cpu_reference") else request.config.getoption("--play-cpu")
    with play_cpu(isa) if isa else contextlib.nullcontext():
        yield


@pytest.fixture(autouse=True)
def _isolated_process_state(_played_cpu: None) -> Iterator[None]:
    """Same torch seed for every test; environment, logging levels and the SIGINT handler put back;
    torch's global switches, the cwd and the played CPU profile checked (and put back) after each test."""
    torch.manual_seed(0)
    before = _torch_state()
    played = list(cpu_module._played)
    environ = dict(os.environ)
    # the root, ours, and Lightning's (a benchmark's main() run by a test quiets Lightning's to ERROR;
    # left so, a later test in the worker that reads Lightning's INFO lines saw none)
    names = ("", "resource_guard", "lightning", "lightning.pytorch", "pytorch_lightning")
    loggers = {name: logging.getLogger(name) for name in names}
    levels = {name: logger.level for name, logger in loggers.items()}
    root_handlers = list(logging.getLogger().handlers)
    sigint = signal.getsignal(signal.SIGINT)
    yield
    after = _torch_state()
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    for name, logger in loggers.items():
        logger.setLevel(levels[name])
    logging.getLogger().handlers[:] = root_handlers
    signal.signal(signal.SIGINT, sigint)
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    if cpu_module._played != played:
        changed["played CPU profile"] = (played, list(cpu_module._played))
        cpu_module._played[:] = played
    if changed:
        _restore_torch_state(before)
        pytest.fail(f"the test left process-wide state changed (before, after): {changed}", pytrace=False)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"cpu: {cpu_summary()}"]
    isa = config.getoption("--play-cpu")
    if isa:
        with play_cpu(isa):
            lines.append(f"played cpu (--play-cpu): {cpu_summary()}")
    return lines
