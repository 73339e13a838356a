"""Nothing of torch's internals on the user's console: the profiler's native start/stop lines and the
fake-tensor log of a failed meta kernel are silenced by the library; fd 2 always comes back."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from resource_guard.estimate.host.quiet import native_stderr_silenced, quiet_profile, torch_logs_silenced

NATIVE_NOISE = re.compile(r"USDT:|SyncActivityProfilerHandler|fake_tensor\.py")

_ESTIMATES = textwrap.dedent(
    """
    import warnings
    import torch
    from torch import nn
    from resource_guard import estimate_memory, measure_training_step

    warnings.simplefilter("ignore")
    loss = lambda m, b: m(b).float().square().mean()
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8))
    est = estimate_memory(mlp, torch.optim.AdamW, torch.randn(32, 64), loss, precision="bf16-mixed",
                          device="cpu")
    measure_training_step(mlp, torch.optim.AdamW(mlp.parameters()), torch.randn(32, 64), loss,
                          precision="bf16-mixed")

    class Broken(nn.Module):  # its fake matmul fails: the estimator falls back, torch logs the error
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return (self.lin(x) @ torch.ones(3, 3)).sum()

    broken = Broken()
    fallback = estimate_memory(broken, torch.optim.SGD(broken.parameters(), lr=0.1), torch.randn(8, 16))
    print(est.method, fallback.method)
    """
)


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_preflight_and_bf16_cpu_estimates_print_no_native_log_lines() -> None:
    preflight = _run(["-c", "import sys; from resource_guard.cli import main; sys.exit(main(sys.argv[1:]))",
                      "preflight", "--device", "cpu", "--precision", "bf16-mixed"])  # fmt: skip
    assert "bf16-mixed" in preflight.stdout
    estimates = _run(["-c", _ESTIMATES])
    assert estimates.stdout.split() == ["traced", "analytic"]
    for done in (preflight, estimates):
        assert not NATIVE_NOISE.search(done.stderr), done.stderr[-3000:]


def test_fd2_is_restored_and_the_error_propagates(capfd: pytest.CaptureFixture[str]) -> None:
    os.write(2, b"before\n")
    with pytest.raises(ValueError, match="the user's own"), native_stderr_silenced():
        os.write(2, b"hidden\n")
        raise ValueError("the user's own error")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "before\nafter\n"


def test_nested_and_concurrent_silencing_leaves_fd2_as_it_was(capfd: pytest.CaptureFixture[str]) -> None:
    before = os.fstat(2)

    def work() -> None:
        for _ in range(50):
            with native_stderr_silenced(), native_stderr_silenced():
                os.write(2, b"hidden\n")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    os.write(2, b"visible\n")
    assert capfd.readouterr().err == "visible\n"


def test_quiet_profile_keeps_what_runs_inside_on_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    with quiet_profile() as prof:
        os.write(2, b"the user's line\n")
        torch.zeros(256)
    assert capfd.readouterr().err == "the user's line\n"
    assert prof.profiler is not None


def test_torch_logger_state_is_restored_even_after_an_error() -> None:
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    assert not logger.disabled
    with pytest.raises(RuntimeError), torch_logs_silenced():
        with torch_logs_silenced():
            assert logger.disabled
        assert logger.disabled  # the outer block still holds it
        raise RuntimeError("boom")
    assert not logger.disabled


def test_an_estimate_leaves_the_users_own_profiler_session_alone(capfd: pytest.CaptureFixture[str]) -> None:
    from torch import nn

    from resource_guard import estimate_memory

    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        est = estimate_memory(model, torch.optim.SGD, torch.randn(16, 64), lambda m, b: m(b).float().sum(),
                              precision="bf16-mixed", device="cpu")  # fmt: skip
        torch.mm(torch.ones(4, 4), torch.ones(4, 4))
    assert est.method == "traced"
    assert any(e.name == "aten::mm" for e in prof.events())  # the user's session recorded to the end
    assert "no active profiling session" not in capfd.readouterr().err
