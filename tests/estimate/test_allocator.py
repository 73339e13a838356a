"""The CUDA caching-allocator model and the per-device fit, checked against hand-worked cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from resource_guard import estimate_memory, load_catalog
from resource_guard.errors import ConfigurationError
from resource_guard.estimate.allocation.allocator import (
    CUDA_CONTEXT_BYTES,
    _churn,
    device_fit,
    rank_device_fit,
    rank_overhead,
    simulate_caching_allocator,
)

MiB = 2**20


def test_every_request_is_rounded_up_to_512_bytes_in_a_2mib_small_segment() -> None:
    peaks = simulate_caching_allocator([(0, 1)])
    assert peaks.allocated_peak_bytes == 512
    assert peaks.reserved_peak_bytes == 2 * MiB
    assert peaks.segments == 1


def test_small_requests_share_one_small_segment_until_it_is_full() -> None:
    events = [(i, 1000) for i in range(2048)]  # 1000 B -> 1024 B blocks; 2048 of them fill 2 MiB
    peaks = simulate_caching_allocator(events)
    assert peaks.allocated_peak_bytes == 2048 * 1024
    assert (peaks.segments, peaks.reserved_peak_bytes) == (1, 2 * MiB)
    peaks = simulate_caching_allocator([*events, (9999, 1000)])
    assert (peaks.segments, peaks.reserved_peak_bytes) == (2, 4 * MiB)


def test_mid_sized_requests_are_carved_from_20mib_large_segments() -> None:
    six = [(i, 3 * MiB) for i in range(6)]  # 18 MiB; the 2 MiB rest is split off and stays free
    assert simulate_caching_allocator(six).reserved_peak_bytes == 20 * MiB
    seven = simulate_caching_allocator([*six, (6, 3 * MiB)])
    assert (seven.segments, seven.reserved_peak_bytes) == (2, 40 * MiB)
    assert seven.allocated_peak_bytes == 21 * MiB


def test_requests_of_10mib_and_more_get_their_own_segment_rounded_to_2mib() -> None:
    peaks = simulate_caching_allocator([(0, 11 * MiB)])
    assert peaks.reserved_peak_bytes == 12 * MiB
    # 1 MiB left over is not more than kSmallSize, so the block is not split: allocated counts it all
    assert peaks.allocated_peak_bytes == 12 * MiB


def test_a_freed_block_is_reused_instead_of_a_new_segment() -> None:
    peaks = simulate_caching_allocator([(0, 12 * MiB), (0, -12 * MiB), (1, 12 * MiB)])
    assert (peaks.segments, peaks.reserved_peak_bytes) == (1, 12 * MiB)


def test_freed_neighbours_merge_so_a_larger_request_fits_the_same_segment() -> None:
    # one 20 MiB segment: 3 + 3 + 3 + 8 MiB used, a 3 MiB tail free
    events = [(0, 3 * MiB), (1, 3 * MiB), (2, 3 * MiB), (3, 8 * MiB)]
    # freeing the first two leaves one merged 6 MiB hole; unmerged, 5 MiB would need a new segment
    events += [(0, -3 * MiB), (1, -3 * MiB), (4, 5 * MiB)]
    peaks = simulate_caching_allocator(events)
    assert (peaks.segments, peaks.reserved_peak_bytes) == (1, 20 * MiB)
    # the same request with the holes kept apart by a live block does need a second segment
    apart = [(0, 3 * MiB), (1, 3 * MiB), (2, 3 * MiB), (3, 8 * MiB), (0, -3 * MiB), (2, -3 * MiB)]
    assert simulate_caching_allocator([*apart, (4, 5 * MiB)]).segments == 2


def test_allocations_alive_before_the_step_count_and_a_resize_reallocates() -> None:
    peaks = simulate_caching_allocator([(1, 1000)], initial=[(0, 12 * MiB)])
    assert peaks.allocated_peak_bytes == 12 * MiB + 1024
    grown = simulate_caching_allocator([(0, 1000), (0, 4000)])  # storage 0 grew by 4000 B
    assert grown.allocated_peak_bytes == 5120


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(1, 30 * MiB)), min_size=1, max_size=40))
def test_reserved_covers_allocated_covers_the_live_bytes(ops: list[tuple[int, int]]) -> None:
    live: dict[int, int] = {}
    events, peak_live = [], 0
    for uid, size in ops:
        if uid in live:  # alternate: free a live id, allocate a new one
            events.append((uid, -live.pop(uid)))
        else:
            live[uid] = size
            events.append((uid, size))
        peak_live = max(peak_live, sum(live.values()))
    peaks = simulate_caching_allocator(events)
    assert peaks.reserved_peak_bytes >= peaks.allocated_peak_bytes >= peak_live
    assert peaks.reserved_peak_bytes % (2 * MiB) == 0


@pytest.fixture(scope="module")
def small_estimate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    return estimate_memory(
        model,
        torch.optim.AdamW(model.parameters()),
        torch.randn(32, 256),
        lambda m, b: m(b).square().mean(),
        device="cuda",
    )


def test_a_gpu_fit_adds_context_and_cublas_workspace(small_estimate) -> None:
    t4 = device_fit(small_estimate, "t4")
    assert t4.context_bytes == CUDA_CONTEXT_BYTES
    assert t4.workspace_bytes == 2 * 4096 * 1024 + 8 * 16 * 1024 + MiB  # cc 7.5: :4096:2:16:8 + Lt
    h100 = device_fit(small_estimate, "h100-sxm")
    assert h100.workspace_bytes == 33 * MiB  # cc 9.0: :4096:8 + Lt
    for fit in (t4, h100):
        assert fit.allocated_peak_bytes >= small_estimate.peak_bytes + fit.workspace_bytes
        assert fit.reserved_peak_bytes >= fit.allocated_peak_bytes
        assert fit.device_total_bytes == fit.reserved_peak_bytes + fit.context_bytes
        assert fit.fits and fit.headroom_bytes == fit.capacity_bytes - fit.device_total_bytes


def test_fits_follows_usable_capacity_and_headroom(small_estimate) -> None:
    t4 = load_catalog().get("t4")
    total = device_fit(small_estimate, t4).device_total_bytes
    just_enough = t4.with_memory(int(total / 0.9) + 1)
    assert device_fit(small_estimate, just_enough, headroom=0.1).fits
    assert not device_fit(small_estimate, just_enough, headroom=0.2).fits
    too_small = device_fit(small_estimate, t4.with_memory(total - 1), headroom=0.0)
    assert not too_small.fits and too_small.headroom_bytes == -1


def test_a_cpu_fit_has_no_allocator_overheads(small_estimate) -> None:
    fit = device_fit(small_estimate, "cpu")
    assert fit.context_bytes == fit.workspace_bytes == 0
    assert fit.device_total_bytes == fit.allocated_peak_bytes == fit.reserved_peak_bytes
    # the estimate was made for CUDA (foreach AdamW); on CPU the for-loop path's peak counts
    assert fit.allocated_peak_bytes <= small_estimate.peak_bytes


@pytest.mark.parametrize("headroom", [-0.1, 0.9, 1.5])
def test_headroom_outside_the_range_is_refused(small_estimate, headroom: float) -> None:
    with pytest.raises(ConfigurationError, match=r"headroom.*\[0, 0.9\)"):
        small_estimate.for_device("t4", headroom=headroom)


def test_the_verdict_has_three_states_and_only_tight_names_its_risks(small_estimate) -> None:
    t4 = load_catalog().get("t4")
    total = device_fit(small_estimate, t4).device_total_bytes
    roomy = device_fit(small_estimate, t4.with_memory(int(total / 0.8)))
    snug = device_fit(small_estimate, t4.with_memory(int(total / 0.95)))
    short = device_fit(small_estimate, t4.with_memory(total - 1))
    assert [f.verdict for f in (roomy, snug, short)] == ["fits", "fits tight", "does not fit"]
    assert roomy.fits and not snug.fits and not short.fits  # `fits` keeps meaning: within the headroom
    assert snug.tight_risks and not roomy.tight_risks and not short.tight_risks
    assert any("fragmentation" in r for r in snug.tight_risks) and snug.to_dict()["verdict"] == "fits tight"


def test_the_churn_leaves_out_what_lives_to_the_end_of_the_step() -> None:
    # uid 1: an activation freed in the backward; uid 2: a gradient freed by zero_grad at the end;
    # uid 3: a temporary after the last gradient's birth (the optimizer's); uid 9: persistent, freed
    events = [(1, 100), (2, 50), (1, -100), (3, 70), (3, -70), (9, -30), (2, -50)]
    assert _churn(events) == [(1, 100), (1, -100)]


def test_a_rank_fit_is_its_own_bytes_plus_the_churn_overhead(small_estimate) -> None:
    h100 = load_catalog().get("h100-sxm")
    rounding, fragmentation = rank_overhead(small_estimate)
    fit = rank_device_fit(small_estimate, h100, 10 * MiB, headroom=0.1)
    assert fit.allocated_peak_bytes == 10 * MiB + rounding + fit.workspace_bytes
    assert fit.device_total_bytes == fit.allocated_peak_bytes + fragmentation + CUDA_CONTEXT_BYTES
    assert (
        rank_device_fit(small_estimate, h100, 20 * MiB).device_total_bytes
        == fit.device_total_bytes + 10 * MiB
    )
    cpu = rank_device_fit(small_estimate, load_catalog().get("cpu"), 10 * MiB)
    assert cpu.device_total_bytes == 10 * MiB
