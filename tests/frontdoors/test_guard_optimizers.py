"""The plain-PyTorch `guard` with several optimizers (a GAN's loop): the pre-flight of the loop's own
step with every optimizer's state, the fit check, `g.backward(loss, optimizer=...)`, monitoring and
the report."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from resource_guard import ConfigurationError, DoesNotFitError, UserStep, guard

LATENT, DATA, WIDTH, BATCH = 16, 32, 64, 8


def build(seed: int = 0):
    torch.manual_seed(seed)
    g = nn.Sequential(nn.Linear(LATENT, WIDTH), nn.ReLU(), nn.Linear(WIDTH, DATA))
    d = nn.Sequential(nn.Linear(DATA, WIDTH), nn.LeakyReLU(0.2), nn.Linear(WIDTH, 1))
    model = nn.ModuleDict({"g": g, "d": d})
    opt_g, opt_d = torch.optim.Adam(g.parameters(), lr=2e-4), torch.optim.Adam(d.parameters(), lr=2e-4)
    gen = torch.Generator().manual_seed(seed)
    loader = [
        (torch.randn(BATCH, DATA, generator=gen), torch.randn(BATCH, LATENT, generator=gen)) for _ in range(3)
    ]
    return model, opt_g, opt_d, loader


def losses(model, real, noise, fake=None):
    """The generator's loss (and its fake batch), or the discriminator's given the fake batch."""
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    if fake is None:
        fake = model["g"](noise)
        return F.binary_cross_entropy_with_logits(model["d"](fake), ones), fake
    real_loss = F.binary_cross_entropy_with_logits(model["d"](real), ones)
    return real_loss + F.binary_cross_entropy_with_logits(model["d"](fake.detach()), zeros)


def gan_step(s) -> None:
    """The same step, written for the pre-flight."""
    opt_g, opt_d = s.optimizers
    loss_g, fake = losses(s.model, *s.batch)
    s.backward(loss_g)
    opt_g.step()
    opt_g.zero_grad()
    opt_d.zero_grad()
    s.backward(losses(s.model, *s.batch, fake=fake))
    opt_d.step()
    opt_d.zero_grad()


def run_loop(g, model, opt_g, opt_d, loader) -> None:
    for real, noise in g.iterate(loader):
        with g.autocast():
            loss_g, fake = losses(model, real, noise)
        g.backward(loss_g, optimizer=opt_g)
        opt_d.zero_grad()  # the generator's backward went through the discriminator
        with g.autocast():
            loss_d = losses(model, real, noise, fake=fake)
        g.backward(loss_d, optimizer=opt_d)


def test_a_gans_loop_trains_under_guard_with_a_report(tmp_path):
    model, opt_g, opt_d, loader = build()
    before = [p.detach().clone() for p in model.parameters()]
    with guard(
        model, [opt_g, opt_d], loss_fn=UserStep(gan_step), device="cpu", log_dir=tmp_path, profile=False
    ) as g:
        run_loop(g, model, opt_g, opt_d, loader)
    assert g.optimizer_steps == 6 and g.micro_steps == 3
    assert g.plan.accumulation_steps == 1 and g.plan.micro_batch_size == BATCH
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # both were trained
    state = sum(
        v.untyped_storage().nbytes() for o in (opt_g, opt_d) for s in o.state.values() for v in s.values()
    )
    assert g.plan.estimate.breakdown["optimizer_state"] == state  # both optimizers' state, estimated
    assert (tmp_path / "report.md").is_file() and g.report is not None
    assert json.loads((tmp_path / "guard.json").read_text())["optimizer_steps"] == 6
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["steps"] == 3 and summary["flops_per_step"] > 0  # MFU counts every pass of the step


def test_nothing_fits_stops_before_any_step():
    model, opt_g, opt_d, loader = build()
    with pytest.raises(DoesNotFitError):
        with guard(
            model, [opt_g, opt_d], loss_fn=UserStep(gan_step), device="cpu", memory_limit="64KiB"
        ) as g:
            run_loop(g, model, opt_g, opt_d, loader)
    assert not opt_g.state and not opt_d.state and g.optimizer_steps == 0


def test_a_batch_that_only_fits_smaller_is_refused_not_split():
    model, opt_g, opt_d, _ = build()
    batch = (torch.randn(512, DATA), torch.randn(512, LATENT))  # activations outweigh the weights
    kwargs = dict(
        loss_fn=UserStep(gan_step), device="cpu", precision="32-true", monitor=False, sample_batch=batch
    )
    with guard(model, [opt_g, opt_d], **kwargs) as probe:
        pass
    cap = int(probe.plan.fit.device_total_bytes * 0.97)
    with pytest.raises(DoesNotFitError, match="no accumulation"):
        with guard(model, [opt_g, opt_d], memory_limit=cap, headroom=0.0, **kwargs):
            pass


def test_several_optimizers_are_checked_before_anything_runs():
    model, opt_g, opt_d, loader = build()
    # no user step: the loop must stay unchanged (its first step recorded); a sample batch or g.iterate
    # asks the guard to run the step, which it cannot know: refused before any step
    with pytest.raises(ConfigurationError, match=r"UserStep\(fn\)"):
        with guard(model, [opt_g, opt_d], sample_batch=loader[0], monitor=False):
            pass
    with pytest.raises(ConfigurationError, match=r"UserStep\(fn\).*records its first step"):
        with guard(model, [opt_g, opt_d], monitor=False) as g:
            for _ in g.iterate(loader):
                pass
    assert g.optimizer_steps == 0
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="not the model's"):
        guard(model, [opt_g, other], loss_fn=UserStep(gan_step))


def test_backward_must_name_one_of_the_guards_optimizers():
    model, opt_g, opt_d, loader = build()
    with guard(model, [opt_g, opt_d], loss_fn=UserStep(gan_step), device="cpu", monitor=False) as g:
        for real, noise in g.iterate(loader[:1]):
            loss_g, _ = losses(model, real, noise)
            with pytest.raises(ConfigurationError, match="must name one of the guard's 2 optimizers"):
                g.backward(loss_g)
    single, opt, _, loader = build()
    with guard(single, opt, device="cpu", monitor=False, loss_fn=lambda m, b: losses(m, *b)[0]) as g:
        for real, noise in g.iterate(loader[:1]):
            loss_g, _ = losses(single, real, noise)
            with pytest.raises(ConfigurationError, match="one of the guard's 1 optimizers"):
                g.backward(loss_g, optimizer=opt_d)
            assert g.backward(loss_g, optimizer=opt)  # the guard's own optimizer: the usual step
