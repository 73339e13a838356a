"""A slow rank is named (issue #42): every rank's phases reach every rank at close (one gather), the
report of a DDP run is the node's, and the ``straggler`` finding names the rank, its phase, its excess
over the median other rank and the share of the others' step spent waiting for it.

The acceptance test runs ``guard`` under DDP on two CPU ranks (gloo, ``torchrun``) where rank 1's
collate sleeps 20 ms a batch; the same job without the sleep has no straggler finding.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_ddp_launch import run_torchrun
from resource_guard.observe.stats import RANK_ROW_KEYS, node_phases, rank_figures, rank_row
from resource_guard.report.findings import analyze
from resource_guard.report.straggler import rule_straggler
from resource_guard.report.types import FINDING_IDS, PHASES, RunStats


def _rank(rank: int, **phases: float) -> dict:
    full = dict.fromkeys(PHASES, 0.0) | phases
    return {"rank": rank, "step_time_s": sum(full.values()), "phases": full}


def _stats(*ranks: dict) -> RunStats:
    step = max(r["step_time_s"] for r in ranks)
    return RunStats(steps=50, step_time_s=step, world_size=len(ranks), ranks=tuple(ranks))


# -- the rule ------------------------------------------------------------------------------------------


def test_a_rank_slow_to_load_is_named_with_its_phase_excess_and_the_others_wait() -> None:
    # rank 0 waits for rank 1 at the end of its backward (DDP's all-reduce): 20 ms more there
    fast = _rank(0, data_wait=0.0002, forward=0.002, backward=0.0215, optimizer=0.0005)
    slow = _rank(1, data_wait=0.0205, forward=0.002, backward=0.0015, optimizer=0.0005)
    finding = rule_straggler(_stats(fast, slow))
    assert finding is not None and finding.id == "straggler" and finding.id in FINDING_IDS
    ev = finding.evidence
    assert ev["rank"] == 1 and ev["phase"] == "data_wait"
    assert ev["excess_s"] == pytest.approx(0.0203) and ev["wait_s"] == pytest.approx(0.020)
    assert ev["wait_share"] == pytest.approx(0.020 / 0.0245, abs=1e-3)
    assert finding.severity == "critical" and finding.predicted_step_s == pytest.approx(0.0245 - 0.0203)
    assert "rank 1" in finding.title and "next batch" in finding.title and "loader" in finding.advice[0]


def test_among_four_ranks_the_excess_is_over_the_median_of_the_others() -> None:
    ranks = [_rank(r, forward=f, backward=0.01) for r, f in enumerate((0.010, 0.011, 0.016, 0.0105))]
    finding = rule_straggler(_stats(*ranks))
    assert finding is not None
    assert finding.evidence["rank"] == 2 and finding.evidence["phase"] == "forward"
    assert finding.evidence["excess_s"] == pytest.approx(0.016 - 0.0105)
    assert finding.evidence["median_other_ranks_phase_s"] == pytest.approx(0.0105)


def test_ranks_that_agree_and_small_differences_are_no_straggler() -> None:
    same = [_rank(r, data_wait=0.001, forward=0.01, backward=0.01) for r in range(2)]
    assert rule_straggler(_stats(*same)) is None
    # 1 ms more on a 40 ms step: 2.5%, scheduling noise
    near = [_rank(0, forward=0.02, backward=0.02), _rank(1, forward=0.021, backward=0.019)]
    assert rule_straggler(_stats(*near)) is None
    # one rank, or ranks without phases: nothing to compare
    assert rule_straggler(_stats(_rank(0, data_wait=0.05))) is None
    assert rule_straggler(RunStats(step_time_s=0.1, ranks=({"rank": 0, "phases": None},) * 2)) is None


def test_waiting_in_backward_is_not_a_cause() -> None:
    """The rank with the longer backward is the one waiting at the all-reduce, not the slow one."""
    ranks = [_rank(0, forward=0.01, backward=0.03), _rank(1, forward=0.01, backward=0.01)]
    assert rule_straggler(_stats(*ranks)) is None


def test_straggler_ranks_first_ahead_of_the_node_mean_input_bound() -> None:
    fast = _rank(0, data_wait=0.0002, forward=0.002, backward=0.0215, optimizer=0.0005)
    slow = _rank(1, data_wait=0.0205, forward=0.002, backward=0.0015, optimizer=0.0005)
    phases = node_phases((fast, slow), 0.0245)
    assert phases is not None and phases["data_wait"] == pytest.approx(0.01035)
    stats = RunStats(
        steps=50, step_time_s=0.0245, world_size=2, ranks=(fast, slow), phases=phases,
        data_wait_s=phases["data_wait"], data_wait_share=phases["data_wait"] / 0.0245,
        loader_info={"num_workers": 0}, available_cores=2,
    )  # fmt: skip
    report = analyze(stats)
    assert [f.id for f in report.findings][:2] == ["straggler", "input-bound"]
    assert report.verdict == "straggler"
    again = RunStats.from_dict(stats.to_dict())  # report.json keeps every rank's figures
    assert again.ranks == stats.ranks


# -- the gathered rows ---------------------------------------------------------------------------------


def test_rank_rows_become_each_ranks_figures_and_the_node_phases() -> None:
    rows = [
        rank_row(10, 0.30, 0.01, {"data_wait": 0.01, "forward": 0.1, "backward": 0.15}, 10),
        rank_row(10, 0.30, 0.21, {"data_wait": 0.21, "forward": 0.05, "backward": 0.03}, 10),
    ]
    assert all(len(r) == len(RANK_ROW_KEYS) for r in rows)
    ranks = rank_figures(rows)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[1]["step_time_s"] == pytest.approx(0.03) and ranks[1]["data_wait_s"] == pytest.approx(0.021)
    assert ranks[0]["phases"]["other"] == pytest.approx(0.004)  # the rest of its own step
    assert math.isclose(sum(ranks[1]["phases"].values()), 0.03)
    node = node_phases(ranks, 0.03)
    assert node is not None and node["data_wait"] == pytest.approx(0.011)
    assert sum(node.values()) == pytest.approx(0.03)
    no_phases = rank_figures([rank_row(4, 0.4, 0.0, {}, 0)])
    assert no_phases[0]["phases"] is None and node_phases(no_phases, 0.1) is None


# -- two real ranks ------------------------------------------------------------------------------------

SCRIPT = """
import json, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, default_collate
from resource_guard import guard

out, mode = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

class Data(Dataset):
    def __len__(self):
        return 16 * 40
    def __getitem__(self, i):
        return torch.randn(64), torch.tensor(i % 10)

def collate(items):
    if mode == "slow" and rank == 1:
        time.sleep(0.02)
    return default_collate(items)

loader = DataLoader(Data(), batch_size=16, collate_fn=collate)
with guard(model, optimizer, device="cpu", log_dir=out / "run", profile=False) as g:
    for x, y in g.iterate(loader):
        g.backward(nn.functional.cross_entropy(model(x), y))
report = g.report
(out / f"rank{rank}.json").write_text(json.dumps(None if report is None else report.to_dict(), default=str))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_guard_under_ddp_names_the_rank_whose_loader_sleeps(tmp_path: Path) -> None:
    code, output, (r0, r1) = run_torchrun(tmp_path, SCRIPT, "slow")
    assert code == 0, output[-3000:]
    first = r0["findings"][0]
    assert first["id"] == "straggler", [f["title"] for f in r0["findings"]]
    assert first["evidence"]["rank"] == 1 and first["evidence"]["phase"] == "data_wait"
    assert first["evidence"]["excess_s"] > 0.015 and first["evidence"]["wait_share"] > 0.3
    summary = r0["summary"]
    assert summary["world_size"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    # the node's phases: the mean rank waits for data about half of rank 1's sleep
    assert summary["phases"]["data_wait"] > 0.007
    assert r1["findings"][0]["id"] == "straggler"  # every rank has the node's report
    assert (tmp_path / "out" / "run" / "report.json").is_file()  # written once, by rank zero
    assert output.count("verdict straggler") == 1  # one summary line, rank zero's


@pytest.mark.slow
def test_guard_under_ddp_without_a_slow_rank_has_no_straggler(tmp_path: Path) -> None:
    code, output, (r0, _) = run_torchrun(tmp_path, SCRIPT, "even")
    assert code == 0, output[-3000:]
    assert all(f["id"] != "straggler" for f in r0["findings"]), [f["title"] for f in r0["findings"]]
    assert len(r0["summary"]["ranks"]) == 2 and r0["summary"]["world_size"] == 2
