"""ResourceGuard under DDP on the CPU: 2 ranks over gloo, each in its own process.

Lightning's DDP launcher re-executes the script for rank 1, so each case runs a small script in a
subprocess (with a timeout: a hang fails the test) and reads what every rank wrote.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from lightning_ddp_launch import run_lightning_ddp

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import lightning.pytorch as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from resource_guard.frontdoors.lightning.apply import training_step_loss
    from resource_guard.frontdoors.lightning.callback import ResourceGuard
    from resource_guard.planning.planner import plan

    OUT, MODE = Path(sys.argv[1]), sys.argv[2]
    RANK = int(os.environ.get("LOCAL_RANK", "0"))  # set by the launcher for rank 1 before it starts
    DIM, PER_RANK = 32, 16


    class Data(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = PER_RANK

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(256, DIM, generator=g), torch.randn(256, 1, generator=g))
            return DataLoader(data, batch_size=self.batch_size)


    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, DIM))
                                        for _ in range(2))
            self.head = nn.Linear(DIM, 1)
            self.seen = []

        def training_step(self, batch, batch_idx):
            if self._trainer is not None:
                self.seen.append(batch[0].shape[0])
            x = batch[0]
            for block in self.blocks:
                x = x + block(x)
            loss = nn.functional.mse_loss(self.head(x), batch[1])
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())


    def cap_between(small, large):
        def need(per_rank):  # what a DDP rank needs at this micro-batch, as the planner counts it
            model = Net()
            batch = [torch.randn(per_rank, DIM), torch.randn(per_rank, 1)]
            made = plan(model, torch.optim.AdamW(model.parameters()), batch, training_step_loss, device="cpu",
                        target_batch_size=2 * per_rank, precision="32-true", checkpointing=False,
                        world_size=2, strategy="ddp")
            return made.fit.device_total_bytes
        return int((need(small) + need(large)) / 2 / 0.9)


    limit = None
    if MODE == "agree" and RANK == 1:
        limit = cap_between(PER_RANK // 2, PER_RANK)  # rank 1 can only take half the per-rank batch
    if MODE == "fail" and RANK == 1:
        limit = 1024  # nothing fits rank 1
    guard = ResourceGuard(memory_limit=limit, precision="32-true", checkpointing=False, profile=False,
                          log_dir=OUT / "rg")
    logger = L.loggers.TensorBoardLogger(OUT / "tb", name="run") if MODE == "agree" else False
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=2, callbacks=[guard], logger=logger,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1,
    )
    model = Net()
    result = {"rank": RANK, "limit": limit}
    try:
        trainer.fit(model, Data())
    except Exception as error:
        result.update(error_type=type(error).__name__, error=str(error))
    result.update(
        global_rank=trainer.global_rank,
        seen=model.seen,
        decisions=guard.decisions.to_dict() if guard.decisions else None,
        local_plan_micro=guard.plan.micro_batch_size if guard.plan else None,
        global_step=trainer.global_step,
    )
    written = OUT / f".rank{trainer.global_rank}.json.part"  # renamed when complete: the test polls for it
    written.write_text(json.dumps(result))
    written.replace(OUT / f"rank{trainer.global_rank}.json")
    # gloo's threads, left to the interpreter's exit, abort it now and then ("terminate called without an
    # active exception"): the result is written, so the rank leaves without the C++ teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "error" in result else 0)
    """
)


def run_ddp(
    tmp_path: Path, mode: str, timeout_s: float = 240
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    code, stdout, ranks = run_lightning_ddp(tmp_path, SCRIPT, mode, timeout_s=timeout_s)
    return subprocess.CompletedProcess(["ddp_script.py", mode], code, stdout, ""), ranks


def test_ranks_agree_on_the_most_conservative_plan_and_only_rank_zero_writes(tmp_path):
    completed, ranks = run_ddp(tmp_path, "agree")
    assert completed.returncode == 0, completed.stdout[-4000:]
    r0, r1 = ranks
    assert r1["limit"] is not None and r0["limit"] is None
    assert r0["local_plan_micro"] == 16 and r1["local_plan_micro"] == 8, "each rank planned for itself"
    assert r0["decisions"] == r1["decisions"], "one decision for every rank"
    d = r0["decisions"]
    assert (d["micro_batch_size"], d["accumulation_steps"], d["world_size"], d["target_batch_size"]) == (
        8,
        2,
        2,
        32,
    )
    assert r0["seen"] == r1["seen"] == [8] * 4, "2 optimizer steps × 2 micro-batches of 8 on each rank"
    assert r0["global_step"] == r1["global_step"] == 2
    # console: rank zero only, saying whose plan it is
    assert completed.stdout.count("ResourceGuard plan") == 1
    assert "agreed across 2 ranks: rank 1's plan" in completed.stdout
    # files: rank zero writes the report and the TensorBoard events, nothing else writes
    assert (tmp_path / "out" / "rg" / "report.json").exists()
    events = list((tmp_path / "out" / "tb").rglob("events.out.tfevents.*"))
    assert len(events) == 1, events


def test_one_rank_failing_preflight_stops_every_rank_with_the_same_error(tmp_path):
    completed, ranks = run_ddp(tmp_path, "fail")
    assert completed.returncode != 0
    r0, r1 = ranks
    assert r0["error_type"] == r1["error_type"] == "DoesNotFitError"
    assert r0["error"] == r1["error"] and "rank 1" in r0["error"]
    assert r0["seen"] == r1["seen"] == [], "no training step ran on any rank"
    assert r0["decisions"] is None and r1["decisions"] is None
