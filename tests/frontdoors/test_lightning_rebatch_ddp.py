"""Re-batching under DDP on the CPU (2 ranks over gloo): Lightning's ``DistributedSampler`` is still
injected into a loader given to ``fit``, and the split run trains exactly as the unsplit one."""

from __future__ import annotations

import textwrap

import pytest
import torch

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
    RANK = int(os.environ.get("LOCAL_RANK", "0"))
    DIM, PER_RANK, ROWS = 32, 64, 2 * 64 * 2 + 40  # two full batches per rank, then a partial one


    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            layers = []
            for _ in range(4):
                layers += [nn.Linear(DIM, DIM), nn.Tanh()]
            self.net = nn.Sequential(*layers, nn.Linear(DIM, 1))
            self.seen, self.rows = [], []

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            if self._trainer is not None:
                self.seen.append(x.shape[0])
                self.rows += index.tolist()
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)


    def need(per_rank):  # what a DDP rank needs at this micro-batch, as the planner counts it
        model = Net()
        batch = [torch.randn(per_rank, DIM), torch.randn(per_rank, 1), torch.arange(per_rank)]
        made = plan(model, torch.optim.SGD(model.parameters(), lr=0.05), batch, training_step_loss,
                    device="cpu", target_batch_size=2 * per_rank, precision="32-true", checkpointing=False,
                    world_size=2, strategy="ddp", headroom=0.0)
        return made.fit.device_total_bytes


    callbacks = []
    if MODE == "split":
        cap = (need(PER_RANK // 2) + need(PER_RANK)) // 2
        callbacks.append(ResourceGuard(memory_limit=cap, headroom=0.0, precision="32-true",
                                       checkpointing=False, monitor=False))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, 1, generator=g),
                         torch.arange(ROWS))
    loader = DataLoader(data, batch_size=PER_RANK, shuffle=True)
    L.seed_everything(0, verbose=False)
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    result = {"rank": RANK}
    try:
        trainer.fit(model, loader)
    except Exception as error:
        result.update(error_type=type(error).__name__, error=str(error))
    guard = callbacks[0] if callbacks else None
    result.update(
        seen=model.seen, rows=model.rows, global_step=trainer.global_step,
        micro=guard.decisions.micro_batch_size if guard and guard.decisions else None,
        params=[p.detach().flatten().tolist() for p in model.parameters()],
    )
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


def test_a_loader_given_to_fit_keeps_the_distributed_sampler_and_trains_as_unsplit(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "split").mkdir()
    code, out, full = run_lightning_ddp(tmp_path / "full", SCRIPT, "full")
    assert code == 0, out
    code, out, split = run_lightning_ddp(tmp_path / "split", SCRIPT, "split")
    assert code == 0, out
    per_rank = 64
    for mine, theirs in zip(split, full, strict=True):
        assert mine["micro"] == per_rank // 2  # the cap forced a split on every rank
        assert max(mine["seen"]) <= per_rank // 2 < max(theirs["seen"])
        assert mine["rows"] == theirs["rows"]  # each rank: the same samples, in the same order
        assert mine["global_step"] == theirs["global_step"]
        for a, b in zip(mine["params"], theirs["params"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
    # the DistributedSampler still shards: each epoch, the two ranks see disjoint halves of the data
    rows_per_epoch = len(split[0]["rows"]) // 2
    first = [set(rank["rows"][:rows_per_epoch]) for rank in split]
    assert not first[0] & first[1] and len(first[0] | first[1]) == 2 * rows_per_epoch
