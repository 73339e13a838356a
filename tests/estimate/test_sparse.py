"""Sparse gradients (issue 31): ``Embedding``/``EmbeddingBag(sparse=True)`` with SGD, Adagrad and
SparseAdam, estimated against a real CPU step, and the rules of
:mod:`resource_guard.estimate.trace.sparse` that do not need one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cpu_reference import measure_reference
from resource_guard import ConfigurationError, estimate_memory
from resource_guard.estimate.trace.sparse import SparseOps, is_sparse, sparse_parts


class Recommender(nn.Module):
    """Sparse tables (pooled bags or plain embeddings summed per sample) beside a dense MLP."""

    def __init__(self, rows: tuple[int, ...], dim: int, mode: str = "sum", bags: bool = True,
                 padding_idx: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.bags = bags
        table = (
            (lambda r: nn.EmbeddingBag(r, dim, mode=mode, sparse=True, padding_idx=padding_idx))
            if bags
            else (lambda r: nn.Embedding(r, dim, sparse=True))
        )
        self.tables = nn.ModuleList(table(r) for r in rows)
        self.dense = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, dim))
        self.top = nn.Linear(dim * (len(rows) + 1), 1)

    def forward(self, dense: torch.Tensor, idx: list[torch.Tensor], offsets: list[torch.Tensor],
                y: torch.Tensor) -> torch.Tensor:  # fmt: skip
        d = self.dense(dense)
        if self.bags:
            e = [t(i, o) for t, i, o in zip(self.tables, idx, offsets)]
        else:
            e = [t(i.view(d.shape[0], -1)).sum(1) for t, i in zip(self.tables, idx)]
        z = self.top(torch.cat([d, *e], 1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(z, y)


def _loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(*batch)


def _build(rows: tuple[int, ...], dim: int, mode: str, optimizer: str, *, bags: bool = True,
           hot: int | None = None, batch: int = 128, per_bag: int = 8,
           padding_idx: int | None = None) -> tuple:  # fmt: skip
    torch.manual_seed(0)
    model = Recommender(rows, dim, mode, bags, padding_idx)
    g = torch.Generator().manual_seed(1)
    idx = [torch.randint(0, hot or r, (batch * per_bag,), generator=g) for r in rows]
    if padding_idx is not None:  # every fifth index is padding: its rows are dropped from the gradient
        for i in idx:
            i[::5] = padding_idx
    offsets = [torch.arange(0, batch * per_bag, per_bag) for _ in rows]
    data = (torch.randn(batch, 13, generator=g), idx, offsets, torch.rand(batch, generator=g))
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    elif optimizer == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    else:  # SparseAdam takes the sparse tables only
        opt = torch.optim.SparseAdam(list(model.tables.parameters()), lr=1e-3)
    return model, opt, data


CASES = {
    "bag-sum/sgd (4 tables)": dict(rows=(20000, 10000, 5000, 2000), dim=64, mode="sum", optimizer="sgd"),
    "bag-mean/adagrad": dict(rows=(20000, 5000), dim=32, mode="mean", optimizer="adagrad", hot=300),
    "embedding/sgd": dict(rows=(20000, 5000), dim=32, mode="sum", optimizer="sgd", bags=False),
    "embedding/sparse-adam": dict(
        rows=(20000, 5000), dim=32, mode="sum", optimizer="sparse_adam", bags=False
    ),
    "bag-sum/sparse-adam": dict(rows=(20000, 5000), dim=32, mode="sum", optimizer="sparse_adam", hot=3000),
    # padding_idx: the CPU forward keeps offset2bag (n + 1 elements), the backward's mask makes positions
    "bag-sum-padding/sgd": dict(rows=(20000, 5000), dim=32, mode="sum", optimizer="sgd", padding_idx=0),
    "bag-mean-padding/adagrad": dict(
        rows=(20000, 5000), dim=32, mode="mean", optimizer="adagrad", hot=300, padding_idx=3
    ),
}


@pytest.mark.cpu_reference
@pytest.mark.parametrize("name", sorted(CASES))
def test_sparse_gradients_match_a_real_cpu_step(name: str) -> None:
    model, opt, batch = _build(**CASES[name])
    est = estimate_memory(model, opt, batch, _loss, device="cpu", sparse_rows="batch")
    # `padding_idx`'s mask selects the gradient's rows: the real kernel runs on the mask's own values
    assert est.method == ("traced-recovered" if "padding" in name else "traced")
    real = measure_reference(est, *_build(**CASES[name]), _loss)
    error = (est.peak_bytes - real.peak_bytes) / real.peak_bytes
    assert 0 <= error <= 0.01, f"{name}: estimate {est.peak_bytes} vs real {real.peak_bytes} ({error:+.2%})"


@pytest.mark.cpu_reference
def test_a_later_micro_step_counts_the_concatenated_sparse_gradient() -> None:
    case = CASES["bag-mean/adagrad"]
    model, opt, batch = _build(**case)
    est = estimate_memory(model, opt, batch, _loss, device="cpu", sparse_rows="batch")
    later = est.for_device("cpu", gradients_kept=True)
    assert any("sparse gradients grow" in note for note in later.notes)
    real = measure_reference(est, *_build(**case), _loss, gradients_kept=True)
    error = (later.allocated_peak_bytes - real.peak_bytes) / real.peak_bytes
    assert 0 <= error <= 0.01, (
        f"later micro-step: {later.allocated_peak_bytes} vs {real.peak_bytes} ({error:+.2%})"
    )
    assert later.allocated_peak_bytes > est.peak_bytes  # the rows are held twice


def test_sparse_gradients_are_counted_as_gradients() -> None:
    model, opt, batch = _build(rows=(50000,), dim=64, mode="sum", optimizer="sgd", batch=512)
    est = estimate_memory(model, opt, batch, _loss, device="cpu")
    values = 512 * 8 * 64 * 4  # one row of values per index
    assert est.breakdown["gradients"] >= values
    assert est.peak_phase != "forward"  # the peak is where the sparse gradient exists
    assert any("sparse tensors counted" in w for w in est.warnings)


def test_distinct_rows_come_from_the_batch_when_asked_and_are_said() -> None:
    few = estimate_memory(*_build(rows=(20000,), dim=32, mode="sum", optimizer="adagrad", hot=50), _loss,
                          device="cpu", sparse_rows="batch")  # fmt: skip
    many = estimate_memory(*_build(rows=(20000,), dim=32, mode="sum", optimizer="adagrad"), _loss,
                           device="cpu", sparse_rows="batch")  # fmt: skip
    assert any("keeps is the sample batch's own" in w for w in few.warnings)
    assert few.phase_peak_bytes["optimizer"] < many.phase_peak_bytes["optimizer"]


@pytest.mark.parametrize("optimizer", ["adagrad", "sparse_adam"])
def test_by_default_distinct_rows_are_bounded_for_any_batch_of_the_shape(optimizer: str) -> None:
    """The default figure is keyed on shapes (the planner, the shape guard's cache): a sample batch with
    few distinct indices must not make it under for a same-shape batch with all indices distinct."""
    case = dict(rows=(20000,), dim=32, mode="sum", optimizer=optimizer)
    hot = estimate_memory(*_build(**case, hot=50), _loss, device="cpu")
    assert any("bounded by the number of indices (never under" in w for w in hot.warnings)
    assert not any("keeps is the sample batch's own" in w for w in hot.warnings)
    spread = estimate_memory(*_build(**case), _loss, device="cpu", sparse_rows="batch")
    assert hot.peak_bytes >= spread.peak_bytes  # the hot batch's figure covers the spread one's
    # and is no more than that bound: the same figure as any batch whose indices are all distinct
    distinct = _build(**case)
    distinct[2][1][0] = torch.randperm(20000)[: 128 * 8]
    exact = estimate_memory(*distinct, _loss, device="cpu", sparse_rows="batch")
    assert hot.peak_bytes == exact.peak_bytes


@pytest.mark.cpu_reference
def test_the_bound_is_over_a_real_step_whose_batch_repeats_indices() -> None:
    case = CASES["bag-mean/adagrad"]  # 300 hot rows: many indices repeat
    est = estimate_memory(*_build(**case), _loss, device="cpu")
    real = measure_reference(est, *_build(**case), _loss)
    assert est.peak_bytes > real.peak_bytes


def test_sparse_rows_is_validated() -> None:
    with pytest.raises(ConfigurationError, match=r"sparse_rows='exact'"):
        estimate_memory(*_build(rows=(100,), dim=4, mode="sum", optimizer="sgd"), _loss, device="cpu",
                        sparse_rows="exact")  # fmt: skip


def test_without_the_batch_values_distinct_rows_are_bounded_by_the_indices() -> None:
    model, opt, (dense, idx, offsets, y) = _build(
        rows=(20000,), dim=32, mode="sum", optimizer="adagrad", hot=50
    )
    known = estimate_memory(model, opt, (dense, idx, offsets, y), _loss, device="cpu", sparse_rows="batch")
    meta = [torch.empty(i.shape, dtype=i.dtype, device="meta") for i in idx]  # values unknown
    bounded = estimate_memory(model, opt, (dense, meta, offsets, y), _loss, device="cpu", sparse_rows="batch")
    assert any("not known from the batch" in w for w in bounded.warnings)
    assert bounded.peak_bytes > known.peak_bytes


def test_cuda_target_follows_the_cuda_kernels() -> None:
    """``dense.add_(sparse, alpha=-lr)`` on CUDA makes ``values.mul(alpha)`` (nnz x dim); not on the CPU."""
    model = nn.EmbeddingBag(100000, 64, mode="sum", sparse=True)
    idx, offsets = torch.randint(0, 100000, (4096,)), torch.arange(0, 4096, 8)

    def loss(m: nn.Module, b: tuple) -> torch.Tensor:
        return m(*b).sum()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cpu = estimate_memory(model, opt, (idx, offsets), loss, device="cpu")
    cuda = estimate_memory(model, opt, (idx, offsets), loss, device="cuda")
    grown = cuda.phase_peak_bytes["optimizer"] - cpu.phase_peak_bytes["optimizer"]
    assert grown == 4096 * 64 * 4
    # and CUDA's forward keeps every index's bag (offset2bag, int64), which the CPU's leaves empty
    assert cuda.phase_peak_bytes["forward"] - cpu.phase_peak_bytes["forward"] == 4096 * 8


def test_sparse_parts_and_handled_operators() -> None:
    t = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 3), (4, 3))
    assert is_sparse(t) and not is_sparse(torch.ones(2))
    assert [p.shape for p in sparse_parts(t)] == [torch.Size([1, 2]), torch.Size([2, 3])]
    csr = torch.eye(3).to_sparse_csr()
    assert len(sparse_parts(csr)) == 3
    ops = SparseOps("cpu")
    assert ops.handles(torch.ops.aten._embedding_bag_backward.default)
    assert not ops.handles(torch.ops.aten.mm.default)
    assert ops.notes() == []


@pytest.mark.parametrize("form", ["1-d", "2-d", "after-none"])
def test_a_boolean_mask_index_holds_its_positions_beside_the_output(form: str) -> None:
    """``x[mask]`` (``padding_idx``'s rows dropped so) makes ``mask.nonzero()``: the rule is the real
    kernel's scratch, measured."""
    from resource_guard.estimate.host.kernels import _mask_positions_bytes
    from resource_guard.estimate.host.measure import allocation_deltas, peak_of
    from resource_guard.estimate.host.quiet import quiet_profile

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, 16, generator=g)
    mask = {"1-d": torch.rand(64, generator=g) > 0.3, "2-d": torch.rand(64, 32, generator=g) > 0.3,
            "after-none": torch.rand(32, generator=g) > 0.3}[form]  # fmt: skip
    index = [None, mask] if form == "after-none" else [mask]
    with quiet_profile() as prof:
        out = torch.ops.aten.index.Tensor(x, index)
    scratch = peak_of(allocation_deltas(prof)) - out.numel() * out.element_size()
    assert scratch == _mask_positions_bytes((x, index), out) > 0
