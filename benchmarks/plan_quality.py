"""Plan quality under memory caps: is the planner's micro-batch the largest that really fits?

For each model (built by ``cases.py``: transformers configs without weights, and torch.nn models),
``resource_guard.plan`` plans a target batch of 840 on the CPU under a ``memory_limit`` (32-true;
activation checkpointing off, except the ``+ckpt`` rows where it is required). 840 = lcm(1..8) has
every micro-batch from 1 to 8 as a divisor, so "the next size up" is usually ``chosen + 1``. Then the
step is run for real on the CPU (``measure_training_step``: torch.profiler memory records; the last
micro-step of accumulation, which starts with the earlier micro-steps' gradients) at the chosen
micro-batch and at the next divisor up, walking further down or up if either contradicts the plan,
which gives the largest divisor that really fits ``capacity × (1 − headroom)``.

The caps are round numbers between each model's 1-sample and 16-sample peaks, fixed here in advance.
Prints one row per model and a summary; the exit code is always 0 (a report: read the PASS/FAIL line).

Run:  python benchmarks/plan_quality.py [--only SUBSTRING] [--json PATH]    (~3-4 minutes on 2 cores)

``--speed``: is the plan's choice the fastest that fits, and how close is the predicted step time? Eight
small models (the demo GPT, an MLP autoencoder, a CNN, a tiny and a small GPT-2, BERT, an LSTM, a ViT;
``plan_speed_cases.py``), target batch 16, ``precision="auto"`` (32-true and bf16-mixed on a CPU with
native bf16), ``step_time="auto"``, under a cap halfway between the micro-batch 8 and 16 peaks so
several configurations fit. Every fitting configuration of the plan's table is timed for real (whole
optimizer steps: its accumulation micro-steps, its autocast, its checkpointing; rounds interleaved over
the configurations, medians), one torch thread, in the thread's CPU time (the machine is shared; the
wall-clock medians are printed beside them, with the load average). Prints predicted vs measured ms
per step, the planning time with ``step_time="auto"`` and with the rule, the choice vs the fastest
measured (target: within 5%) and the prediction errors (target: all within 20%, median <= 10%).
About 1.5-2 minutes with ``--rounds 5``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases  # noqa: E402

from resource_guard.estimate import measure_training_step  # noqa: E402
from resource_guard.planning.checkpointing import apply_checkpointing  # noqa: E402
from resource_guard.planning.planner import plan  # noqa: E402
from resource_guard.step.batching import divisors, resize_batch  # noqa: E402

MIB = 2**20
TARGET = 840
HEADROOM = 0.1

#: row name -> (model name in cases.MODELS, memory cap in MiB, activation checkpointing)
ROWS: dict[str, tuple[str, int, bool]] = {
    "gpt2": ("gpt2", 300, False),
    "gpt2 +ckpt": ("gpt2", 200, True),
    "bert-mlm": ("bert-mlm", 256, False),
    "llama": ("llama", 300, False),
    "t5": ("t5", 300, False),
    "vit": ("vit", 100, False),
    "convbn": ("convbn", 64, False),
    "nn-transformer": ("nn-transformer", 200, False),
}


def _real_peak(builder: Callable[..., Any], micro: int, ckpt: bool) -> int:
    model, optimizer, batch, loss_fn = builder(ckpt=False, precision="32-true")
    if ckpt:
        apply_checkpointing(model)
    # below TARGET the plan accumulates: its last micro-step starts with the gradients allocated
    step = resize_batch(batch, micro)
    return measure_training_step(model, optimizer, step, loss_fn, gradients_kept=micro < TARGET).peak_bytes


def _largest_really_fitting(
    builder: Callable[..., Any], chosen: int, usable: int, ckpt: bool
) -> tuple[int | None, dict[int, int]]:
    """Walk the divisors of TARGET from the chosen micro-batch with real steps until the boundary."""
    divs = divisors(TARGET)
    real: dict[int, int] = {}

    def fits(micro: int) -> bool:
        if micro not in real:
            real[micro] = _real_peak(builder, micro, ckpt)
        return real[micro] <= usable

    i = divs.index(chosen)
    if fits(chosen):
        while i + 1 < len(divs) and fits(divs[i + 1]):
            i += 1
        return divs[i], real
    while i > 0:
        i -= 1
        if fits(divs[i]):
            return divs[i], real
    return None, real


def run(only: str | None) -> list[dict[str, Any]]:
    rows = []
    for name, (model_name, cap_mib, ckpt) in ROWS.items():
        if only and only not in name:
            continue
        builder = cases.MODELS[model_name][0]
        model, optimizer, batch, loss_fn = builder(ckpt=False, precision="32-true")
        started = time.perf_counter()
        made = plan(
            model,
            optimizer,
            batch,
            loss_fn,
            device="cpu",
            precision="32-true",
            target_batch_size=TARGET,
            memory_limit=cap_mib * MIB,
            headroom=HEADROOM,
            checkpointing=ckpt,
        )
        plan_s = time.perf_counter() - started
        usable = made.fit.usable_bytes
        started = time.perf_counter()
        truth, real = _largest_really_fitting(builder, made.micro_batch_size, usable, ckpt)
        measure_s = time.perf_counter() - started
        divs = divisors(TARGET)
        up = divs[divs.index(made.micro_batch_size) + 1]
        row = {
            "case": name,
            "cap_mib": cap_mib,
            "usable_mib": usable / MIB,
            "chosen": made.micro_batch_size,
            "accumulation": made.accumulation_steps,
            "predicted_mib": made.fit.device_total_bytes / MIB,
            "real_chosen_mib": real[made.micro_batch_size] / MIB,
            "next": up,
            "real_next_mib": real[up] / MIB if up in real else None,
            "largest_really_fitting": truth,
            "match": truth == made.micro_batch_size,
            "traces": made.traces,
            "plan_s": plan_s,
            "measure_s": measure_s,
        }
        rows.append(row)
        _print_row(row)
    return rows


_HEADER = (
    "| case | cap MiB | usable MiB | chosen (× accum) | predicted MiB | real@chosen MiB | next "
    "| real@next MiB | largest really fitting | match | traces | plan s |"
)


def _print_row(r: dict[str, Any]) -> None:
    nxt = "—" if r["real_next_mib"] is None else f"{r['real_next_mib']:.1f}"
    print(
        f"| {r['case']} | {r['cap_mib']} | {r['usable_mib']:.1f} | {r['chosen']} × {r['accumulation']} "
        f"| {r['predicted_mib']:.1f} | {r['real_chosen_mib']:.1f} | {r['next']} | {nxt} "
        f"| {r['largest_really_fitting']} | {'yes' if r['match'] else 'NO'} | {r['traces']} "
        f"| {r['plan_s']:.1f} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the rows whose name contains this")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--speed", action="store_true", help="plan choice vs the fastest measured step")
    parser.add_argument("--rounds", type=int, default=5, help="--speed: interleaved timing rounds")
    args = parser.parse_args()
    if args.speed:
        import plan_speed_cases

        plan_speed_cases.main(args.only, args.rounds)
        return
    warnings.filterwarnings("ignore")
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    print(f"target batch {TARGET}, headroom {HEADROOM}, 32-true, CPU; real = torch.profiler memory records\n")
    print(_HEADER)
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|:-:|---:|---:|")
    started = time.perf_counter()
    with cases.native_stderr_silenced():
        rows = run(args.only)
    matched = sum(r["match"] for r in rows)
    traces = [r["traces"] for r in rows]
    print(
        f"\nchosen == largest that really fits: {matched}/{len(rows)} "
        f"({'PASS' if rows and matched == len(rows) else 'FAIL'}); traces per plan: "
        f"min {min(traces, default=0)}, max {max(traces, default=0)}; "
        f"total {time.perf_counter() - started:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
