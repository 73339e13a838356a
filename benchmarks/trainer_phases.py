"""Evaluation and checkpoints under the Hugging Face Trainer door: named as such, never data wait (#40).

A causal-LM run as transformers' ``run_clm.py`` makes it (a GPT-2 from its config, fixed-length blocks
of local token ids, ``Trainer.train``), with ``callbacks=[ResourceGuardCallback()]``, in four set-ups:
evaluation and checkpoints every 20 steps, each alone, and neither. The report's shares (its phase
table, ``report.json``) are set against the shares timed from outside in the same runs:
``Trainer.evaluate`` and ``Trainer._save_checkpoint`` wrapped with a clock, over ``Trainer.train``'s
wall time (the whole-run differences, ``(T_both - T_no_eval) / T_both``, are printed too: on a quiet host
they agree; on a loaded one they are noise), and the data wait with both on against the run with
neither.

Targets: evaluation and checkpoint shares within 10 points of their timed shares; the data wait within
5 points of the run without them.

Run: ``python benchmarks/trainer_phases.py [--steps 60] [--repeats 2]`` (CPU, a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SETUPS = {"both": (True, True), "no_eval": (False, True), "no_ckpt": (True, False), "neither": (False, False)}


def run(setup: str, steps: int, every: int, root: Path) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from resource_guard import ResourceGuardCallback

    evaluate, save = SETUPS[setup]
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 512, (256, 64), generator=g)
    train = [{"input_ids": b, "labels": b} for b in blocks[:192]]
    held_out = [{"input_ids": b, "labels": b} for b in blocks[192:]]
    out = root / setup
    args = TrainingArguments(
        str(out), use_cpu=True, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        max_steps=steps, eval_strategy="steps" if evaluate else "no", eval_steps=every,
        save_strategy="steps" if save else "no", save_steps=every, report_to=[], disable_tqdm=True,
        logging_steps=every, dataloader_num_workers=0,
    )  # fmt: skip
    guard = ResourceGuardCallback(log_dir=out / "rg", profile=False)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held_out, callbacks=[guard])
    spent = {"evaluation": 0.0, "checkpoint": 0.0}
    for name, phase in (("evaluate", "evaluation"), ("_save_checkpoint", "checkpoint")):
        _timed(trainer, name, phase, spent)  # the same run's own evaluation and saving, timed from outside
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    summary = json.loads((out / "rg" / "report.json").read_text())["summary"]
    phases = summary.get("phases") or {}
    total = sum(phases.values()) or 1.0
    return {
        "wall_s": wall,
        "timed": {k: v / wall for k, v in spent.items()},
        "shares": {k: v / total for k, v in phases.items()},
        "data_wait_share": summary.get("data_wait_share"),
    }


def _timed(trainer: Any, name: str, phase: str, spent: dict[str, float]) -> None:
    method = getattr(trainer, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        begun = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - begun

    setattr(trainer, name, wrapped)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds; medians are shown")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in SETUPS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for setup in SETUPS:
                rows[setup].append(run(setup, args.steps, args.every, Path(tmp) / f"{setup}_{r}"))
    wall = {k: statistics.median(x["wall_s"] for x in v) for k, v in rows.items()}

    def share(setup: str, phase: str) -> float:
        return statistics.median(x["shares"].get(phase, 0.0) for x in rows[setup])

    # the shares timed from outside, in the same runs (a loaded host makes whole runs' differences noise)
    timed_eval = statistics.median(x["timed"]["evaluation"] for x in rows["both"])
    timed_ckpt = statistics.median(x["timed"]["checkpoint"] for x in rows["both"])
    by_difference = (
        (wall["both"] - wall["no_eval"]) / wall["both"],
        (wall["both"] - wall["no_ckpt"]) / wall["both"],
    )
    data_both, data_neither = share("both", "data_wait"), share("neither", "data_wait")
    print(
        f"load average {os.getloadavg()[0]:.1f}; {args.steps} steps, evaluation/checkpoint every "
        f"{args.every}; medians of {args.repeats} interleaved round(s)"
    )
    print("| set-up | Trainer.train wall s | evaluation share | checkpoint share | data wait share |")
    print("|---|---:|---:|---:|---:|")
    for setup in SETUPS:
        ev, ck, dw = (share(setup, p) for p in ("evaluation", "checkpoint", "data_wait"))
        print(f"| {setup} | {wall[setup]:.2f} | {ev:.1%} | {ck:.1%} | {dw:.1%} |")
    print(
        f"timed in the 'both' runs (wrapped Trainer.evaluate / _save_checkpoint over Trainer.train's wall): "
        f"evaluation {timed_eval:.1%}, checkpoint {timed_ckpt:.1%}; by whole-run difference: "
        f"{by_difference[0]:.1%}, {by_difference[1]:.1%}"
    )
    checks = [
        ("evaluation share vs timed", share("both", "evaluation"), timed_eval, 0.10),
        ("checkpoint share vs timed", share("both", "checkpoint"), timed_ckpt, 0.10),
        ("data wait with both vs with neither", data_both, data_neither, 0.05),
    ]
    for name, reported, reference, tolerance in checks:
        verdict = "PASS" if abs(reported - reference) <= tolerance else "FAIL"
        print(f"{verdict} {name}: {reported:.1%} vs {reference:.1%} (within {tolerance:.0%})")


if __name__ == "__main__":
    main()
