"""The run-time shape guard of ``guard(...)``: a causal LM whose loader yields 8×16 batches, then 8×513.

The ``memory_limit`` lies between the two shapes' estimated peaks: the plan (made on the first batch)
fits 8×16 whole; 8×513 must never run whole. The guard splits it into micro-batches that fit, with the
effective batch, the loss weighting and the number of optimizer steps unchanged.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from resource_guard import DoesNotFitError, guard
from resource_guard.frontdoors.shape_guard import ShapeReport, worst_case
from shape_scenario import LONG, ROWS, SHORT, cap_between, peaks, tiny_gpt2, tokens


def run(loader: list[Any], sgd: bool = False, **kwargs: Any) -> tuple[Any, list[int], torch.nn.Module]:
    model = tiny_gpt2()
    kind = torch.optim.SGD if sgd else torch.optim.AdamW
    optimizer = kind(model.parameters(), lr=1e-2)
    rows: list[int] = []
    options = {"device": "cpu", "precision": "32-true", "checkpointing": False, "monitor": False, **kwargs}
    with guard(model, optimizer, **options) as g:
        for micro in g.iterate(loader):
            rows.append(micro["input_ids"].shape[0])
            g.backward(model(**micro).loss)
    return g, rows, model


@pytest.mark.slow  # real training steps at 8×513 (~10 s on 2 busy cores)
def test_a_batch_too_long_for_the_plan_is_split_and_the_optimizer_steps_are_kept(tmp_path):
    loader = [tokens(ROWS, SHORT, s) for s in range(3)] + [tokens(ROWS, LONG, 3), tokens(ROWS, SHORT, 4)]
    g, rows, _ = run(loader, memory_limit=cap_between(), monitor=True, profile=False, log_dir=tmp_path)
    assert g.plan.micro_batch_size == ROWS and g.plan.accumulation_steps == 1, "planned on the first batch"
    assert g.optimizer_steps == 5, "one optimizer step per loader batch, as without the guard"
    split = rows[3:-1]
    assert rows[:3] == [ROWS] * 3 and rows[-1] == ROWS
    assert sum(split) == ROWS and max(split) < ROWS, f"the long batch never runs whole: {rows}"
    stats = g._shapes.stats()
    assert stats["splits"] == 1 and stats["stops"] == 0 and stats["shapes_seen"] == 2
    long_fit = next(f for f in g._shapes.model.seen.values() if "513" in f.shape)
    assert not long_fit.fits and long_fit.source == "traced"
    assert long_fit.fitting_micro_batch_size == max(split)
    assert long_fit.fitting_peak_bytes <= long_fit.usable_bytes < long_fit.predicted_peak_bytes
    assert long_fit.predicted_peak_bytes == peaks()[1], "the planner's own figure for 8×513"
    # the report: report.json, the markdown TensorBoard shows, guard.json
    report = json.loads((tmp_path / "report.json").read_text())
    finding = next(f for f in report["findings"] if f["id"] == "shapes")
    assert finding["severity"] == "info" and "1 batch(es) too big" in finding["title"]
    assert finding["evidence"]["splits"] == 1 and finding["evidence"]["shapes_seen"] == 2
    assert report["summary"]["shapes"]["split_shapes"] == {long_fit.shape: max(split)}
    assert "too big for the plan" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "guard.json").read_text())["shapes"]["splits"] == 1


@pytest.mark.slow  # real training steps at 8×513 (~10 s on 2 busy cores)
def test_a_split_batch_takes_the_same_step_as_the_whole_batch():
    """Loss weighting: micro-batches of the long batch accumulate the gradient of the whole batch's mean."""
    batch = tokens(ROWS, LONG, 7)
    g, rows, model = run([batch], sgd=True, memory_limit=cap_between(), sample_batch=tokens(ROWS, SHORT))
    assert len(rows) > 1 and g.optimizer_steps == 1
    reference = tiny_gpt2()
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-2)
    reference(**batch).loss.backward()  # transformers' loss is a token mean; equal rows per micro-batch
    optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_run_whose_shapes_all_fit_is_unchanged():
    loader = [tokens(ROWS, SHORT, s) for s in range(4)]
    g, rows, model = run(loader, memory_limit=cap_between())
    unguarded, _, reference = run(loader, memory_limit=cap_between(), check_shapes=False)
    assert rows == [ROWS] * 4 and g.optimizer_steps == unguarded.optimizer_steps == 4
    stats = g._shapes.stats()
    assert (stats["splits"], stats["traces"], stats["shapes_seen"], stats["batches_checked"]) == (0, 0, 1, 4)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_declared_max_seq_len_is_planned_for_before_any_step(tmp_path):
    loader = [tokens(ROWS, SHORT)]
    g, rows, _ = run(loader, memory_limit=cap_between(), max_seq_len=LONG, log_dir=tmp_path)
    worst = [r for r in g.plan.reasons if r.startswith("worst case")]
    assert len(worst) == 1, g.plan.reasons
    assert "max_seq_len=513" in worst[0] and "micro-batches of" in worst[0] and "token budget" in worst[0]
    saved = json.loads((tmp_path / "guard.json").read_text())
    assert saved["shapes"]["shapes_seen"] == 2 and saved["shapes"]["splits"] == 0
    assert rows == [ROWS]


def test_a_worst_case_that_cannot_fit_even_one_row_stops_before_any_step():
    small, _ = peaks()
    with pytest.raises(DoesNotFitError) as caught:
        run([tokens(ROWS, SHORT)], memory_limit=int(small * 1.02 / 0.9), max_seq_len=4 * LONG)
    report = caught.value.report
    assert isinstance(report, ShapeReport) and report.shape.fitting_micro_batch_size is None
    assert "2052" in report.shape.shape and "stopped before it ran" in str(caught.value)


def test_worst_case_is_found_from_a_declared_length_or_a_dataset_attribute():
    class Lengths(list):
        max_seq_len = 300

    loader = torch.utils.data.DataLoader(Lengths([0]), batch_size=1)
    big, source = worst_case(tokens(2, SHORT), None, None, loader)
    assert big["input_ids"].shape == (2, 300) and big["labels"].shape == (2, 300)
    assert source == "dataset.max_seq_len"
    assert worst_case(tokens(2, SHORT), 8, None) is None, "shorter than the batch: nothing to plan for"
    declared = tokens(1, 5)
    assert worst_case(tokens(2, SHORT), None, declared)[0] is declared


def test_the_shape_check_of_a_repeated_shape_is_a_lookup():
    loader = [tokens(ROWS, SHORT)]
    g, _, _ = run(loader, memory_limit=cap_between())
    model = g._shapes.model
    before = model.traces
    model_copy = copy.copy(model.seen)
    for _ in range(100):
        g._shapes.micro_batch_size(tokens(ROWS, SHORT))
    assert model.traces == before and model.seen == model_copy
