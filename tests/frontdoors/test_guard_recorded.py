"""An unchanged loop with several optimizers (pytorch/examples' dcgan, in small): its first step recorded
through hooks and replayed for the plan (:mod:`resource_guard.frontdoors.guard.recorded`)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from resource_guard import DoesNotFitError, guard
from resource_guard.estimate.host.measure import allocation_deltas, live_bytes, peak_of
from resource_guard.estimate.host.quiet import quiet_profile

NZ, DATA, WIDTH, BATCH = 8, 48, 64, 8


def build() -> tuple[nn.ModuleDict, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    net_g = nn.Sequential(
        nn.Linear(NZ, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, DATA), nn.Tanh()
    )
    net_d = nn.Sequential(nn.Linear(DATA, WIDTH), nn.LeakyReLU(0.2), nn.Linear(WIDTH, 1), nn.Sigmoid())
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    return nn.ModuleDict({"netG": net_g, "netD": net_d}), [opt_d, opt_g]


def dcgan_loop(models: nn.ModuleDict, optimizers: list[torch.optim.Optimizer], steps: int) -> list[float]:
    """dcgan/main.py's loop as it is written: D on the real batch and on ``fake.detach()``, then G."""
    net_g, net_d = models["netG"], models["netD"]
    optimizer_d, optimizer_g = optimizers
    criterion = nn.BCELoss()
    gen = torch.Generator().manual_seed(1)
    errors = []
    for _ in range(steps):
        net_d.zero_grad()
        real = torch.rand(BATCH, DATA, generator=gen) * 2 - 1
        label = torch.full((BATCH,), 1.0)
        output = net_d(real).view(-1)
        err_d_real = criterion(output, label)
        err_d_real.backward()
        noise = torch.randn(BATCH, NZ, generator=gen)
        fake = net_g(noise)
        label.fill_(0.0)
        output = net_d(fake.detach()).view(-1)
        err_d_fake = criterion(output, label)
        err_d_fake.backward()
        optimizer_d.step()
        net_g.zero_grad()
        label.fill_(1.0)
        output = net_d(fake).view(-1)
        err_g = criterion(output, label)
        err_g.backward()
        optimizer_g.step()
        errors.append(err_g.item())
    return errors


def test_the_first_step_is_recorded_and_planned_and_the_loop_left_alone() -> None:
    models, optimizers = build()
    alone = dcgan_loop(models, optimizers, 4)
    models, optimizers = build()
    with guard(models, optimizers, monitor=False) as g:
        guarded = dcgan_loop(models, optimizers, 4)
    assert guarded == alone
    assert g.optimizer_steps == 4
    assert g.plan is not None and g.plan.precision == "32-true"
    assert g.plan.estimate.method.startswith("traced")
    line = next(r for r in g.plan.reasons if "first step recorded" in r)
    assert "4 forwards of netD, netG, 3 backwards, 2 optimizer steps" in line
    # the recording's wrappers and hooks are gone: the loop's objects are as they were
    assert all("zero_grad" not in vars(o) for o in (*optimizers, *models.children()))


def test_the_recorded_step_is_predicted_as_the_loop_runs_it() -> None:
    """Predicted peak against the real CPU peak of the same loop (profiler memory records): never under
    (the losses computed outside the models hold a target of each output's shape), within 2%."""
    models, optimizers = build()
    with guard(models, optimizers, monitor=False) as g:
        dcgan_loop(models, optimizers, 3)
    assert g.plan is not None
    predicted = g.plan.fit.allocated_peak_bytes
    models, optimizers = build()
    gc.collect()
    start = live_bytes(models, *optimizers)
    with quiet_profile() as prof:
        dcgan_loop(models, optimizers, 3)
    real = start + peak_of(allocation_deltas(prof))
    assert real <= predicted <= real * 1.02


def test_a_recorded_step_that_does_not_fit_stops_before_the_second_step() -> None:
    models, optimizers = build()
    with guard(models, optimizers, monitor=False) as g:
        dcgan_loop(models, optimizers, 1)
    assert g.plan is not None
    limit = int(g.plan.fit.allocated_peak_bytes * 0.8)
    models, optimizers = build()
    calls: list[str] = []
    with pytest.raises(DoesNotFitError, match="recorded from its first step"):
        with guard(models, optimizers, monitor=False, memory_limit=limit):
            for name, child in models.named_children():  # after the guard's hooks; the real models only
                child.register_forward_pre_hook(
                    lambda m, _, n=name, c=child: calls.append(n) if m is c else None
                )
            dcgan_loop(models, optimizers, 3)
    assert calls == ["netD", "netG", "netD", "netD"]  # the first step ran; the second never started


def test_the_recorded_loop_is_monitored_and_reported(tmp_path) -> None:
    import json

    models, optimizers = build()
    with guard(models, optimizers, log_dir=tmp_path, profile=False) as g:
        dcgan_loop(models, optimizers, 5)
    observed = json.loads((tmp_path / "guard.json").read_text())["observed"]
    assert observed["optimizer_steps"] == 5 and observed["accumulation"] is None
    assert observed["samples_per_step"] == BATCH  # the step's first forward's batch, not every forward's
    report = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert report["steps"] == 4  # the monitor starts once the recorded step is planned
    assert g.report is not None
