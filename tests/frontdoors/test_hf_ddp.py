"""ResourceGuardCallback under DDP on the CPU: two ranks of ``torchrun`` over gloo, each its own process.

Every collective of the Hugging Face door is made by every rank in the same order whatever that rank's
pre-flight or batch did: a rank that fails while the other succeeds must not leave the other waiting in
a collective the first never makes (a hang, or gloo's "connection closed by peer"). Each case runs a
small script under ``torchrun --standalone`` with a timeout (a hang fails the test) and reads what each
rank wrote.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from lightning_ddp_launch import run_torchrun

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from resource_guard import ResourceGuardCallback
    from resource_guard.errors import DoesNotFitError

    OUT, MODE = Path(sys.argv[1]), sys.argv[2]
    RANK, VOCAB = int(os.environ["RANK"]), 128


    class Rows(torch.utils.data.Dataset):
        # 16-token rows; row `long` asks the collator to pad its batch to 160 tokens: the rank whose batch
        # holds it meets it, the other not. The rows themselves are all 16 tokens, so the pre-flight's
        # look for the dataset's longest example cannot see it: the shape guard meets it mid-run
        def __init__(self, long):
            self.long = long

        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = (torch.arange(16) * (1 + i % 3)) % VOCAB
            return {"input_ids": ids, "labels": ids.clone(), "pad_to": 160 if i == self.long else 0}


    def pad(rows):
        n = max(max(len(r["input_ids"]), r.get("pad_to", 0)) for r in rows)
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        labels = torch.full((len(rows), n), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = r["input_ids"]
            labels[i, : len(r["input_ids"])] = r["input_ids"]
        return {"input_ids": ids, "labels": labels}


    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=256))
    args = TrainingArguments(
        str(OUT / "run"), use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no", max_steps=6,
        logging_steps=1, disable_tqdm=True, per_device_train_batch_size=2, dataloader_drop_last=True,
        auto_find_batch_size=MODE == "autofind", remove_unused_columns=False,  # `pad_to` reaches `pad`
    )
    # 4 MB: a 2×16 batch (0.9 MiB) fits, a 2×160 one (5.9 MiB) does not; 64 KiB: not one row
    # ~0.99 MB: 1 row of 16 tokens (0.8 MiB) fits, 2 rows (0.9 MiB) do not: on rank 1 only, as "small"
    cap = {"fits": "1GiB", "nofit": "1GiB" if RANK == 0 else "64KiB", "late": 4_000_000,
           "autofind": "1GiB" if RANK == 0 else 990_000}[MODE]
    guard = ResourceGuardCallback(memory_limit=cap, profile=False, verbose=False)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(13 if MODE == "late" else None),
                      data_collator=pad, callbacks=[guard])
    result = {"rank": RANK}
    try:
        trainer.train()
    except DoesNotFitError as error:
        result["error"] = str(error).splitlines()[0]
    stats = guard.shape_stats or {}
    result.update(
        global_step=trainer.state.global_step,
        micro=guard.plan.micro_batch_size if guard.plan else None,
        train_batch_size=trainer.state.train_batch_size,
        checked=stats.get("batches_checked"), stops=stats.get("stops"),
        files=sorted(p.name for p in (OUT / "run" / "resource_guard").glob("*")) if RANK == 0 else None,
    )
    (OUT / f"rank{RANK}.json").write_text(json.dumps(result))
    # gloo's threads, left to the interpreter's exit, abort it now and then ("terminate called without an
    # active exception", with or without the callback, also after destroy_process_group on a loaded
    # host): the results are written, so the process leaves without the C++ teardown
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def run_ranks(tmp_path: Path, mode: str) -> tuple[int, str, list[dict]]:
    return run_torchrun(tmp_path, SCRIPT, mode)


def test_both_ranks_train_and_only_rank_zero_writes_the_report(tmp_path: Path) -> None:
    code, output, (r0, r1) = run_ranks(tmp_path, "fits")
    assert code == 0, output[-4000:]
    assert r0["global_step"] == r1["global_step"] == 6 and r0["micro"] == r1["micro"] == 2
    assert r0["checked"] == r1["checked"] == 6 and r0["stops"] == r1["stops"] == 0
    assert {"report.json", "report.md"} <= set(r0["files"])  # rank 1 writes into no directory of its own


def test_a_rank_whose_step_does_not_fit_stops_every_rank_before_step_zero(tmp_path: Path) -> None:
    """Rank 1's pre-flight fails, rank 0's succeeds: both must meet in the same single agreement (rank 0
    once made a second collective of its own, for the shape guard, and died on gloo's closed peer)."""
    code, output, (r0, r1) = run_ranks(tmp_path, "nofit")
    assert code == 0, output[-4000:]
    # one agreement for every door (frontdoors/run.py): the failing rank's message, on every rank
    assert r0["error"] == r1["error"]
    assert r0["error"].startswith("pre-flight failed on rank 1 (every rank stops): Nothing fits cpu")
    assert r0["global_step"] == r1["global_step"] == 0


def test_a_long_batch_on_one_rank_stops_both_before_it_runs(tmp_path: Path) -> None:
    code, output, (r0, r1) = run_ranks(tmp_path, "late")
    assert code == 0, output[-4000:]
    mine, other = (r0, r1) if "2×160" in r0["error"] else (r1, r0)
    assert "stopped before it ran" in mine["error"] and "a batch on another rank" in other["error"]
    assert r0["checked"] == r1["checked"] and r0["stops"] == r1["stops"] == 1
    assert r0["global_step"] == r1["global_step"]


def test_auto_find_batch_size_lowers_the_batch_on_every_rank_when_one_rank_would_run_out(
    tmp_path: Path,
) -> None:
    """Rank 1's batch of 2 is predicted to run out of memory, rank 0's fits: both raise the predicted
    out-of-memory error (one agreement), accelerate lowers the batch on both, and both train at 1."""
    code, output, (r0, r1) = run_ranks(tmp_path, "autofind")
    assert code == 0, output[-4000:]
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["train_batch_size"] == r1["train_batch_size"] == 1 and r0["micro"] == r1["micro"] == 1
    assert r0["global_step"] == r1["global_step"] == 6
