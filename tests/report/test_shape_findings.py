"""The ``shapes`` finding: shapes seen, splits made, stops before an out-of-memory error."""

from __future__ import annotations

from resource_guard.report.findings import analyze
from resource_guard.report.shape_findings import rule_shapes
from resource_guard.report.types import FINDING_IDS, RunStats


def test_one_shape_and_no_action_is_no_finding():
    assert rule_shapes(RunStats()) is None
    assert rule_shapes(RunStats(shapes={"shapes_seen": 1, "splits": 0, "stops": 0})) is None


def test_a_stop_is_a_warning_with_its_evidence_and_advice():
    stats = RunStats(shapes={"shapes_seen": 2, "batches_checked": 3, "splits": 0, "stops": 1, "traces": 4})
    finding = rule_shapes(stats)
    assert finding is not None and finding.id == "shapes" and finding.id in FINDING_IDS
    assert finding.severity == "warning" and "the run stopped before running one" in finding.title
    assert finding.evidence == {"shapes_seen": 2, "batches_checked": 3, "splits": 0, "stops": 1, "traces": 4}
    advice = " ".join(finding.advice)
    assert "token-budget" in advice and "max_seq_len" in advice
    report = analyze(stats)
    assert report.finding("shapes") == finding and report.to_dict()["summary"]["shapes"]["stops"] == 1


def test_splits_and_many_shapes_are_information():
    split = rule_shapes(RunStats(shapes={"shapes_seen": 3, "splits": 2, "stops": 0}))
    assert split is not None and split.severity == "info" and "2 batch(es) too big" in split.title
    many = rule_shapes(RunStats(shapes={"shapes_seen": 5, "splits": 0, "stops": 0}))
    assert many is not None and many.severity == "info" and many.advice == ()
