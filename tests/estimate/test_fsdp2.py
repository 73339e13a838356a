"""FSDP2 (``fully_shard``) modules: a traced per-rank estimate, read from the module; what is refused.

Unit tests run a real single-process gloo group (``fully_shard`` over one rank); the slow test runs
two real gloo ranks (``benchmarks/families.py``'s FSDP2 case) and compares with their measured peak.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from resource_guard import ConfigurationError, estimate_memory, measure_training_step, plan
from resource_guard.estimate.fsdp.fsdp2 import _unit_groups, is_fully_sharded, sharded_layout, unsharded_copy
from resource_guard.estimate.fsdp.fsdp2_step import ShardedEstimate

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo process group (``fully_shard`` needs one), torn down after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Block(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, depth: int = 4, dim: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _sharded(policy: object | None = None, *, per_block: bool = True) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Net()
    mp = policy if policy is not None else MixedPrecisionPolicy()
    if per_block:
        for b in model.blocks:
            fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _bf16(reduce: torch.dtype | None = None) -> object:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


BATCH = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))


def test_a_fully_sharded_module_gets_a_traced_per_rank_estimate_that_says_so(gloo: None) -> None:
    model = _sharded(_bf16())
    opt = torch.optim.AdamW(model.parameters())
    est = estimate_memory(model, opt, BATCH, _loss, device="cpu")
    assert isinstance(est, ShardedEstimate) and est.traced
    assert est.layout is not None and est.layout.world_size == 1
    assert est.layout.param_dtype == torch.bfloat16 and est.layout.master_dtype == torch.float32
    assert len(est.layout.units) == 5  # four blocks and the root
    assert [u.reshards for u in est.layout.units] == [
        False,
        True,
        True,
        True,
        True,
    ]  # the root stays gathered
    assert (
        "FSDP2 fully_shard over 1 rank, param_dtype bf16, reduce_dtype bf16, per-rank" in est.assumed_target
    )
    assert any(w.startswith("FSDP2 fully_shard over 1 rank") for w in est.warnings)
    assert est.peak_bytes == sum(est.breakdown.values())
    assert est.method_line.endswith(
        "FSDP2 fully_shard over 1 rank, param_dtype bf16, reduce_dtype bf16, per-rank"
    )
    assert est.to_dict()["sharding"] == est.layout.describe()
    # the caller's sharded model and optimizer are untouched: DTensor parameters, no gradients or state
    assert is_fully_sharded(model) and all(type(p).__name__ == "DTensor" for p in model.parameters())
    assert all(p.grad is None for p in model.parameters()) and not opt.state


@pytest.mark.cpu_reference
def test_one_rank_estimate_matches_the_real_fsdp2_step(gloo: None) -> None:
    for policy in (None, _bf16(torch.float32)):
        model = _sharded(policy)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        est = estimate_memory(model, opt, BATCH, _loss, device="cpu")
        real = measure_training_step(model, opt, BATCH, _loss)
        error = (est.peak_bytes - real.peak_bytes) / real.peak_bytes
        assert -0.02 <= error <= 0.03, (policy, est.peak_bytes, real.peak_bytes)


def test_the_policy_and_the_units_come_from_the_module(gloo: None) -> None:
    def peak(model: nn.Module, batch: torch.Tensor = BATCH) -> int:
        return estimate_memory(
            model, torch.optim.AdamW(model.parameters()), batch, _loss, device="cpu"
        ).peak_bytes

    fp32, bf16 = peak(_sharded()), peak(_sharded(_bf16()))
    assert bf16 < fp32  # bf16 gathered parameters and activations
    # one unit (the root only): the whole model stays gathered through forward and backward
    assert peak(_sharded(_bf16(), per_block=False)) > bf16
    # with few activations the peak is a unit's reduce-scatter: its copy of the gradients in fp32
    tiny = BATCH[:2]
    assert peak(_sharded(_bf16(torch.float32)), tiny) > peak(_sharded(_bf16()), tiny)


def test_an_optimizer_factory_and_autocast_on_top_are_taken(gloo: None) -> None:
    model = _sharded(_bf16())
    est = estimate_memory(model, torch.optim.SGD, BATCH, _loss, precision="bf16-mixed", device="cpu")
    assert est.traced and est.precision == "bf16-mixed" and est.breakdown["optimizer_state"] == 0


def test_fsdp2_state_is_read_where_torch_keeps_it(gloo: None) -> None:
    """FSDP2 has no public getter for a unit's policy: if torch moves it, this fails loudly."""
    model = _sharded(_bf16(torch.float32))
    (group,) = _unit_groups(model.blocks[0])
    assert group.mp_policy.param_dtype == torch.bfloat16 and group.mp_policy.reduce_dtype == torch.float32
    assert group.reshards and not group.offloads and len(group.params) == 4
    assert sharded_layout(model).reduce_dtype == torch.float32


def test_a_true_precision_unlike_the_parameters_is_refused(gloo: None) -> None:
    model = _sharded(_bf16())
    with pytest.raises(ConfigurationError, match="parameters are fp32.*MixedPrecisionPolicy"):
        estimate_memory(model, torch.optim.AdamW(model.parameters()), BATCH, _loss, precision="bf16-true")


def test_plan_refuses_a_module_already_sharded(gloo: None) -> None:
    model = _sharded()
    with pytest.raises(ConfigurationError, match="already sharded by fully_shard.*before fully_shard"):
        plan(model, torch.optim.AdamW, BATCH, _loss, device="cpu")


def test_fsdp1_is_refused_with_the_remedy(gloo: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation warning
        model = FullyShardedDataParallel(Net(), device_id=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="FSDP1's FullyShardedDataParallel.*fully_shard"):
        estimate_memory(model, torch.optim.AdamW(model.parameters()), BATCH, _loss)


class _BufferRecorder:
    """Stands in for the trace's storage tracker: the live bytes of what is tracked, and their peak."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def track(self, t: torch.Tensor, category: str | None = None) -> None:
        nbytes = t.untyped_storage().nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def test_the_all_gather_input_is_a_copy_only_when_cast(gloo: None) -> None:
    """FSDP2 casts a rank's shards to a ``param_dtype`` unlike theirs into one flat all-gather input."""
    fp32, bf16 = sharded_layout(_sharded()), sharded_layout(_sharded(_bf16()))
    assert all(u.copy_in_bytes == 0 for u in fp32.units)  # the input is a view of the output
    # one rank: the shard is the whole unit, in bf16 (what is gathered)
    assert all(u.copy_in_bytes == u.gathered_bytes > 0 for u in bf16.units)


@pytest.mark.parametrize("cast", [False, True])
def test_an_all_gather_holds_its_input_its_output_and_gloos_copy_at_once(gloo: None, cast: bool) -> None:
    """Two ranks' pre-forward of one unit: the cast input, the flat output and gloo's own flat copy
    are alive together (measured: the wider LLaMA's bf16-mixed peak, a backward prefetch, was 1.8% under
    without the input); the input is freed when the all-gather returns, before the copy-out."""
    model = _sharded(_bf16() if cast else None, per_block=False)
    layout = sharded_layout(model)
    (root,) = layout.units
    gathered = root.gathered_bytes  # the unit's bytes, gathered on any number of ranks
    copy_in = gathered // 2 if cast else 0  # this rank's half, cast
    two_ranks = dataclasses.replace(
        layout, shard_world=2, units=(dataclasses.replace(root, copy_in_bytes=copy_in),)
    )
    copied, _, buffers = unsharded_copy(model, two_ranks, torch.optim.SGD)
    recorder = _BufferRecorder()
    buffers.bind(recorder)  # type: ignore[arg-type]
    with torch.no_grad():
        copied(torch.empty(8, 64, device="meta", dtype=two_ranks.param_dtype))
    assert recorder.peak == 2 * gathered + copy_in
    assert recorder.live == gathered  # the root stays gathered to its backward; the rest is freed


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2-llama-2rank", "fsdp2-llama-wide-2rank"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_two_real_gloo_ranks_agree_with_the_per_rank_estimate(
    name: str, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(BENCH))  # the spawned ranks import the worker by name
    families = importlib.import_module("families")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = families.run_sharded(name, precision)
    assert row["method"] == "traced"
    assert -2.0 <= row["error_pct"] <= 3.0, row
    # Against a step whose peak the profiler recorded whole (gloo frees some collective buffers on its worker
    # thread, where nothing is recorded, so a partly recorded step reads high), the rank's buffers are
    # FSDP2's: within 1% (the wider LLaMA's bf16-mixed was -1.8% without the all-gather's cast input).
    if row["whole_steps"]:
        assert abs(row["error_pct"]) <= 1.0, row


def test_the_module_example_runs() -> None:
    import doctest

    from resource_guard.estimate.fsdp import fsdp2

    assert doctest.testmod(fsdp2).failed == 0


def test_reshard_after_forward_is_read_per_unit(gloo: None) -> None:
    from torch.distributed.fsdp import fully_shard

    def build(first_block_kept: bool) -> nn.Module:
        torch.manual_seed(0)
        model = Net()
        for i, b in enumerate(model.blocks):
            fully_shard(b, reshard_after_forward=not (first_block_kept and i == 0))
        fully_shard(model, reshard_after_forward=True)  # set, so the root reshards too
        return model

    kept, default = build(True), build(False)
    assert [u.reshards for u in sharded_layout(kept).units] == [True, False, True, True, True]
    assert all(u.reshards for u in sharded_layout(default).units)

    def forward_peak(model: nn.Module) -> int:
        est = estimate_memory(model, torch.optim.AdamW(model.parameters()), BATCH, _loss, device="cpu")
        return est.phase_peak_bytes["forward"]

    assert forward_peak(kept) > forward_peak(default)  # the first block stays gathered through forward


def test_an_hsdp_mesh_is_read_from_the_placements(gloo: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = Net()
    fully_shard(model, mesh=mesh)
    layout = sharded_layout(model)
    assert (layout.replicas, layout.shard_world, layout.device_type) == (1, 1, "cpu")
    est = estimate_memory(model, torch.optim.AdamW(model.parameters()), BATCH, _loss)
    assert est.traced and est.device_kind == "cpu"  # the mesh's device, by default


def test_a_frozen_unit_is_gathered_but_reduces_nothing(gloo: None) -> None:
    model = _sharded(_bf16(torch.float32))
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    units = sharded_layout(model).units
    assert units[1].trainable_bytes == 0 < units[1].gathered_bytes
    assert all(u.trainable_bytes == u.gathered_bytes for u in units if u is not units[1])
    trainable = [p for p in model.parameters() if p.requires_grad]
    est = estimate_memory(model, torch.optim.AdamW(trainable), BATCH, _loss, device="cpu")
    full = _sharded(_bf16(torch.float32))
    whole = estimate_memory(full, torch.optim.AdamW(full.parameters()), BATCH, _loss, device="cpu")
    assert est.traced and est.breakdown["optimizer_state"] < whole.breakdown["optimizer_state"]


def test_the_analytic_fallback_is_per_rank_too(gloo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from resource_guard import ResourceGuardWarning
    from resource_guard.estimate import estimator

    model = _sharded(_bf16())
    traced = estimate_memory(model, torch.optim.AdamW(model.parameters()), BATCH, _loss, device="cpu")

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("an operator with no fake kernel")

    monkeypatch.setattr(estimator, "_trace", fails)
    with pytest.warns(ResourceGuardWarning, match="analytic upper bound"):
        bound = estimate_memory(model, torch.optim.AdamW(model.parameters()), BATCH, _loss, device="cpu")
    assert isinstance(bound, ShardedEstimate) and bound.method == "analytic"
    assert bound.peak_bytes >= traced.peak_bytes
