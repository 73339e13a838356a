"""Call sites are the user's lines that made the op (issue #37): the line of the call, not the line a
function starts at, with the module path for ops made inside a module's forward; the guard's own work
is never the user's."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from resource_guard.observe.profiling import ProfileWindow, StepProfiler


def _line(fn: object, marker: str) -> int:
    """The line of ``fn``'s source that carries ``marker``."""
    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return first + next(i for i, text in enumerate(lines) if marker in text)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float64)  # CAST
        return self.proj(h.float())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _train(steps: int, prof: StepProfiler, model: Net) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 32)).pow(2).mean()
        loss.backward()
        loss.item()  # SYNC
        prof.step()


def test_casts_and_syncs_name_the_line_of_the_call_and_the_module_path() -> None:
    model = Net()
    prof = StepProfiler(ProfileWindow(skip_first=0, wait=0, warmup=1, active=2), None)
    prof.start()
    _train(3, prof, model)
    summary = prof.summarize()
    assert summary is not None
    here = __file__.rsplit("/", 1)[-1]
    cast_line, sync_line = _line(Attn.forward, "# CAST"), _line(_train, "# SYNC")
    sites = [site for site, _, _ in summary.cast_sites]
    assert f"{here}:{cast_line} (forward) in blocks.*.attn (Attn)" in sites, sites  # the three blocks
    assert summary.sync_sites[0][0] == f"{here}:{sync_line} (_train)", summary.sync_sites
    assert not any(f":{_line(Attn.forward, 'def forward')} " in s for s in sites)  # not the def line


def _guarded_loop() -> tuple[object, int, int]:
    from torch.utils.data import DataLoader, TensorDataset

    from resource_guard import guard

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(14 * 8, 32), torch.randn(14 * 8, 32))
    window = ProfileWindow(skip_first=2, wait=0, warmup=1, active=3)
    with guard(model, optimizer, device="cpu", precision="32-true", log_dir=None, profile=window) as g:
        for x, y in g.iterate(DataLoader(data, batch_size=8)):
            loss = (model(x) - y).pow(2).mean()  # FORWARD
            g.backward(loss)
            float(loss.detach().double())  # USER-CAST
    return g.report, _line(_guarded_loop, "# USER-CAST"), _line(_guarded_loop, "# FORWARD")


def test_under_the_guard_the_user_s_lines_are_named_and_the_guard_s_own_work_is_its_own() -> None:
    """Issue #37: of an MNIST window's copies 240 came from the guard's own optimizer stepper and were
    named as the user's loop line. Ops the guard runs itself are labelled as its own work; the
    user's casts and scalar reads name the user's lines."""
    report, cast_line, forward_line = _guarded_loop()
    profile = report.stats.profile  # type: ignore[attr-defined]
    assert profile is not None
    here = Path(__file__).name
    sites = [s for s, _, _ in profile.cast_sites] + [s for s, _, _ in profile.sync_sites]
    assert f"{here}:{cast_line} (_guarded_loop)" in [s for s, _, _ in profile.cast_sites], sites
    assert any(s.startswith(f"{here}:{forward_line} (_guarded_loop) in ") for s in sites) or any(
        s.startswith(f"{here}:{_line(Attn.forward, '# CAST')} (forward) in blocks.*.attn (Attn)")
        for s in sites
    ), sites
    for site in sites:  # never a line inside resource_guard passed off as the user's
        assert site.startswith(here) or "(the guard's own work)" in site or site.startswith("(no user"), site
        assert "resource_guard/" not in site.split(" (the guard")[0] or "(the guard's own work)" in site
