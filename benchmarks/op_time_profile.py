"""Where a step-time prediction is off: the op model's time per ATen operator vs torch.profiler's.

For one of ``plan_speed_cases.py``'s models at one micro-batch and precision, traces the step
(:func:`resource_guard.planning.op_time.count_step_ops`), predicts each operator with this CPU's
calibration, runs the real step (forward, backward, AdamW; ``--accumulate``: backward only, gradients
kept, as a later micro-step of accumulation runs) and prints, per operator name, the predicted total
beside the profiler's self CPU time and call counts, largest first, under the step's time in this
thread's CPU time and the predicted kernel and host ("framework") shares. The profiler's times are wall
clock and include its own overhead: read them for proportions, not absolutes.

Run: ``python benchmarks/op_time_profile.py "demo gpt" --micro 1 --precision 32-true [--accumulate]``
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_speed_cases as cases  # noqa: E402

from resource_guard.planning.op_time import (  # noqa: E402
    _kernel_seconds,
    _overhead_seconds,
    count_step_ops,
    cpu_calibration,
    predict_ops,
)
from resource_guard.step.batching import resize_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(cases.MODELS))
    parser.add_argument("--micro", type=int, default=cases.TARGET)
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    parser.add_argument("--accumulate", action="store_true", help="backward only, gradients kept")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cal = cpu_calibration()
    model, batch, loss_fn = cases.MODELS[args.model]()
    batch = resize_batch(batch, args.micro)
    ops = count_step_ops(model, torch.optim.AdamW, batch, loss_fn, precision=args.precision)
    traced = list(ops.micro_step) + ([] if args.accumulate else list(ops.optimizer))
    predicted: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for w in traced:
        predicted[w.name] += (_kernel_seconds(w, cal) + _overhead_seconds(w, cal)) * 1e3
        counts[w.name] += 1
    prediction = predict_ops(ops, cal)
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            loss = loss_fn(model, batch)
        loss.backward()
        if not args.accumulate:
            opt.step()
            opt.zero_grad()

    for _ in range(3):
        step()
    times = []
    for _ in range(7):
        start = time.thread_time()
        step()
        times.append(time.thread_time() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    measured: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for event in prof.key_averages():
        key = event.key.replace("aten::", "")
        measured[key] += event.self_cpu_time_total / 1e3 / 3
        calls[key] += event.count / 3
    step_ms = (prediction.micro_step_s + (0.0 if args.accumulate else prediction.optimizer_s)) * 1e3
    kernels = sum(_kernel_seconds(w, cal) for w in ops.micro_step) * 1e3
    host = prediction.micro_step_by_class_s["framework"] * 1e3
    mode = ", accumulating" if args.accumulate else ""
    print(
        f"{args.model}, micro-batch {args.micro}, {args.precision}{mode}: "
        f"measured {statistics.median(times) * 1e3:.2f} ms (thread CPU time), predicted {step_ms:.2f} ms "
        f"(micro-step kernels {kernels:.2f}, host {host:.2f}); "
        f"profiler self total {sum(measured.values()):.2f} ms (wall)\n"
    )
    print(f"{'operator':58s} {'predicted ms':>12s} {'n':>5s} | {'profiler ms':>11s} {'n':>6s}")
    for key in sorted(set(predicted) | set(measured), key=lambda k: -(measured[k] + predicted[k]))[
        : args.top
    ]:
        print(
            f"{key[:58]:58s} {predicted[key]:12.3f} {counts[key]:5d} | "
            f"{measured[key]:11.3f} {calls[key]:6.0f}"
        )


if __name__ == "__main__":
    main()
