"""The shape-aware memory model (planning/shapes.py) and batch shapes (planning/worst_case.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from resource_guard.planning.planner import plan
from resource_guard.planning.shapes import ShapeModel
from resource_guard.planning.surface import Surface
from resource_guard.planning.worst_case import (
    describe_signature,
    resize_along,
    sequence_positions,
    signature_of,
    worst_case_length,
)

VOCAB, ROWS, LENGTH = 64, 4, 16


class Attention(nn.Module):
    """Embedding, one math-path self-attention (an s×s score matrix per row) and a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, 96), nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)).softmax(-1)
        return self.head(scores @ v)


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["ids"]
    return F.cross_entropy(model(ids).flatten(0, 1), batch["labels"][:, : ids.shape[1]].flatten())


def batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(rows * length))
    return {"ids": ids, "labels": ids.roll(1, dims=1)}


@functools.cache
def planned() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = Attention()
    optimizer = torch.optim.AdamW(model.parameters())
    made = plan(model, optimizer, batch(ROWS, LENGTH), lm_loss, device="cpu", precision="32-true")
    return model, optimizer, made


def shape_model() -> ShapeModel:
    model, optimizer, made = planned()
    return ShapeModel(model, optimizer, batch(ROWS, LENGTH), lm_loss, made)


def traced_total(rows: int, length: int, micro: int | None = None) -> int:
    """The planner's own figure for this shape, from a fresh shape model (one trace, no fit)."""
    fresh = shape_model()
    return fresh._evaluate(fresh._tracer(frozenset(), length, batch(rows, length)), micro or rows).total


# -- signatures and the sequence axis --------------------------------------------------------------
def test_signatures_and_the_sequence_axis():
    b = batch(ROWS, LENGTH)
    assert signature_of(b) == signature_of(batch(ROWS, LENGTH))
    assert signature_of(b) != signature_of(batch(ROWS, LENGTH + 1))
    assert signature_of(b) == signature_of([b["ids"], b["labels"]]) == signature_of((b["ids"], b["labels"]))
    assert describe_signature(signature_of(b)) == "4×16 int64, 4×16 int64"
    assert sorted(sequence_positions(b)) == [(0, 1), (1, 1)]
    long = resize_along(b, sequence_positions(b), 40)
    assert long["ids"].shape == (ROWS, 40) and torch.equal(long["ids"][:, 16:32], b["ids"])
    assert resize_along(b, sequence_positions(b), 5)["labels"].shape == (ROWS, 5)
    assert resize_along(b, sequence_positions(b), 1 << 21)["ids"].is_meta, "large resizes cost no memory"


def test_the_longest_sequence_is_read_from_declarations_without_iterating():
    class Sampler:
        bucket_boundaries = (64, 128, 1024)

        def __iter__(self):
            raise AssertionError("never iterated")

    loader = type("Loader", (), {"batch_sampler": Sampler(), "dataset": None})()
    assert worst_case_length(loader) == (1024, "batch_sampler.bucket_boundaries")

    class Column(list):
        column_names = ["input_ids", "length"]

        def __getitem__(self, key):
            return [3, 900, 17] if key == "length" else super().__getitem__(key)

    assert worst_case_length(type("L", (), {"dataset": Column()})()) == (900, "dataset['length']")
    assert worst_case_length(type("L", (), {"dataset": [1, 2]})()) is None


# -- the fitted surface ----------------------------------------------------------------------------
@given(
    st.integers(0, 10**9), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**5),
    st.integers(0, 10**4), st.integers(1, 64), st.integers(1, 4096),
)  # fmt: skip
def test_a_surface_is_exact_on_polynomial_data(c0, c1, c2, c3, c4, rows, length):
    def total(r: int, n: int) -> int:  # persistent + rows × (linear + quadratic in n) + a per-n term
        return c0 + c4 * n + r * (c1 + c2 * n + c3 * n * n)

    surface = Surface()
    for r in (32, 64):
        for n in (16, 2048, 4096):
            surface.add(r, n, total(r, n))
    surface.add(64, 1032, total(64, 1032))
    assert surface.trusted and surface.margin_bytes <= 8
    over = surface.predict(rows, length) - total(rows, length)
    assert 0 <= over <= surface.margin_bytes + 1 + 1e-9 * total(rows, length), "exact, never under"


def test_a_surface_refuses_data_that_is_not_polynomial():
    surface = Surface()
    for r in (1, 2):
        for n in (8, 64, 512):
            surface.add(r, n, r * n * n * n)  # cubic: no quadratic fits it
    surface.add(2, 36, 2 * 36**3)
    assert not surface.trusted


# -- the shape model -------------------------------------------------------------------------------
def test_a_repeated_signature_is_a_cache_hit_and_the_plan_is_its_own_first_entry():
    shapes = shape_model()
    first = shapes.check(batch(ROWS, LENGTH))
    assert first.source == "plan" and first.predicted_peak_bytes == planned()[2].fit.device_total_bytes
    assert shapes.check(batch(ROWS, LENGTH)) is first and shapes.traces == 0


def test_the_model_learns_a_length_axis_and_predicts_it_exactly_and_never_under():
    shapes = shape_model()
    for length in (64, 160):  # two new lengths: traced as they come; with the plan's, three: learnt
        assert shapes.check(batch(ROWS, length)).source == "traced"
    positions = sequence_positions(batch(ROWS, LENGTH))
    surface = shapes._surfaces[(positions, False)]
    assert surface.trusted and surface.box == (ROWS, ROWS, LENGTH, 160) and surface.margin_bytes <= 8
    for length in (100, 17, 159):
        fit = shapes.check(batch(ROWS, length))
        assert fit.source == "model", length
        exact = traced_total(ROWS, length)
        assert exact <= fit.predicted_peak_bytes <= exact + 8, length


def test_fewer_rows_than_the_plan_are_a_regime_of_their_own_never_under_predicted():
    """Below the plan's micro-batch a step starts with the gradients allocated (accumulation): its own
    surface, learnt from its own traces; whatever the source, no figure is below the traced one."""
    shapes = shape_model()
    sources = []
    shapes_asked = ((2, 64), (2, 160), (2, 100), (3, 120), (2, 150), (1, 130), (2, 40), (1, 20), (2, 16))
    for rows, length in shapes_asked:
        fit = shapes.check(batch(rows, length))
        exact = traced_total(rows, length)
        assert exact <= fit.predicted_peak_bytes, (rows, length, fit.source)
        if fit.source in ("traced", "model"):  # "bound": the figure at the edge of the model's box
            assert fit.predicted_peak_bytes <= exact + 8, (rows, length, fit.source)
        sources.append(fit.source)
    assert sources[3:5] == ["model", "model"] and "bound" in sources[5:], sources


def test_the_model_traces_what_it_cannot_vouch_for():
    shapes = shape_model()
    for length in (64, 160):
        shapes.check(batch(ROWS, length))
    before = shapes.traces
    assert shapes.check(batch(ROWS, 400)).source == "traced", "outside the lengths it verified"
    other = batch(ROWS, 100)
    other["extra"] = torch.zeros(ROWS, 7)  # a new structure
    assert shapes.check(other).source == "traced"
    two_axes = {"ids": batch(ROWS, 50)["ids"], "labels": batch(ROWS, 60)["labels"]}
    assert shapes.check(two_axes).source == "traced", "two dimensions varying apart"
    assert shapes.traces > before
    assert shapes.check(batch(ROWS, 300)).source == "model", "400 agreed with the fit: the box grew"


def test_a_shape_that_does_not_fit_gets_the_largest_micro_batch_that_does():
    model, optimizer, _ = planned()
    long = batch(ROWS, 256)
    cap = (traced_total(ROWS, 256) + traced_total(ROWS // 2, 256)) // 2
    made = plan(model, optimizer, batch(ROWS, LENGTH), lm_loss, device="cpu", precision="32-true",
                memory_limit=int(cap / 0.9))  # fmt: skip
    assert made.micro_batch_size == ROWS
    shapes = ShapeModel(model, optimizer, batch(ROWS, LENGTH), lm_loss, made)
    fit = shapes.check(long)
    assert not fit.fits and fit.fitting_micro_batch_size == ROWS // 2
    assert fit.fitting_peak_bytes <= fit.usable_bytes < fit.predicted_peak_bytes


@pytest.mark.parametrize("rows", [1, 3])
def test_fewer_rows_than_the_plan_are_traced_as_accumulating_micro_steps(rows):
    shapes = shape_model()
    fit = shapes.check(batch(rows, LENGTH))
    assert fit.micro_batch_size == rows and fit.source == "traced"
    assert fit.predicted_peak_bytes == traced_total(rows, LENGTH)


class Bags(nn.Module):
    """A sparse table (2-D bags, so the batch has rows) with Adagrad: its state updates grow with the
    distinct rows of the gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.table, self.head = nn.EmbeddingBag(5000, 16, sparse=True), nn.Linear(16, 1)

    def forward(self, bags: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(bags)).square().mean()


def test_a_same_shape_batch_with_more_distinct_indices_is_never_under_the_cached_figure():
    """The cache is keyed on shapes: the figure of a sample batch with few distinct indices must cover a
    batch of the same shape whose indices are all distinct (sparse rows bounded by the indices)."""
    hot = torch.randint(0, 20, (64, 8), generator=torch.Generator().manual_seed(0))
    spread = torch.randperm(5000, generator=torch.Generator().manual_seed(1))[: 64 * 8].view(64, 8)

    def planned_for(bags: torch.Tensor) -> tuple[nn.Module, torch.optim.Optimizer, object]:
        torch.manual_seed(0)
        model = Bags()
        optimizer = torch.optim.Adagrad(model.parameters())
        return model, optimizer, plan(model, optimizer, bags, device="cpu", precision="32-true")

    model, optimizer, made = planned_for(hot)
    shapes = ShapeModel(model, optimizer, hot, None, made)
    cached = shapes.check(spread)
    assert shapes.traces == 0 and cached.source == "plan"  # the sample's figure is reused
    assert cached.predicted_peak_bytes >= planned_for(spread)[2].fit.device_total_bytes
