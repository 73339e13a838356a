"""Per-operator recovery: operators whose fake kernel fails are recovered, recorded, and stay exact.

Each model is tiny and written with plain torch, so that what is recovered is known: a CPU-valid dtype
the meta kernel refuses (``_grouped_mm``), a data-dependent output shape (``_ctc_loss``), Python-level
reads of values (``.all()`` checks, LayerDrop, ``.numpy()``), an op whose output size depends on the
values (``unique``), and autograd's in-place gradient accumulation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from resource_guard import ResourceGuardWarning
from resource_guard.estimate import estimate_memory, measure_training_step
from resource_guard.estimate.result import ANALYTIC, TRACED, TRACED_RECOVERED
from resource_guard.estimate.trace import recovery


def _truth(build, precision: str = "32-true") -> int:
    model, opt, batch, loss_fn = build()
    return measure_training_step(model, opt, batch, loss_fn, precision=precision).peak_bytes


def _estimate(build, precision: str = "32-true"):
    model, opt, batch, loss_fn = build()
    return estimate_memory(model, opt, batch, loss_fn, precision=precision, device="cpu")


# -- MoE: torch._grouped_mm, whose meta kernel insists on bf16 (CUDA's rule) -------------------------
class _Experts(nn.Module):
    def __init__(self, experts: int = 4, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.up = nn.Parameter(torch.randn(experts, dim, hidden) * 0.1)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = self.router(x).argmax(-1)
        order = expert.argsort()
        counts = torch.bincount(expert, minlength=self.up.shape[0])
        offs = counts.cumsum(0).to(torch.int32)
        h = F.gelu(torch._grouped_mm(x[order], self.up, offs=offs))
        return torch._grouped_mm(h, self.down, offs=offs).square().mean()


def _moe():
    torch.manual_seed(0)
    model = _Experts()
    return model, torch.optim.AdamW(model.parameters()), torch.randn(64, 32), lambda m, b: m(b)


@pytest.mark.cpu_reference
def test_grouped_mm_is_recovered_by_its_corrected_rule_and_exact():
    est = _estimate(_moe)
    assert est.method == TRACED_RECOVERED
    rule = [line for line in est.recovered_ops if line.startswith("`_grouped_mm`: a corrected fake rule")]
    assert rule == [  # 2 forward, 3 backward; the routing it holds for is said
        "`_grouped_mm`: a corrected fake rule (5x); tensor sizes do not depend on the MoE routing: any "
        "routing, the worst included"
    ]
    assert est.peak_bytes == pytest.approx(_truth(_moe), rel=0.01)


# -- speech: CTC loss, a data-dependent output shape ------------------------------------------------
class _Ctc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 12)

    def forward(self, batch: dict) -> torch.Tensor:
        log_probs = self.proj(batch["x"]).log_softmax(-1).transpose(0, 1)  # (T, B, C)
        lengths = torch.full((batch["x"].shape[0],), batch["x"].shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, batch["targets"], lengths, batch["target_lengths"])


def _ctc():
    torch.manual_seed(0)
    model = _Ctc()
    batch = {
        "x": torch.randn(3, 40, 16),
        "targets": torch.randint(1, 12, (3, 9)),
        "target_lengths": torch.tensor([9, 5, 7]),
    }
    return model, torch.optim.AdamW(model.parameters()), batch, lambda m, b: m(b)


@pytest.mark.cpu_reference
def test_ctc_loss_is_recovered_with_the_batchs_real_target_lengths():
    est = _estimate(_ctc)
    assert est.method == TRACED_RECOVERED
    assert {line.split(":")[0] for line in est.recovered_ops} == {"`_ctc_loss`", "`_ctc_loss_backward`"}
    assert est.peak_bytes == pytest.approx(_truth(_ctc), rel=0.005)  # log_beta scratch included


# -- Python-level reads of values nobody knows --------------------------------------------------------
class _Checks(nn.Module):
    """A DETR-style value check (must pass), a LayerDrop (must keep the layer), a numpy read."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).sigmoid()
        if not (h >= 0).all():  # always true for real; unknown on fake values
            raise ValueError("boxes must be non-negative")
        cost = h.detach()[:, :4].numpy()  # scipy-style matching on real values
        if not torch.rand([]) < 0.0:  # LayerDrop with p=0: the layer runs for real
            h = self.b(h)
        return h.square().mean() + float(cost.shape[0]) * 0.0


def _checks():
    torch.manual_seed(0)
    model = _Checks()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16), lambda m, b: m(b)


@pytest.mark.cpu_reference
def test_value_checks_pass_layerdrop_keeps_layers_numpy_reads_zeros():
    est = _estimate(_checks)
    assert est.method == TRACED_RECOVERED
    assert "`Tensor.numpy`: an assumed value (1x)" in est.recovered_ops
    assert any(line.startswith("`_local_scalar_dense`: an assumed value") for line in est.recovered_ops)
    assert est.peak_bytes == _truth(_checks)


def test_numpy_is_restored_after_the_trace():
    original = torch.Tensor.numpy
    _estimate(_checks)
    assert torch.Tensor.numpy is original
    assert torch.ones(2).numpy().tolist() == [1.0, 1.0]


# -- value-dependent output size: the real kernel on zeros, within the budget ----------------------------
class _Unique(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.sum() + torch.unique(y.detach()).float().sum() * 0.0


def test_an_op_with_a_value_dependent_size_runs_for_real_on_zeros_and_says_so():
    torch.manual_seed(0)
    model = _Unique()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    est = estimate_memory(model, opt, torch.randn(8, 16), device="cpu")
    assert est.method == TRACED_RECOVERED
    assert (
        "`_unique2`: the real kernel on zero tensors, value-dependent sizes widened to the largest input (1x)"
        in (est.recovered_ops)
    )
    assert any(w.startswith("recovered `") for w in est.warnings)


def test_above_the_budget_the_trace_falls_back_and_says_why(monkeypatch):
    monkeypatch.setattr(recovery, "REAL_BUDGET_BYTES", 0)
    model = _Unique()
    with pytest.warns(ResourceGuardWarning, match="unique"):
        est = estimate_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16))
    assert est.method == ANALYTIC and not est.traced
    assert "analytic upper bound" in est.method_line


# -- autograd's in-place gradient accumulation (a recurrent model's gradients fan in per time step) --------
class _Scan(nn.Module):
    def __init__(self, dim: int = 64, steps: int = 24) -> None:
        super().__init__()
        self.proj, self.steps = nn.Linear(dim, dim), steps
        self.decay = nn.Parameter(torch.rand(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        state = torch.zeros_like(h)
        for _ in range(self.steps):  # h is used at every step: its gradient accumulates 24 times
            state = state * self.decay + h.tanh()
        return state.square().mean()


def _scan():
    torch.manual_seed(0)
    model = _Scan()
    return model, torch.optim.AdamW(model.parameters()), torch.randn(128, 64), lambda m, b: m(b)


@pytest.mark.cpu_reference
def test_gradient_fan_in_is_accumulated_in_place_as_autograd_does():
    est = _estimate(_scan)
    assert est.method == TRACED
    assert est.peak_bytes == pytest.approx(_truth(_scan), rel=0.005)


# -- method summary ------------------------------------------------------------------------------------
def test_every_method_names_itself_in_one_line_and_in_json():
    plain = estimate_memory(nn.Linear(4, 2), torch.optim.SGD, torch.randn(8, 4), lambda m, b: m(b).sum())
    recovered = _estimate(_moe)
    assert plain.method == TRACED and plain.traced and plain.recovered_ops == ()
    assert plain.method_line.startswith("method: traced (")
    assert recovered.method_line.startswith("method: traced-recovered (2 operator(s) recovered: `_grouped")
    assert recovered.to_dict()["method"] == "traced-recovered"
    assert recovered.to_dict()["recovered_ops"] == list(recovered.recovered_ops)


# -- wrapped models ------------------------------------------------------------------------------------
def test_a_compiled_model_is_estimated_as_its_eager_step_and_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    batch = torch.randn(16, 32)
    eager = estimate_memory(model, torch.optim.AdamW, batch, lambda m, b: m(b).mean(), device="cpu")
    compiled = estimate_memory(
        torch.compile(model), torch.optim.AdamW, batch, lambda m, b: m(b).mean(), device="cpu"
    )
    assert compiled.peak_bytes == eager.peak_bytes and compiled.method == TRACED
    assert any("torch.compile" in w and "eager step" in w for w in compiled.warnings)


def test_a_ddp_wrapped_model_is_estimated_as_its_local_module(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        batch = torch.randn(16, 32)
        plain = estimate_memory(model, torch.optim.AdamW, batch, lambda m, b: m(b).mean(), device="cpu")
        wrapped = nn.parallel.DistributedDataParallel(model)
        est = estimate_memory(wrapped, torch.optim.AdamW, batch, lambda m, b: m(b).mean(), device="cpu")
    finally:
        dist.destroy_process_group()
    assert est.peak_bytes == plain.peak_bytes
    assert any("DDP-wrapped" in w for w in est.warnings)
