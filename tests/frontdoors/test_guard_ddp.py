"""The plain-PyTorch door under DDP (two CPU ranks, gloo, ``torchrun``): the ranks agree on the
pre-flight with the other doors' agreement (frontdoors/run.py). A rank whose step does not fit stops
every rank before step 0 with that rank's error; without the agreement the other rank went on into its
first backward's all-reduce with a peer that was gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ddp_launch import run_torchrun

SCRIPT = """
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from resource_guard import guard

out, loop = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
batches = [(torch.randn(16, 64), torch.randint(0, 10, (16,))) for _ in range(4)]
limit = "64KiB" if rank == 1 else None  # rank 1's device too small for any micro-batch
result = {"steps": 0, "error": None}
try:
    with guard(model, optimizer, device="cpu", memory_limit=limit, monitor=False) as g:
        if loop == "iterate":
            for x, y in g.iterate(batches):
                g.backward(nn.functional.cross_entropy(model(x), y))
        else:  # the loop as written, observed
            for x, y in batches:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
    result["steps"] = g.optimizer_steps
except Exception as error:
    result["error"] = f"{type(error).__name__}: {error}"
(out / f"rank{rank}.json").write_text(json.dumps(result))
os._exit(0)  # gloo's threads at interpreter exit can abort a rank (see test_lightning_ddp)
"""


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["iterate", "unchanged"])
def test_a_rank_whose_step_does_not_fit_stops_every_rank_before_step_zero(tmp_path: Path, loop: str) -> None:
    code, output, (r0, r1) = run_torchrun(tmp_path, SCRIPT, loop)
    assert code == 0, output[-4000:]
    assert r0["error"] == r1["error"], (r0, r1)
    assert r0["error"].startswith("DoesNotFitError: pre-flight failed on rank 1 (every rank stops)")
    assert r0["steps"] == r1["steps"] == 0
