"""``plan_quality.py --speed``: the plan's choice vs the fastest fitting configuration, timed for real.

See plan_quality.py's docstring. Models are small enough that every fitting configuration's step takes
well under a second on one CPU thread.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from resource_guard import demo
from resource_guard.devices import resolve_device
from resource_guard.estimate import estimate_memory
from resource_guard.planning.checkpointing import apply_checkpointing
from resource_guard.planning.op_time import cpu_calibration, measure_cpu
from resource_guard.planning.planner import plan
from resource_guard.step.batching import resize_batch

TARGET = 16
MIB = 2**20


def _autoencoder() -> tuple[nn.Module, Any, Callable[..., Any]]:
    model = nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 784),
    )  # fmt: skip
    return model, torch.randn(TARGET, 784), lambda m, b: nn.functional.mse_loss(m(b), b)


def _cnn() -> tuple[nn.Module, Any, Callable[..., Any]]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )  # fmt: skip
    batch = (torch.randn(TARGET, 3, 32, 32), torch.randint(0, 10, (TARGET,)))
    return model, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])


def _lstm() -> tuple[nn.Module, Any, Callable[..., Any]]:
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.lstm = nn.Embedding(1000, 64), nn.LSTM(64, 128, batch_first=True)
            self.head = nn.Linear(128, 1000)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(self.embed(tokens))[0])

    tokens = torch.randint(0, 1000, (TARGET, 33))

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())

    return Tagger(), tokens, loss


def _demo_gpt() -> tuple[nn.Module, Any, Callable[..., Any] | None]:
    model, _, batch = demo.build(batch_size=TARGET, seq_len=64, vocab_size=2048)
    return model, batch, lambda m, b: m(*b)


def _gpt2(layers: int, width: int, heads: int) -> tuple[nn.Module, Any, Callable[..., Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=64, vocab_size=2048)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 2048, (TARGET, 64))
    return model, ids, lambda m, b: m(input_ids=b, labels=b).loss


def _bert() -> tuple[nn.Module, Any, Callable[..., Any]]:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=2048, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=512, max_position_embeddings=64)  # fmt: skip
    model = BertForMaskedLM(config)
    ids = torch.randint(0, 2048, (TARGET, 64))
    return model, ids, lambda m, b: m(input_ids=b, labels=b).loss


def _vit() -> tuple[nn.Module, Any, Callable[..., Any]]:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=4, hidden_size=128, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=256, num_labels=10)  # fmt: skip
    model = ViTForImageClassification(config)
    batch = (torch.randn(TARGET, 3, 32, 32), torch.randint(0, 10, (TARGET,)))
    return model, batch, lambda m, b: m(pixel_values=b[0], labels=b[1]).loss


MODELS: dict[str, Callable[[], tuple[nn.Module, Any, Any]]] = {
    "demo gpt": _demo_gpt,
    "autoencoder": _autoencoder,
    "cnn": _cnn,
    "tiny gpt-2": lambda: _gpt2(2, 64, 4),
    "small gpt-2": lambda: _gpt2(4, 256, 4),
    "bert": _bert,
    "lstm": _lstm,
    "vit": _vit,
}


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: Any, loss_fn: Any, micro: int, prec: str
) -> None:
    for i in range(TARGET // micro):
        part = resize_batch_rows(batch, i * micro, micro)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16-mixed"):
            loss = loss_fn(model, part)
        (loss / (TARGET // micro)).backward()
    opt.step()
    opt.zero_grad()


def resize_batch_rows(batch: Any, start: int, size: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start : start + size]
    return type(batch)(resize_batch_rows(b, start, size) for b in batch)


def _cap(model: nn.Module, batch: Any, loss_fn: Any) -> int:
    """Halfway between the micro-batch 8 and 16 peaks: 16 does not fit, 8 and below do."""
    cpu = resolve_device("cpu")
    peaks = [
        estimate_memory(model, torch.optim.AdamW, resize_batch(batch, m), loss_fn, device="cpu")
        .for_device(cpu, gradients_kept=m < TARGET)
        .device_total_bytes
        for m in (8, 16)
    ]
    return (peaks[0] + peaks[1]) // 2


def run_one(name: str, rounds: int) -> dict[str, Any]:
    model, batch, loss_fn = MODELS[name]()
    cap = _cap(model, batch, loss_fn)
    t0 = time.perf_counter()
    plan(model, torch.optim.AdamW, batch, loss_fn, device="cpu", memory_limit=cap, headroom=0.0,
         target_batch_size=TARGET, step_time="rule")  # fmt: skip
    t1 = time.perf_counter()
    made = plan(model, torch.optim.AdamW, batch, loss_fn, device="cpu", memory_limit=cap, headroom=0.0,
                target_batch_size=TARGET, step_time="auto")  # fmt: skip
    t2 = time.perf_counter()
    configs = [a for a in made.alternatives if a.fits and a.predicted_step_ms is not None]
    opt = torch.optim.AdamW(model.parameters())
    times: dict[str, list[tuple[float, float]]] = {a.config(): [] for a in configs}
    for _ in range(rounds + 1):  # the first round warms up
        for a in configs:
            every = int(a.checkpointing)
            handle = apply_checkpointing(model, every=every) if every else None
            start, wall = time.thread_time(), time.perf_counter()
            _step(model, opt, batch, loss_fn, a.micro_batch_size, a.precision)
            times[a.config()].append((time.thread_time() - start, time.perf_counter() - wall))
            if handle is not None:
                handle.remove()
    rows = []
    for a in configs:
        measured = statistics.median(t for t, _ in times[a.config()][1:]) * 1e3
        wall = statistics.median(w for _, w in times[a.config()][1:]) * 1e3
        rows.append((a.config(), a.chosen, a.predicted_step_ms, measured, wall))
    fastest = min(rows, key=lambda r: r[3])
    chosen = next(r for r in rows if r[1])
    return {"case": name, "cap_mib": cap / MIB, "rows": rows, "fastest": fastest, "chosen": chosen,
            "rule_s": t1 - t0, "plan_s": t2 - t1}  # fmt: skip


def main(only: str | None, rounds: int) -> None:
    torch.set_num_threads(1)
    load = os.getloadavg()
    started = time.perf_counter()
    # the machine is shared: the steps are timed in this thread's CPU time (what they take on a core of
    # their own), as the planner's calibration is on one thread (op_time.default_timer); wall-clock
    # medians are printed beside them
    cal = cpu_calibration(refresh=True)
    print(
        f"target batch {TARGET}, precision auto, AdamW, CPU, 1 thread; medians of {rounds} interleaved "
        f"rounds in thread CPU time; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"({os.cpu_count()} CPUs); calibration {cal.calibration_s:.2f} s\n"
    )
    print(
        "| case | config | planning s auto / rule | predicted ms/step | measured ms/step | error "
        "| wall ms/step | chosen |"
    )
    print("|---|---|---:|---:|---:|---:|---:|:-:|")
    errors, gaps = [], []
    for name in MODELS:
        if only and only not in name:
            continue
        with contextlib.suppress(KeyboardInterrupt):
            r = run_one(name, rounds)
        for config, chosen, pred, meas, wall in r["rows"]:
            err = pred / meas - 1
            errors.append(abs(err))
            mark = "**yes**" if chosen else ""
            print(
                f"| {name} | {config} | {r['plan_s']:.1f} / {r['rule_s']:.1f} | {pred:,.1f} | {meas:,.1f} "
                f"| {err:+.0%} | {wall:,.1f} | {mark} |",
                flush=True,
            )
        gap = r["chosen"][3] / r["fastest"][3] - 1
        gaps.append((name, r["chosen"][0], r["fastest"][0], gap))
    print("\n| case | chosen | fastest measured | chosen vs fastest |")
    print("|---|---|---|---:|")
    for name, c, f, gap in gaps:
        print(f"| {name} | {c} | {f} | {gap:+.1%} |")
    within = sum(g <= 0.05 for *_, g in gaps)
    # the machine's drift while the steps ran: the same calibration measured again now
    later = measure_cpu()
    fp32 = [later.matmul_rate(torch.float32, f) / cal.matmul_rate(torch.float32, f) - 1 for f in (5e5, 3e8)]
    print(
        f"\ncalibration measured again at the end: fp32 matmul rates {fp32[0]:+.0%} (small) {fp32[1]:+.0%} "
        f"(large), host time per operator {later.op_overhead_s / cal.op_overhead_s - 1:+.0%} "
        "(a machine that got slower meanwhile makes the predictions read low)"
    )
    load = os.getloadavg()
    print(
        f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    print(
        f"\nchoice within 5% of the fastest: {within}/{len(gaps)}; median |prediction error| "
        f"{statistics.median(errors):.0%} (target <= 10%); within 20%: "
        f"{sum(e <= 0.2 for e in errors)}/{len(errors)}"
    )
