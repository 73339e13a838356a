"""Which implementation an optimizer's step runs, for the optimizer-step finding."""

from __future__ import annotations

import torch

from resource_guard.observe import optimizer_facts
from resource_guard.observe.optimizer_facts import describe_optimizer, foreach_probe


def _params(n: int = 4) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3)) for _ in range(n)]


def test_for_loop_foreach_and_fused_are_told_apart() -> None:
    assert describe_optimizer(torch.optim.AdamW(_params(), foreach=False))["for_loop"] is True
    assert describe_optimizer(torch.optim.AdamW(_params(), foreach=True))["for_loop"] is False
    facts = describe_optimizer(torch.optim.AdamW(_params(5)))
    # unset on CPU tensors: PyTorch's default is the for-loop (for-each is picked for CUDA only)
    assert facts["for_loop"] is True and facts["tensors"] == 5 and facts["fused_available"] is True


def test_an_optimizer_without_a_foreach_path_is_not_called_slow() -> None:
    class Plain(torch.optim.Optimizer):
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {"lr": 0.1})

    facts = describe_optimizer(Plain(_params()))
    assert facts["for_loop"] is False and facts["name"] == "Plain"


class _Recording(torch.optim.AdamW):
    """AdamW that records the ``foreach`` flag and the tensor shapes of every instance made."""

    made: list[tuple[bool | None, list[tuple[int, ...]]]] = []

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 1e-2, foreach: bool | None = None):
        params = list(params)
        _Recording.made.append((foreach, [tuple(p.shape) for p in params]))
        super().__init__(params, lr=lr, weight_decay=weight_decay, foreach=foreach)


def test_the_probe_steps_both_paths_on_tensors_shaped_like_the_parameters(monkeypatch) -> None:
    """Which path is faster is this machine's answer (benchmarks/optimizer_probe.py prints it); what the
    probe must do is step the optimizer's own class on zero tensors shaped like the parameters, once per
    path, and leave the optimizer and its parameters alone."""
    params = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(200)]
    before = [p.detach().clone() for p in params]
    optimizer = _Recording(params, foreach=False)
    _Recording.made.clear()
    ticks = iter(range(10**6))  # a clock that advances one second per reading: every step "takes" 1 s
    monkeypatch.setattr(optimizer_facts.time, "perf_counter", lambda: float(next(ticks)))
    probe = foreach_probe(optimizer)
    assert probe == {"for_loop_s": 1.0, "foreach_s": 1.0}
    assert [flag for flag, _ in _Recording.made] == [False, True]
    assert all(shapes == [(16, 16)] * 200 for _, shapes in _Recording.made)
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not optimizer.state


def test_a_large_model_is_probed_on_every_kth_tensor_and_scaled(monkeypatch) -> None:
    params = [torch.nn.Parameter(torch.zeros(16, 16)) for _ in range(200)]
    optimizer = _Recording(params, foreach=False)
    _Recording.made.clear()
    monkeypatch.setattr(optimizer_facts, "_PROBE_ELEMENTS", 50 * 16 * 16)  # stride 4: 50 tensors stepped
    ticks = iter(range(10**6))
    monkeypatch.setattr(optimizer_facts.time, "perf_counter", lambda: float(next(ticks)))
    probe = foreach_probe(optimizer)
    assert [len(shapes) for _, shapes in _Recording.made] == [50, 50]
    assert probe == {"for_loop_s": 4.0, "foreach_s": 4.0}  # 1 s each, times 200 / 50


def test_no_fraction_without_a_foreach_path_or_parameters() -> None:
    class Plain(torch.optim.Optimizer):
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {"lr": 0.1})

    assert foreach_probe(Plain(_params())) is None
    frozen = [torch.nn.Parameter(torch.zeros(3), requires_grad=False)]
    assert foreach_probe(torch.optim.AdamW(frozen, foreach=False)) is None


def test_the_probe_costs_the_close_what_its_budget_allows(monkeypatch) -> None:
    """Given the run's measured step, the probe steps fewer tensors (every k-th, scaled by k) so that its
    few steps fit the budget: a step of 1 s and a budget of 0.3 s leave a twentieth of 200 tensors."""
    params = [torch.nn.Parameter(torch.zeros(16, 16)) for _ in range(200)]
    optimizer = _Recording(params, foreach=False)
    _Recording.made.clear()
    ticks = iter(range(10**6))
    monkeypatch.setattr(optimizer_facts.time, "perf_counter", lambda: float(next(ticks)))
    probe = foreach_probe(optimizer, step_s=1.0)
    assert [len(shapes) for _, shapes in _Recording.made] == [10, 10]  # stride ceil(6 * 1.0 / 0.3) = 20
    assert probe == {"for_loop_s": 20.0, "foreach_s": 20.0}
    _Recording.made.clear()
    foreach_probe(optimizer, step_s=1e-4)  # a cheap step: the element cap alone decides (all 200)
    assert [len(shapes) for _, shapes in _Recording.made] == [200, 200]
