"""The shape guard under DDP on the CPU: 2 ranks over gloo, each in its own process.

Rank 1's loader yields a long batch at its third step, rank 0's never does: every rank must stop
before that step (one all-reduce per batch), so no rank is left waiting in a collective. Each case
runs a small script in a subprocess with a timeout (a hang fails the test), as
``test_lightning_ddp.py`` does.
"""

from __future__ import annotations

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
    from torch.utils.data import DataLoader

    from resource_guard.frontdoors.lightning.apply import training_step_loss
    from resource_guard.frontdoors.lightning.callback import ResourceGuard
    from resource_guard.planning.planner import plan

    OUT, MODE = Path(sys.argv[1]), sys.argv[2]
    RANK = int(os.environ.get("LOCAL_RANK", "0"))
    ROWS, SHORT, LONG, VOCAB = 8, 16, 2048, 256


    def tokens(length, seed):
        return torch.randint(0, VOCAB, (ROWS, length), generator=torch.Generator().manual_seed(seed))


    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB)
            self.seen = []

        def training_step(self, batch, batch_idx):
            if self._trainer is not None:
                self.seen.append(list(batch.shape))
            logits = self.head(self.emb(batch))
            return nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    def need(length):  # what a DDP rank needs for one batch, as the planner counts it
        model = Net()
        made = plan(model, torch.optim.SGD(model.parameters(), lr=0.1), tokens(length, 0),
                    training_step_loss, device="cpu", target_batch_size=2 * ROWS, precision="32-true",
                    world_size=2, strategy="ddp")
        return made.fit.device_total_bytes


    lengths = [SHORT] * 4
    if MODE == "stop" and RANK == 1:
        lengths[2] = LONG
    batches = [tokens(n, i) for i, n in enumerate(lengths)]
    guard = ResourceGuard(memory_limit=int((need(SHORT) + need(LONG)) / 2 / 0.9), precision="32-true",
                          monitor=False, profile=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=4, callbacks=[guard], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    model = Net()
    result = {"rank": RANK}
    try:
        trainer.fit(model, DataLoader(batches, batch_size=None))
    except Exception as error:
        result.update(error_type=type(error).__name__, error=str(error),
                      report=error.report.to_dict() if getattr(error, "report", None) is not None else None)
    result.update(global_rank=trainer.global_rank, seen=model.seen, global_step=trainer.global_step,
                  stops=guard._shapes.stops if guard._shapes else None)
    written = OUT / f".rank{trainer.global_rank}.json.part"
    written.write_text(json.dumps(result))
    written.replace(OUT / f"rank{trainer.global_rank}.json")
    # gloo's threads, left to the interpreter's exit, abort it now and then ("terminate called without an
    # active exception"): the result is written, so the rank leaves without the C++ teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "error" in result else 0)
    """
)


def run_ddp(tmp_path: Path, mode: str, timeout_s: float = 240) -> tuple[int, str, list[dict]]:
    return run_lightning_ddp(tmp_path, SCRIPT, mode, timeout_s=timeout_s)


def test_every_rank_stops_before_a_long_batch_only_one_rank_sees(tmp_path):
    code, stdout, (r0, r1) = run_ddp(tmp_path, "stop")
    assert code != 0
    assert r0["error_type"] == r1["error_type"] == "DoesNotFitError", stdout[-4000:]
    assert r0["seen"] == r1["seen"] == [[8, 16]] * 2, "both ranks ran the same two steps, neither the third"
    assert r0["global_step"] == r1["global_step"] == 2
    assert r0["stops"] == r1["stops"] == 1
    assert "8×2048" in r1["error"] and "on rank 1" in r1["error"] and r1["report"]["rank"] == 1
    assert "another rank" in r0["error"] and r0["report"] is None


def test_ranks_whose_shapes_all_fit_run_to_the_end(tmp_path):
    code, stdout, (r0, r1) = run_ddp(tmp_path, "fit")
    assert code == 0, stdout[-4000:]
    assert r0["seen"] == r1["seen"] == [[8, 16]] * 4 and r0["global_step"] == r1["global_step"] == 4
    assert r0["stops"] == r1["stops"] == 0
