"""Repeatability: the same input gives the same estimate, and estimating or planning leaves every piece
of global and caller state exactly as it was — also when the caller runs under a non-default state.

State checked: torch's CPU RNG, Python's ``random`` and numpy's RNG, the default dtype, grad mode,
inference mode, anomaly mode, autocast (enabled flag and CPU autocast dtype), the deterministic-
algorithms flags, ``torch.get_num_threads``; the model's training flags, ``requires_grad`` flags,
parameter data and grads; the optimizer's state and param groups; the batch's tensors. The CUDA RNG
must not even be touched (that would initialise CUDA).
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from resource_guard import estimate_memory, plan
from resource_guard.errors import ConfigurationError

TIMING_FIELDS = {"trace_seconds"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)  # draws from the RNG in training mode
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(h.mean(dim=(2, 3)))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def _setup(trained: bool = True) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = Net()
    model.conv.bias.requires_grad_(False)  # a frozen parameter must stay frozen
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"x": torch.randn(6, 3, 8, 8), "y": torch.randint(0, 4, (6,)), "tag": "b0"}
    if trained:  # optimizer state and grads exist, as in a resumed or mid-run estimate
        _loss(model, batch).backward()
        optimizer.step()
        _loss(model, batch).backward()  # leave grads in place
    model.eval()  # the caller's mode, which the estimate must not change
    return model, optimizer, batch


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> dict[str, Any]:
    return {
        "torch_rng": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "autocast_cpu_dtype": torch.get_autocast_dtype("cpu"),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "threads": torch.get_num_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn": (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "params": [p.detach().clone() for p in model.parameters()],
        "param_ids": [id(p) for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "optimizer_state": copy.deepcopy(optimizer.state_dict()),
        "optimizer_keys": [id(p) for p in optimizer.state],
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "group_params": [[id(p) for p in g["params"]] for g in optimizer.param_groups],
        "batch": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    changed = [key for key in before if not _same(before[key], after[key])]
    assert not changed, f"changed: {changed}"


@pytest.fixture
def no_cuda_rng(monkeypatch):
    """A context manager in which touching the CUDA RNG or initialising CUDA fails the test.

    (Only around the call under test: ``torch.manual_seed`` itself seeds CUDA lazily.)
    """

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the CUDA RNG / CUDA initialisation must not be touched")

    names = ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "manual_seed",
             "manual_seed_all", "seed", "seed_all", "init", "_lazy_init")  # fmt: skip

    @contextlib.contextmanager
    def guarded() -> Iterator[None]:
        with monkeypatch.context() as patch:
            for name in names:
                patch.setattr(torch.cuda, name, refuse)
            yield

    return guarded


def _estimate(model: nn.Module, optimizer: Any, batch: Any, **kwargs: Any) -> Any:
    return estimate_memory(model, optimizer, batch, _loss, **{"device": "cpu", **kwargs})


def _plan(model: nn.Module, optimizer: Any, batch: Any, **kwargs: Any) -> Any:
    return plan(model, optimizer, batch, _loss, **{"device": "cpu", "memory_limit": "64MiB", **kwargs})


def _comparable(est: Any) -> dict[str, Any]:
    out = {k: v for k, v in est.to_dict().items() if k not in TIMING_FIELDS}
    out.update(timeline=est.timeline, allocations=est.allocations, initial=est.initial_allocations)
    return out


# ---------------------------------------------------------------------------------------------------
# the same input gives the same estimate


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("device", ["cpu", "cuda", "a100-40gb"])
def test_two_estimates_of_the_same_input_are_identical(precision, device):
    model, optimizer, batch = _setup()
    first = _estimate(model, optimizer, batch, precision=precision, device=device)
    second = _estimate(model, optimizer, batch, precision=precision, device=device)
    assert _comparable(first) == _comparable(second)


def test_an_optimizer_factory_and_an_optimizer_give_the_same_estimate():
    model, _, batch = _setup(trained=False)
    made = torch.optim.AdamW(model.parameters(), lr=1e-3)
    by_instance = _estimate(model, made, batch)
    by_factory = _estimate(model, lambda params: torch.optim.AdamW(params, lr=1e-3), batch)
    assert by_instance.peak_bytes == by_factory.peak_bytes
    assert dict(by_instance.breakdown) == dict(by_factory.breakdown)


def test_two_plans_of_the_same_input_are_identical():
    model, optimizer, batch = _setup()
    first, second = _plan(model, optimizer, batch), _plan(model, optimizer, batch)
    a, b = first.to_dict(), second.to_dict()
    for d in (a, b):
        d["estimate"].pop("trace_seconds")
    assert a == b


# ---------------------------------------------------------------------------------------------------
# estimating and planning leave every piece of state as it was


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("call", [_estimate, _plan], ids=["estimate", "plan"])
def test_state_is_left_exactly_as_it_was(no_cuda_rng, call, precision):
    model, optimizer, batch = _setup()
    random.seed(7)
    np.random.seed(7)
    before = _snapshot(model, optimizer, batch)
    with no_cuda_rng():
        call(model, optimizer, batch, precision=precision)
    _assert_unchanged(before, _snapshot(model, optimizer, batch))


def test_a_model_in_training_mode_stays_in_training_mode():
    model, optimizer, batch = _setup()
    model.train()
    model.bn.eval()  # mixed modes: each module's flag is kept
    before = _snapshot(model, optimizer, batch)
    _estimate(model, optimizer, batch)
    _assert_unchanged(before, _snapshot(model, optimizer, batch))


def test_the_estimate_does_not_consume_the_callers_random_stream():
    model, optimizer, batch = _setup()
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    _estimate(model, optimizer, batch)
    assert torch.equal(torch.rand(4), expected)


def test_a_failing_trace_restores_state_too(no_cuda_rng):
    """The analytic fallback path (the trace raised) must restore state as well."""
    model, optimizer, batch = _setup()

    def broken(m: nn.Module, b: Any) -> torch.Tensor:
        torch.rand(3)  # consumes RNG before failing
        torch.set_default_dtype(torch.float64)  # and leaves a mess behind
        raise RuntimeError("cannot trace this")

    before = _snapshot(model, optimizer, batch)
    try:
        with no_cuda_rng(), pytest.warns(Warning, match="analytic"):
            est = estimate_memory(model, optimizer, batch, broken, device="cpu")
    finally:
        leaked_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
    assert est.method == "analytic"
    assert leaked_dtype == torch.float32
    _assert_unchanged(before, _snapshot(model, optimizer, batch))


# ---------------------------------------------------------------------------------------------------
# under a non-default state set by the caller: the estimate works (or says clearly why not), and
# the state is still as the caller set it afterwards


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _deterministic(warn_only: bool) -> Iterator[None]:
    old, old_warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old, warn_only=old_warn)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


CALLER_STATES: list[tuple[str, Callable[[], contextlib.AbstractContextManager[Any]]]] = [
    ("default-dtype-float64", lambda: _default_dtype(torch.float64)),
    ("default-dtype-bfloat16", lambda: _default_dtype(torch.bfloat16)),
    ("no-grad", torch.no_grad),
    ("inference-mode", torch.inference_mode),
    ("anomaly-detection", torch.autograd.detect_anomaly),
    ("deterministic", lambda: _deterministic(False)),
    ("deterministic-warn-only", lambda: _deterministic(True)),
    ("cpu-autocast-bf16", lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
    ("one-thread", lambda: _threads(1)),
]


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize("call", [_estimate, _plan], ids=["estimate", "plan"])
@pytest.mark.parametrize("state", [c[1] for c in CALLER_STATES], ids=[c[0] for c in CALLER_STATES])
def test_a_non_default_caller_state_works_and_is_kept(no_cuda_rng, state, call):
    model, optimizer, batch = _setup()
    reference = _estimate(model, optimizer, batch)
    with state():
        before = _snapshot(model, optimizer, batch)
        try:
            with no_cuda_rng():
                result = call(model, optimizer, batch)
        except ConfigurationError as error:  # allowed, if it says what to change
            assert "default dtype" in str(error) or "mode" in str(error)
            result = None
        after = _snapshot(model, optimizer, batch)
    _assert_unchanged(before, after)
    if result is not None:  # the caller's ambient state is not the training step's: same figures
        est = result if call is _estimate else result.estimate
        if call is _estimate:
            assert est.peak_bytes == reference.peak_bytes
        assert est.method == "traced"


def test_a_mixed_precision_estimate_inside_the_callers_autocast_is_conservative():
    """Inside the caller's autocast the step's autocast is nested, and PyTorch frees its cache of
    low-precision weight copies only when the outermost region ends: kept to the end of the step."""
    model, optimizer, batch = _setup()
    reference = _estimate(model, optimizer, batch, precision="bf16-mixed")
    with torch.autocast("cpu", dtype=torch.float16):
        nested = _estimate(model, optimizer, batch, precision="bf16-mixed")
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    weights = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    assert reference.peak_bytes <= nested.peak_bytes <= reference.peak_bytes + 2 * weights
