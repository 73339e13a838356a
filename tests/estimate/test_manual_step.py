"""A user-written step (`UserStep`): a GAN's two optimizers stepped by hand, estimated as written and
compared with the same step run for real on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cpu_reference import reference_checked, skip_unless_cpu_runs
from resource_guard import ConfigurationError, DoesNotFitError, plan
from resource_guard.estimate import UserStep, estimate_memory, measure_user_step

LATENT, DATA, WIDTH, BATCH = 64, 256, 512, 128


def build_gan(seed: int = 0) -> tuple[nn.Module, list[torch.optim.Optimizer], tuple[torch.Tensor, ...]]:
    """A generator and a discriminator (MLPs), Adam and AdamW, and a batch ``(real, noise)``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    g = nn.Sequential(
        nn.Linear(LATENT, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, DATA),
        nn.Tanh(),
    )
    d = nn.Sequential(
        nn.Linear(DATA, WIDTH),
        nn.LeakyReLU(0.2),
        nn.Linear(WIDTH, WIDTH),
        nn.LeakyReLU(0.2),
        nn.Linear(WIDTH, 1),
    )
    model = nn.ModuleDict({"g": g, "d": d})
    optimizers = [torch.optim.Adam(g.parameters(), lr=2e-4), torch.optim.AdamW(d.parameters(), lr=2e-4)]
    batch = (torch.randn(BATCH, DATA, generator=gen), torch.randn(BATCH, LATENT, generator=gen))
    return model, optimizers, batch


def gan_step(s) -> None:
    """One GAN step: the generator's loss, backward and step, then the discriminator's."""
    real, noise = s.batch
    g, d = s.model["g"], s.model["d"]
    opt_g, opt_d = s.optimizers
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    fake = g(noise)
    s.backward(F.binary_cross_entropy_with_logits(d(fake), ones))
    opt_g.step()
    opt_g.zero_grad()
    opt_d.zero_grad()  # the generator's backward went through the discriminator
    loss_d = F.binary_cross_entropy_with_logits(d(real), ones)
    loss_d = loss_d + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros)
    s.backward(loss_d)
    opt_d.step()
    opt_d.zero_grad()


@pytest.mark.cpu_reference
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gan_step_matches_a_real_cpu_step(precision):
    model, optimizers, batch = build_gan()
    est = estimate_memory(model, optimizers, batch, UserStep(gan_step), precision=precision, device="cpu")
    skip_unless_cpu_runs(est)
    real_model, real_optimizers, real_batch = build_gan()
    with reference_checked(est):
        truth = measure_user_step(
            real_model, real_optimizers, real_batch, UserStep(gan_step), precision=precision
        )
    assert est.traced
    assert abs(est.peak_bytes / truth.peak_bytes - 1) <= 0.03, (est.peak_bytes, truth.peak_bytes)


@pytest.mark.cpu_reference
def test_every_optimizers_state_is_counted_exactly():
    model, _, batch = build_gan()
    opt_g = torch.optim.Adam(model["g"].parameters())  # two moments and a step per parameter
    opt_d = torch.optim.SGD(model["d"].parameters(), lr=0.1, momentum=0.9)  # one momentum buffer
    est = estimate_memory(model, [opt_g, opt_d], batch, UserStep(gan_step), device="cpu")
    real_model = copy.deepcopy(model)
    real = [
        torch.optim.Adam(real_model["g"].parameters()),
        torch.optim.SGD(real_model["d"].parameters(), 0.1, 0.9),
    ]
    with reference_checked(est):
        measure_user_step(real_model, real, batch, UserStep(gan_step))
    state_bytes = sum(
        v.untyped_storage().nbytes()
        for o in real
        for s in o.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    assert est.breakdown["optimizer_state"] == state_bytes
    only_g = estimate_memory(model["g"], opt_g, batch[1], lambda m, b: m(b).mean(), device="cpu")
    assert est.breakdown["optimizer_state"] > only_g.breakdown["optimizer_state"]


def test_callers_model_optimizers_and_batch_are_untouched():
    model, optimizers, batch = build_gan()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    est = estimate_memory(model, optimizers, batch, UserStep(gan_step), device="cpu")
    assert est.peak_bytes > 0
    assert all(not o.state for o in optimizers)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _generator_step(backward_by_hand: bool):
    def step(s) -> None:
        real, noise = s.batch
        opt_g, opt_d = s.optimizers
        loss = F.mse_loss(s.model["d"](s.model["g"](noise)), torch.ones(real.shape[0], 1))
        loss.backward() if backward_by_hand else s.backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()

    return UserStep(step)


def test_plain_backward_counts_the_same_bytes():
    model, optimizers, batch = build_gan()
    through_context = estimate_memory(model, optimizers, batch, _generator_step(False), device="cpu")
    by_hand = estimate_memory(model, optimizers, batch, _generator_step(True), device="cpu")
    assert through_context.peak_bytes == by_hand.peak_bytes
    assert "backward" in through_context.phase_peak_bytes and "backward" not in by_hand.phase_peak_bytes


def test_several_optimizers_need_the_step_that_steps_them():
    model, optimizers, batch = build_gan()
    with pytest.raises(ConfigurationError, match=r"UserStep\(fn\)"):
        estimate_memory(model, optimizers, batch, lambda m, b: m["g"](b[1]).mean())
    with pytest.raises(ConfigurationError, match="not a torch.optim.Optimizer"):
        estimate_memory(
            model, [optimizers[0], lambda ps: torch.optim.SGD(ps, 0.1)], batch, UserStep(gan_step)
        )
    other = nn.Linear(3, 3)
    with pytest.raises(ConfigurationError, match="not the model's"):
        estimate_memory(
            model, [optimizers[0], torch.optim.SGD(other.parameters(), 0.1)], batch, UserStep(gan_step)
        )
    with pytest.raises(ConfigurationError, match="UserStep"):
        UserStep("not callable")  # type: ignore[arg-type]


def test_a_gpu_target_traces_the_step_with_the_foreach_optimizer():
    model, optimizers, batch = build_gan()
    cpu = estimate_memory(model, optimizers, batch, UserStep(gan_step), device="cpu")
    gpu = estimate_memory(model, optimizers, batch, UserStep(gan_step), device="cuda", precision="bf16-mixed")
    assert gpu.traced and "cuda" in gpu.assumed_target
    assert all(g.get("foreach") is None for o in optimizers for g in o.param_groups)  # the caller's untouched
    assert gpu.phase_peak_bytes["optimizer"] != cpu.phase_peak_bytes["optimizer"]


def test_plan_takes_a_user_step_and_fails_fast_under_a_cap():
    model, optimizers, batch = build_gan()
    made = plan(model, optimizers, batch, UserStep(gan_step), device="cpu", precision="32-true")
    assert made.micro_batch_size * made.accumulation_steps == BATCH
    assert made.estimate.breakdown["optimizer_state"] > 0
    with pytest.raises(DoesNotFitError):
        plan(model, optimizers, batch, UserStep(gan_step), device="cpu", memory_limit="1MiB")


@pytest.mark.cpu_reference
def test_a_step_that_cannot_be_traced_falls_back_to_an_upper_bound_with_every_optimizer():
    from torch._subclasses.fake_tensor import FakeTensor

    from resource_guard import ResourceGuardWarning

    def untraceable(s) -> None:
        if isinstance(s.batch[0], FakeTensor):
            raise RuntimeError("this step reads real values")
        gan_step(s)

    model, optimizers, batch = build_gan()
    with pytest.warns(ResourceGuardWarning, match="analytic upper bound"):
        est = estimate_memory(model, optimizers, batch, UserStep(untraceable), device="cpu")
    assert est.method == "analytic"
    real_model, real_optimizers, real_batch = build_gan()
    with reference_checked(est):
        truth = measure_user_step(real_model, real_optimizers, real_batch, UserStep(gan_step))
    assert est.peak_bytes >= truth.peak_bytes
    assert est.breakdown["optimizer_state"] >= state_of(real_optimizers)


def state_of(optimizers) -> int:
    return sum(v.untyped_storage().nbytes() for o in optimizers for s in o.state.values() for v in s.values())
