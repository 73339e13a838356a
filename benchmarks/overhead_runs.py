"""The cost of watching, measured from outside (issue #42): whole runs, each in a fresh process, with
no tool and under each door's defaults, interleaved.

Loops (batches held in memory, so nothing waits for data; torch's intra-op threads fill the cores):

- ``small``: the MLP 256 -> 768 -> 256 -> 10, batch 64, SGD with momentum (a few ms a step);
- ``large``: an MLP of six 1024 x 1024 layers, batch 256 (tens of ms a step);
- ``lightning``: the small MLP under ``Trainer.fit`` with a TensorBoard logger.

Variants of the plain loops: ``none`` (the bare loop), ``guard`` (``with guard(model, optimizer,
log_dir=...) as g`` and ``g.iterate`` / ``g.backward``, every default: monitor, profiler window, shape
check), ``unchanged`` (the bare loop left as written inside ``with guard(model, optimizer,
log_dir=...)``: the door that watches through hooks), ``nomonitor`` (``guard(..., monitor=False)``:
the guard's own loop work). Lightning: ``none`` and ``guard`` (``ResourceGuard()``, defaults).
``traceml`` beside them where ``traceml`` is importable (not on this machine).

Each run stamps the end of every step in its own loop body (the same code in every variant). Per
run: the median step after a warm-up (``--warmup``), and the loop's whole wall time from its first to
its last step, which includes the profiler window and every log boundary (set-up before the first step
and ``close`` after the last are timed apart). Per variant: the median over repetitions of the run's
figure against the ``none`` run of the same repetition (a burst of load hits both), with the range.

Run:  python benchmarks/monitor_overhead.py [--reps 5] [--steps 300] [--loops small,large,lightning]
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

LOOPS = {
    "small": ("none", "guard", "unchanged", "nomonitor"),
    "large": ("none", "guard", "unchanged", "nomonitor"),
    "lightning": ("none", "guard"),
}
_TRACEML = importlib.util.find_spec("traceml") is not None


def _threads() -> int:
    """Torch's intra-op threads in a run: ``RG_BENCH_THREADS``, else every core."""
    return int(os.environ.get("RG_BENCH_THREADS") or _cores())


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _model(loop: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if loop == "large":
        layers: list[nn.Module] = []
        for _ in range(6):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(1024, 10))
    return nn.Sequential(
        nn.Linear(256, 768), nn.GELU(), nn.Linear(768, 256), nn.LayerNorm(256), nn.Linear(256, 10)
    )


def _batches(loop: str, steps: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    width, batch = (1024, 256) if loop == "large" else (256, 64)
    return [
        (torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(steps)
    ]


def _stamp(stamps: list[float], cpu: list[float]) -> None:
    stamps.append(time.perf_counter())
    cpu.append(time.thread_time())


def _child(loop: str, variant: str, steps: int, root: str) -> dict[str, Any]:
    """One run: ``{"stamps": [...], "cpu": [...], "setup_s", "close_s"}`` (the end of every step on the
    wall clock and on the training thread's CPU clock, seconds)."""
    import torch
    from torch import nn

    torch.set_num_threads(_threads())
    warnings.simplefilter("ignore")
    stamps: list[float] = []
    cpu: list[float] = []
    if loop == "lightning":
        return _lightning(variant, steps, root)
    model = _model(loop)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = _batches(loop, steps)
    begun = time.perf_counter()
    closing = None
    if variant == "none":
        begun = time.perf_counter()
        for x, y in data:
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _stamp(stamps, cpu)
    elif variant in ("guard", "nomonitor"):
        from resource_guard import guard

        kwargs: dict[str, Any] = {"log_dir": root} if variant == "guard" else {"monitor": False}
        g = guard(model, optimizer, **kwargs)
        with g:
            for x, y in g.iterate(data):
                g.backward(nn.functional.cross_entropy(model(x), y))
                _stamp(stamps, cpu)
            closing = time.perf_counter()
    elif variant == "unchanged":
        from resource_guard import guard

        with guard(model, optimizer, log_dir=root):
            for x, y in data:
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                _stamp(stamps, cpu)
            closing = time.perf_counter()
    elif variant == "traceml":  # pragma: no cover - not installed here
        import traceml  # type: ignore[import-not-found]

        traceml.init()  # its README's quick start (traceml-ai 0.2.x): init, then wrap each step
        for x, y in data:
            with traceml.trace_step(model):
                optimizer.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
            _stamp(stamps, cpu)
    else:
        raise ValueError(variant)
    ended = time.perf_counter()
    return {
        "stamps": stamps,
        "cpu": cpu,
        "setup_s": (stamps[0] - begun) if stamps else None,  # includes the first step
        "close_s": None if closing is None else ended - closing,
    }


def _lightning(variant: str, steps: int, root: str) -> dict[str, Any]:
    import logging

    import lightning.pytorch as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch import nn
    from torch.utils.data import DataLoader

    from resource_guard import ResourceGuard

    for name in ("lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    data = _batches("small", steps)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model("small")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(data, batch_size=None)

    class Timing(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu: list[float] = []
            self.end: float | None = None

        def on_train_batch_end(self, *args: Any) -> None:
            _stamp(self.stamps, self.cpu)

        def on_train_end(self, *args: Any) -> None:
            self.end = time.perf_counter()

    timing = Timing()
    callbacks: list[Callback] = [ResourceGuard()] if variant == "guard" else []
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=TensorBoardLogger(root, name=variant),
        log_every_n_steps=50, callbacks=[*callbacks, timing], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    begun = time.perf_counter()
    trainer.fit(Module())
    ended = time.perf_counter()
    return {
        "stamps": timing.stamps,
        "cpu": timing.cpu,
        "setup_s": timing.stamps[0] - begun if timing.stamps else None,
        "close_s": None if timing.end is None else ended - timing.end,
    }


def run_once(loop: str, variant: str, steps: int, warmup: int) -> dict[str, Any]:
    """One run in a fresh interpreter: its median step after ``warmup`` and its loop's wall time."""
    with tempfile.TemporaryDirectory() as root:
        out = Path(root) / "out.json"
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        env.pop("OMP_NUM_THREADS", None)
        cmd = [sys.executable, __file__, "--child", loop, variant, str(steps), str(out), root]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{loop}/{variant} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        data = json.loads(out.read_text())
    stamps = data["stamps"]
    diffs = [b - a for a, b in zip(stamps, stamps[1:])]
    body = diffs[warmup:]
    cpu = data["cpu"]
    cpu_body = [b - a for a, b in zip(cpu, cpu[1:])][warmup:]
    return {
        "median_step_s": statistics.median(body),
        "median_cpu_s": statistics.median(cpu_body),
        "loop_s": stamps[-1] - stamps[0],
        "setup_s": data["setup_s"],
        "close_s": data["close_s"],
        "steps": len(stamps),
    }


def compare(loops: list[str], reps: int, steps: dict[str, int], warmup: int) -> dict[str, Any]:
    """Every loop's variants, ``reps`` interleaved repetitions in a rotating order."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for loop in loops:
        variants = list(LOOPS[loop]) + (["traceml"] if _TRACEML and loop != "lightning" else [])
        runs[loop] = {v: [] for v in variants}
    for rep in range(reps):
        for loop in loops:
            variants = list(runs[loop])
            k = rep % len(variants)
            for variant in variants[k:] + variants[:k]:
                runs[loop][variant].append(run_once(loop, variant, steps[loop], warmup))
            print(f"  rep {rep + 1}/{reps} {loop} done", file=sys.stderr, flush=True)
    return {loop: _summary(by_variant) for loop, by_variant in runs.items()}


def _summary(by_variant: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = by_variant["none"]
    out: dict[str, Any] = {}
    for variant, rows in by_variant.items():
        step = [r["median_step_s"] / b["median_step_s"] - 1 for r, b in zip(rows, base)]
        cpu = [r["median_cpu_s"] / b["median_cpu_s"] - 1 for r, b in zip(rows, base)]
        loop = [(r["loop_s"] - b["loop_s"]) / (b["loop_s"]) for r, b in zip(rows, base)]
        out[variant] = {
            "median_step_ms": statistics.median(r["median_step_s"] for r in rows) * 1e3,
            "step_overhead": statistics.median(step),
            "step_overhead_range": (min(step), max(step)),
            "median_cpu_ms": statistics.median(r["median_cpu_s"] for r in rows) * 1e3,
            "cpu_overhead": statistics.median(cpu),
            "cpu_overhead_range": (min(cpu), max(cpu)),
            "loop_overhead": statistics.median(loop),
            "loop_overhead_range": (min(loop), max(loop)),
            "loop_extra_ms": statistics.median(r["loop_s"] - b["loop_s"] for r, b in zip(rows, base)) * 1e3,
            "setup_s": _median([r["setup_s"] for r in rows]),
            "close_s": _median([r["close_s"] for r in rows]),
            "runs": len(rows),
        }
    return out


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def print_table(results: dict[str, Any], steps: dict[str, int], reps: int, load: float) -> None:
    print(
        f"\nWhole runs, each in a fresh process, {reps} interleaved repetitions, {_threads()} torch threads "
        f"on {_cores()} cores; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(
        "| loop | variant | median step (ms) | step vs none: median (range) | thread CPU per step (ms) | "
        "CPU vs none: median (range) | whole loop vs none: median (range), extra ms | set-up s | close s |"
    )
    print("|---|---|---:|---|---:|---|---|---:|---:|")
    for loop, rows in results.items():
        for variant, r in rows.items():
            lo, hi = r["step_overhead_range"]
            llo, lhi = r["loop_overhead_range"]
            clo, chi = r["cpu_overhead_range"]
            setup = "-" if r["setup_s"] is None else f"{r['setup_s']:.2f}"
            close = "-" if r["close_s"] is None else f"{r['close_s']:.2f}"
            print(
                f"| {loop} ({steps[loop]} steps) | {variant} | {r['median_step_ms']:.2f} | "
                f"{r['step_overhead']:+.1%} ({lo:+.1%} .. {hi:+.1%}) | {r['median_cpu_ms']:.2f} | "
                f"{r['cpu_overhead']:+.1%} ({clo:+.1%} .. {chi:+.1%}) | "
                f"{r['loop_overhead']:+.1%} ({llo:+.1%} .. {lhi:+.1%}), {r['loop_extra_ms']:+.0f} | "
                f"{setup} | {close} |"
            )
    if not _TRACEML:
        print("TraceML (traceml) is not importable here: its column is left out.")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    _loop, _variant, _steps, _out, _root = sys.argv[2:7]
    with contextlib.redirect_stdout(sys.stderr):
        result = _child(_loop, _variant, int(_steps), _root)
    Path(_out).write_text(json.dumps(result))
