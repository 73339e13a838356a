"""Which implementation an optimizer's step runs, for the optimizer-step finding."""

from __future__ import annotations

import torch

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


def test_the_foreach_gain_is_measured_on_tensors_shaped_like_the_parameters() -> None:
    """Many small tensors: the for-each path runs a few multi-tensor ops instead of ~10 per tensor, so
    it takes a fraction of the for-loop's time; the optimizer and its parameters are left alone."""
    params = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(200)]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, foreach=False)
    probe = foreach_probe(optimizer)
    assert probe is not None and 0.0 < probe["foreach_s"] < probe["for_loop_s"]
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not optimizer.state


def test_no_fraction_without_a_foreach_path_or_parameters() -> None:
    class Plain(torch.optim.Optimizer):
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            super().__init__(params, {"lr": 0.1})

    assert foreach_probe(Plain(_params())) is None
    frozen = [torch.nn.Parameter(torch.zeros(3), requires_grad=False)]
    assert foreach_probe(torch.optim.AdamW(frozen, foreach=False)) is None
