"""The shape-aware memory model against real CPU steps, and what the run-time shape check costs.

1. **Error.** GPT-2 from ``benchmarks/cases.py`` (4 layers, 256 wide, vocabulary 8192; ``sdpa`` as the
   case builds it, and ``eager``: the math path, with attention's ``s²`` scores) is planned on its
   4×128 sample (CPU, 32-true, micro-batch 4). The shape model learns the sequence axis from the
   batches it is asked about (4×32, 4×256; 2×32, 2×128, 2×256 for the micro-steps with fewer rows,
   which start with the gradients allocated), then predicts a spread of shapes it has not traced.
   Each prediction is compared with the real peak of that step measured by torch.profiler
   (:func:`~resource_guard.estimate.host.measure.measure_training_step`, ``gradients_kept`` for the
   accumulating micro-steps). Target: never under, within 3%.
2. **Cost of the check per batch**, median of rounds: a repeated shape (a cache hit: the signature
   and one dict lookup), a new shape the model answers without tracing, and a new shape that must be
   traced. Also ``ShapeGuard.micro_batch_size`` (the front door's call) on a hit.
3. **The cross-rank agreement** under DDP: one all-reduce of one int64 per batch on gloo, 2 processes
   on this machine, median per call; and the same call without a process group.

Run:  python benchmarks/shape_model.py [--rounds 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import gpt2, native_stderr_silenced  # noqa: E402

from resource_guard.estimate.host.measure import measure_training_step  # noqa: E402
from resource_guard.frontdoors.shape_guard import ShapeGuard, agree_min  # noqa: E402
from resource_guard.planning.planner import plan  # noqa: E402
from resource_guard.planning.shapes import ShapeModel  # noqa: E402

LEARN = ((4, 32), (4, 256), (2, 32), (2, 128), (2, 256))
SPREAD = tuple((r, n) for r in (4, 3, 2, 1) for n in (48, 96, 160, 200, 240))


def build(attn: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    model, optimizer, batch, _ = gpt2()
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model, optimizer, batch


def tokens(rows: int, length: int) -> dict[str, torch.Tensor]:
    seed = torch.Generator().manual_seed(rows * 1000 + length)
    ids = torch.randint(0, 8192, (rows, length), generator=seed)
    return {"input_ids": ids, "labels": ids.clone()}


def accuracy(attn: str) -> list[dict[str, Any]]:
    model, optimizer, sample = build(attn)
    made = plan(model, optimizer, sample, device="cpu", precision="32-true", checkpointing=False)
    shapes = ShapeModel(model, optimizer, sample, None, made)
    for rows, length in LEARN:
        shapes.check(tokens(rows, length))
    learnt = shapes.traces
    rows_out = []
    for rows, length in SPREAD:
        fit = shapes.check(tokens(rows, length))
        fresh, _, _ = build(attn)
        with native_stderr_silenced():
            real = measure_training_step(
                fresh, torch.optim.AdamW(fresh.parameters()), tokens(rows, length),
                gradients_kept=rows < made.micro_batch_size,
            )  # fmt: skip
        rows_out.append(
            {
                "attn": attn, "rows": rows, "length": length, "source": fit.source,
                "predicted_bytes": fit.predicted_peak_bytes, "measured_bytes": real.peak_bytes,
                "error": fit.predicted_peak_bytes / real.peak_bytes - 1,
            }
        )  # fmt: skip
    micro = made.micro_batch_size
    print(f"  {attn}: plan micro-batch {micro}; {learnt} traces to learn, {shapes.traces} in all")
    return rows_out


def per_call_us(fn: Any, calls: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        samples.append((time.perf_counter_ns() - start) / calls / 1e3)
    return statistics.median(samples)


def check_cost(rounds: int) -> dict[str, float]:
    model, optimizer, sample = build("eager")
    made = plan(model, optimizer, sample, device="cpu", precision="32-true", checkpointing=False)
    shapes = ShapeModel(model, optimizer, sample, None, made)
    for rows, length in LEARN[:2]:
        shapes.check(tokens(rows, length))
    guard = ShapeGuard(shapes)
    hit = tokens(4, 128)
    out = {
        "hit_check_us": per_call_us(lambda i: shapes.check(hit), 20000, rounds),
        "hit_guard_call_us": per_call_us(lambda i: guard.micro_batch_size(hit), 20000, rounds),
    }
    # new shapes inside the learnt box: every call a miss the model answers (no trace)
    fresh = [tokens(4, n) for n in range(33, 256) if n not in (128,)]
    cursor = iter(range(len(fresh)))

    def model_miss(i: int) -> None:
        fit = shapes.check(fresh[next(cursor)])
        assert fit.source == "model", fit

    out["miss_model_us"] = per_call_us(model_miss, len(fresh) // rounds, rounds)
    traced = [tokens(3, 300 + 7 * i) for i in range(rounds)]  # outside the box: one trace each
    out["miss_traced_ms"] = statistics.median(
        per_call_us(lambda i, b=b: shapes.check(b), 1, 1) / 1e3 for b in traced
    )
    return out


def _gloo_worker(rank: int, port: int, calls: int, rounds: int, queue: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for _ in range(200):
        agree_min(1)
    flag = torch.ones(1, dtype=torch.int64)
    raw, ours = [], []
    for _ in range(rounds):  # interleaved: gloo's own all-reduce of one int64, then ours
        raw.append(per_call_us(lambda i: dist.all_reduce(flag, op=dist.ReduceOp.MIN), calls, 1))
        ours.append(per_call_us(lambda i: agree_min(1), calls, 1))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put((statistics.median(ours), statistics.median(raw)))


def gloo_cost(rounds: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, 2000, rounds, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    ours, raw = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return {
        "agree_gloo_2_ranks_us": ours,
        "raw_all_reduce_gloo_2_ranks_us": raw,
        "agree_without_group_us": per_call_us(lambda i: agree_min(1), 20000, rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--parts", default="1,2,3", help="which of the three parts to run, e.g. 2,3")
    args = parser.parse_args()
    parts = {int(x) for x in args.parts.split(",")}
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)

    rows: list[dict[str, Any]] = []
    cost: dict[str, float] = {}
    gloo: dict[str, float] = {}
    if 1 in parts:
        rows = report_accuracy()
    if 2 in parts:
        cost = report_cost(args.rounds)
    if 3 in parts:
        gloo = report_agreement(args.rounds)
    if args.json:
        args.json.write_text(json.dumps({"accuracy": rows, "cost": cost, "agreement": gloo}, indent=2))


def report_accuracy() -> list[dict[str, Any]]:
    print("1. shape model vs real CPU steps (GPT-2 from cases.py, 32-true, plan micro-batch 4)")
    rows = [r for attn in ("sdpa", "eager") for r in accuracy(attn)]
    print(f"  {'attn':6} {'shape':>8} {'source':7} {'predicted':>12} {'measured':>12} {'error':>8}")
    for r in rows:
        shape = f"{r['rows']}×{r['length']}"
        print(
            f"  {r['attn']:6} {shape:>8} {r['source']:7} {r['predicted_bytes']:>12,} "
            f"{r['measured_bytes']:>12,} {r['error']:>+8.2%}"
        )
    errors = [r["error"] for r in rows]
    print(
        f"  {len(rows)} shapes: min {min(errors):+.4%}, median {statistics.median(errors):+.4%}, "
        f"max {max(errors):+.4%}"
    )
    for source in ("model", "traced", "bound"):
        mine = [r for r in rows if r["source"] == source]
        if not mine:
            continue
        under = [r["measured_bytes"] - r["predicted_bytes"] for r in mine if r["error"] < 0]
        detail = f"{len(under)} under, by at most {max(under)} B" if under else "none under"
        what = f"{source} figures ({len(mine)})"
        if source == "bound":  # the figure at the edge of the model's box: an upper bound only
            top = max(r["error"] for r in mine)
            verdict = "FAIL" if under else "PASS"
            print(f"  {verdict}: {what} never under the real step ({detail}; over by up to {top:.0%})")
            continue
        within = all(r["error"] <= 0.03 for r in mine)
        verdict = "PASS" if within and not under else "FAIL"
        print(f"  {verdict}: {what} never under and within 3% of the real step: {detail}")
    return rows


def report_cost(rounds: int) -> dict[str, float]:
    print("2. cost of the shape check per batch (median of rounds)")
    cost = check_cost(rounds)
    print(f"  repeated shape (cache hit): ShapeModel.check {cost['hit_check_us']:.2f} µs, "
          f"ShapeGuard.micro_batch_size {cost['hit_guard_call_us']:.2f} µs")  # fmt: skip
    print(f"  new shape, answered by the model: {cost['miss_model_us']:.1f} µs")
    print(f"  new shape, traced: {cost['miss_traced_ms']:.0f} ms")
    return cost


def report_agreement(rounds: int) -> dict[str, float]:
    print("3. cross-rank agreement (one all-reduce of one int64 per batch)")
    gloo = gloo_cost(rounds)
    print(f"  gloo, 2 ranks on this machine: {gloo['agree_gloo_2_ranks_us']:.1f} µs per batch "
          f"(gloo's own all_reduce of one int64: {gloo['raw_all_reduce_gloo_2_ranks_us']:.1f} µs); "
          f"without a process group: {gloo['agree_without_group_us']:.2f} µs")  # fmt: skip
    return gloo


if __name__ == "__main__":
    main()
