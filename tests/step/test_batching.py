"""Cutting a batch into micro-batches: any pytree of tensors with a common leading size."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import BatchEncoding

from resource_guard.errors import ConfigurationError
from resource_guard.step.batching import even_bounds, resize_batch, slice_batch, split_batch


@dataclasses.dataclass(frozen=True)
class Item:
    x: torch.Tensor
    names: list[str]
    scale: float


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@given(size=st.integers(0, 200), parts=st.integers(1, 20))
def test_even_bounds_cover_the_rows_in_order_near_equal(size, parts):
    bounds = even_bounds(size, parts)
    assert len(bounds) == min(size, parts)
    assert [i for lo, hi in bounds for i in range(lo, hi)] == list(range(size))
    lengths = [hi - lo for lo, hi in bounds]
    assert not lengths or max(lengths) - min(lengths) <= 1


def test_split_into_parts_keeps_every_container_type_and_cuts_per_row_lists():
    x = torch.arange(10).reshape(5, 2)
    batch = {
        "enc": BatchEncoding({"input_ids": x, "attention_mask": torch.ones(5, 2)}),
        "item": Item(x, [f"r{i}" for i in range(5)], 0.5),
        "pair": Pair(x, torch.arange(5)),
        "ids": ["a", "b", "c", "d", "e"],  # per row: cut
        "shape": [3, 4],  # not per row: repeated
        "step": torch.tensor(7),  # 0-d: repeated
    }
    pieces = split_batch(batch, parts=2)
    assert [p["pair"].y.tolist() for p in pieces] == [[0, 1, 2], [3, 4]]
    assert all(isinstance(p["enc"], BatchEncoding) for p in pieces)
    assert all(isinstance(p["item"], Item) and isinstance(p["pair"], Pair) for p in pieces)
    assert [p["item"].names for p in pieces] == [["r0", "r1", "r2"], ["r3", "r4"]]
    assert [p["ids"] for p in pieces] == [["a", "b", "c"], ["d", "e"]]
    assert all(p["shape"] == [3, 4] and p["item"].scale == 0.5 and int(p["step"]) == 7 for p in pieces)
    assert torch.equal(torch.cat([p["enc"]["input_ids"] for p in pieces]), x)


def test_split_by_micro_batch_size_is_unchanged():
    batch = (torch.arange(7), torch.arange(7) * 2)
    assert [p[0].tolist() for p in split_batch(batch, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert slice_batch(batch, 2, 4)[1].tolist() == [4, 6]


def test_a_batch_that_cannot_be_cut_names_the_leaf():
    batch = {"x": torch.zeros(16, 3), "y": torch.zeros(16), "extra": {"mask": torch.zeros(7)}}
    with pytest.raises(ConfigurationError, match=r"batch\['extra'\]\['mask'\] has 7") as caught:
        split_batch(batch, parts=2)
    assert "16 rows" in str(caught.value)
    with pytest.raises(ConfigurationError, match="no tensor"):
        split_batch({"ids": ["a", "b"]}, parts=2)


def _dlrm_batch(rows: int = 16, per_bag: int = 4) -> tuple:
    """A DLRM-style batch: dense features, one table's flat indices and offsets, labels."""
    n = rows * per_bag
    return (
        torch.zeros(rows, 13),
        [torch.randint(0, 100, (n,))],
        [torch.arange(0, n, per_bag)],
        torch.zeros(rows),
    )


@pytest.mark.parametrize("cut", [lambda b: split_batch(b, parts=2), lambda b: resize_batch(b, 8),
                                 lambda b: slice_batch(b, 0, 8)])  # fmt: skip
def test_a_flat_embedding_bag_index_is_refused_with_the_2d_form_suggested(cut):
    """Cutting ``(indices_flat, offsets)`` by rows would cut bags apart: refused, the leaf named."""
    with pytest.raises(ConfigurationError, match=r"batch\[1\]\[0\] has 64") as caught:
        cut(_dlrm_batch())
    message = str(caught.value)
    assert "flat index tensor" in message and "(batch, bag_length)" in message and "loss_fn" in message
    # the 2-D bag form is cut by rows, bags whole
    dense, [flat], _, y = _dlrm_batch()
    pieces = split_batch((dense, [flat.view(16, 4)], y), parts=2)
    assert [tuple(p[1][0].shape) for p in pieces] == [(8, 4), (8, 4)]
    assert torch.equal(pieces[1][1][0].reshape(-1), flat[32:])


def test_a_float_leaf_of_another_length_gets_no_bag_hint():
    with pytest.raises(ConfigurationError) as caught:
        split_batch((torch.zeros(16, 3), torch.zeros(7)), parts=2)
    assert "flat index tensor" not in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({}, "exactly one"), ({"micro_batch_size": 2, "parts": 2}, "exactly one"), ({"parts": 0}, "parts=0")],
)
def test_split_batch_refuses_bad_sizes(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        split_batch(torch.zeros(4), **kwargs)
