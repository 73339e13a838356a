"""Time-to-train projection (issue #13): projected vs measured step time, here and in public GPU runs.

Part 1, CPU runs here. For each external model (``cases.py``: transformers configs without weights,
32-true), one real CPU step time at the case's batch ``B`` calibrates the projection
(:class:`~resource_guard.planning.steptime.Calibration`: FLOPs counted on fake tensors ÷ measured
time), which then predicts two other runs that are measured for real: the batch ``2B``, and the batch
``B`` with activation checkpointing (its recompute FLOPs added). Steps are timed interleaved (A, B,
C, A, B, C, …; the fastest repeat, on one thread) so the load of a shared machine hits all alike.
Target: every calibrated row within 15%.

Part 2, public GPU figures. llm-foundry's published MPT training table (``scripts/train/benchmarking``
at commit 8c8dd48f72168c5d51e2f7b151595892a8fba43d; ``/work/research/llm_foundry_runs.csv``): for every
bf16 row, the step-time model (FLOPs per token as llm-foundry counts them, 6N + 12·L·d·T, plus the
forward again under activation checkpointing; FSDP communication over NVLink inside 8-GPU nodes and
50/25 GB/s per GPU between H100/A100 nodes) projects tokens/s per GPU, compared with the published
figure: (a) at the default efficiency (0.40) and (b) calibrated per model × GPU type on its smallest
GPU count, predicting the other counts. fp8 rows are left out (the model has no fp8 path).

Run:  python benchmarks/projection.py [--skip-cpu] [--json PATH]     (~2 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import bert_mlm, gpt2, llama, native_stderr_silenced, vit  # noqa: E402

from resource_guard.devices import load_catalog, resolve_device  # noqa: E402
from resource_guard.planning.projection import project_training  # noqa: E402
from resource_guard.planning.steptime import (  # noqa: E402
    DEFAULT_EFFICIENCY,
    Calibration,
    Interconnect,
    count_step_flops,
    step_time,
)
from resource_guard.step.batching import resize_batch  # noqa: E402
from resource_guard.step.training import call_loss_fn  # noqa: E402

FOUNDRY = Path("/work/research/llm_foundry_runs.csv")
MPT_SHAPES = {  # (n_layers, d_model) of llm-foundry's MPT yamls
    "125m": (12, 768),
    "350m": (24, 1024),
    "760m": (24, 1536),
    "1b": (24, 2048),
    "3b": (32, 2560),
    "7b": (32, 4096),
    "13b": (40, 5120),
    "30b": (48, 7168),
    "70b": (80, 8192),
}
GPU_NAMES = {"h100_80gb": "h100-sxm", "a100_80gb": "a100-80gb", "a100_40gb": "a100-40gb"}
CPU_CASES = {"gpt2": gpt2, "bert-mlm": bert_mlm, "llama": llama, "vit": vit}


# -- part 1: CPU ------------------------------------------------------------------------------------
def _step_runner(built: tuple[Any, ...], batch: Any) -> Any:
    model, optimizer, _, loss_fn = built

    def run() -> float:
        start = time.perf_counter()
        loss = call_loss_fn(model, batch, loss_fn)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return run


def cpu_rows(repeats: int) -> list[dict[str, Any]]:
    cpu = resolve_device("cpu")
    rows = []
    for name, build in CPU_CASES.items():
        base = build(False, "32-true")
        ckpt = build(True, "32-true")
        model, optimizer, batch, loss_fn = base
        b = int(next(t for t in _tensors(batch)).shape[0])
        double = resize_batch(batch, 2 * b)
        runs = {
            "B": _step_runner(base, batch),
            "2B": _step_runner(base, double),
            "B+ckpt": _step_runner(ckpt, ckpt[2]),
        }
        for run in runs.values():  # warm-up (allocator, lazy inits, optimizer state)
            run()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(repeats):
            for key, run in runs.items():
                times[key].append(run())
        measured = {k: min(v) for k, v in times.items()}  # the least disturbed repeat
        flops = count_step_flops(model, optimizer, batch, loss_fn)
        cal = Calibration.from_step("cpu", "32-true", step_s=measured["B"], flops_per_step=flops.step(b))
        for key, target, use_ckpt, sample in (("2B", 2 * b, False, double), ("B+ckpt", b, True, batch)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                proj = project_training(
                    model,
                    optimizer,
                    sample,
                    loss_fn,
                    train_samples=target,
                    target_batch_size=target,
                    devices=[cpu],
                    gpus=[1],
                    precision="32-true",
                    checkpointing=use_ckpt,
                    calibration=cal,
                    headroom=0.0,
                )
            (row,) = proj.rows
            err = row.step_s / measured[key] - 1
            m, p = measured[key], row.step_s
            print(f"{name:<10}{key:<8}{m:>10.3f}s{p:>10.3f}s{err:>+9.1%}", flush=True)
            rows.append(
                {
                    "model": name,
                    "run": key,
                    "calibrated_on": f"B={b}",
                    "measured_s": measured[key],
                    "projected_s": row.step_s,
                    "error": err,
                    "calibrated": row.calibrated,
                    "checkpointing": row.plan["checkpointing"] if row.plan else None,
                }
            )
    return rows


def _tensors(batch: Any) -> list[torch.Tensor]:
    from resource_guard.step.training import iter_tensors

    return iter_tensors(batch)


# -- part 2: llm-foundry ----------------------------------------------------------------------------
def _foundry_step(row: dict[str, str], efficiency: float) -> tuple[float, float]:
    """(projected tokens/s per GPU, step FLOPs per GPU) for one published row."""
    cat = load_catalog()
    device = cat.get(GPU_NAMES[row["gpu_type_section"]])
    layers, width = MPT_SHAPES[row["Model"]]
    n, seq, gpus = int(row["NumParams"]), int(row["SeqLen (T)"]), int(row["# GPUs"])
    micro, accum = int(row["MicroBatchSize"]), int(row["GradAccum"])
    ckpt = row["Activation Checkpointing"] == "True"
    per_token = 6 * n + 12 * layers * width * seq
    per_token += (2 * n + 4 * layers * width * seq) if ckpt else 0
    tokens = micro * accum * seq
    flops = tokens * per_token
    weights = 2 * n * (3 if ckpt else 2) * accum  # bf16 weights read in forward and backward
    update = (4 + 4 + 8) * 2 * n / gpus  # fp32 params, grads, Adam state: read + write, sharded
    factor = 2.0 if row["Sharding Strategy"] == "SHARD_GRAD_OP" else 3.0
    t = step_time(
        device,
        "bf16-mixed",
        flops=flops,
        bytes_moved=weights + update,
        efficiency=efficiency,
        comm_bytes=accum * 2 * n,
        comm_factor=factor,
        gpus=gpus,
        interconnect=Interconnect(),
    )
    return tokens / t.step_s, flops


def foundry_rows() -> list[dict[str, Any]]:
    rows = [
        r
        for r in csv.DictReader(FOUNDRY.open())
        if r["Precision"] in ("amp_bf16", "bf16") and r["Model"] in MPT_SHAPES
    ]
    out = []
    groups: dict[tuple[str, str], list[dict[str, str]]] = {}
    for r in rows:
        groups.setdefault((r["Model"], r["gpu_type_section"]), []).append(r)
    for (model, gpu), members in groups.items():
        # calibrate on the smallest GPU count (the shortest sequence there): the row one would measure first
        ref = min(members, key=lambda r: (int(r["# GPUs"]), int(r["SeqLen (T)"])))
        ref_tps, _ = _foundry_step(ref, DEFAULT_EFFICIENCY)
        calibrated_eff = DEFAULT_EFFICIENCY * float(ref["Throughput (T/s/GPU)"]) / ref_tps
        for r in members:
            published = float(r["Throughput (T/s/GPU)"])
            default_tps, _ = _foundry_step(r, DEFAULT_EFFICIENCY)
            cal_tps, _ = _foundry_step(r, min(calibrated_eff, 1.0))
            out.append(
                {
                    "model": model,
                    "gpu": gpu,
                    "gpus": int(r["# GPUs"]),
                    "seq": int(r["SeqLen (T)"]),
                    "published_tps_per_gpu": published,
                    "published_mfu": float(r["MFU"]) / 100,
                    "default_error": default_tps / published - 1,
                    "calibrated_error": None if r is ref else cal_tps / published - 1,
                }
            )
    return out


# -- report -----------------------------------------------------------------------------------------
def _pct(values: list[float]) -> str:
    if not values:
        return "-"
    a = sorted(abs(v) for v in values)
    return f"median {statistics.median(a):.1%}, p90 {a[int(0.9 * (len(a) - 1))]:.1%}, max {a[-1]:.1%}"


def bundled_example_timing() -> dict[str, Any]:
    from resource_guard.demo import build

    model, optimizer, batch = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proj = project_training(model, optimizer, batch, train_tokens=10**9)
    return {"rows": len(proj.rows), "plan_calls": proj.plan_calls, "seconds": proj.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cpu", action="store_true", help="only the public GPU figures")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per CPU run (median)")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: steady timings on a shared machine
    result: dict[str, Any] = {}
    if not args.skip_cpu:
        print("CPU, 32-true: projected (calibrated on the B run) vs measured step time")
        print(f"{'model':<10}{'run':<8}{'measured':>11}{'projected':>11}{'error':>9}", flush=True)
        with native_stderr_silenced(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpu = cpu_rows(args.repeats)
        result["cpu"] = cpu
        worst = max(abs(r["error"]) for r in cpu)
        verdict = "PASS" if worst <= 0.15 else "FAIL"
        print(f"calibrated rows: {_pct([r['error'] for r in cpu])}  -> {verdict} (15%)")
    foundry = foundry_rows()
    result["llm_foundry"] = foundry
    print(
        f"\nllm-foundry MPT table (commit 8c8dd48), {len(foundry)} bf16 rows: tokens/s per GPU vs published"
    )
    print(
        f"{'GPU':<11}{'rows':>5}  {'default efficiency 0.40 (|error|)':<44}calibrated on the smallest count"
    )
    for gpu in GPU_NAMES:
        sel = [r for r in foundry if r["gpu"] == gpu]
        cal = [r["calibrated_error"] for r in sel if r["calibrated_error"] is not None]
        print(f"{gpu:<11}{len(sel):>5}  {_pct([r['default_error'] for r in sel]):<44}{_pct(cal)}")
    all_cal = [r["calibrated_error"] for r in foundry if r["calibrated_error"] is not None]
    signed = statistics.median(r["default_error"] for r in foundry)
    print(f"{'all':<11}{len(foundry):>5}  {_pct([r['default_error'] for r in foundry]):<44}{_pct(all_cal)}")
    print(
        f"median signed error at the default efficiency: {signed:+.1%} (published median MFU "
        f"{statistics.median(r['published_mfu'] for r in foundry):.1%})"
    )
    timing = bundled_example_timing()
    result["bundled_example"] = timing
    print(
        f"\nbundled example (resource_guard.demo:build, 1e9 tokens): {timing['rows']} rows, "
        f"{timing['plan_calls']} plan() calls, {timing['seconds']:.1f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
