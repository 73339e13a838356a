"""What always-on monitoring costs per training step, measured as a user feels it.

**Default (issue #42): whole runs, measured from outside** (:mod:`overhead_runs`): each run in a fresh
process, no tool vs each door with its defaults (``guard`` with ``g.iterate``, the unchanged loop inside
``guard``, ``guard(monitor=False)``, ``ResourceGuard()`` under Lightning; TraceML where importable), on
a small CPU step and a larger one (MLP 1024 x 6) with torch's threads filling the cores, and a Lightning
run; repetitions interleaved in a rotating order; per variant the median over repetitions of its run's
median step (and of its whole loop's wall time, profiler window and log boundaries included) against
the bare run of the same repetition, with the range. ``--threads N`` sets torch's intra-op threads
(default: every core). ``--hooks`` instead times the unchanged-loop door's per-parameter
post-accumulate-grad hooks (``frontdoors/guard/observed.py``) on a model of a few hundred tensors.

Run:  python benchmarks/monitor_overhead.py [--reps 5] [--loops small,large,lightning] [--json PATH]

**``--in-process``** (issues #22, #29): the earlier comparison inside one process:
Two loops train the same small MLP on this CPU (256 -> 768 -> 256 -> 10, batch 64, SGD, batches held
in memory so nothing waits for data; one torch thread, about 3 ms a step):

- **Lightning**: ``Trainer.fit`` with a TensorBoard logger, ``log_every_n_steps=50``, and one of
  ``none`` (no callback), ``empty`` (a ``Callback`` with no code: Lightning's own cost of calling a
  callback's hooks), ``guard`` (``ResourceGuard(profile=False)`` with the plan pinned to the baseline
  configuration: 32-true, no checkpointing, accumulation 1, the loader's batch; so only monitoring
  differs) and ``dsm`` (Lightning's ``DeviceStatsMonitor(cpu_stats=True)``).
- **plain PyTorch**: a bare loop vs the same loop under ``guard(..., profile=False)`` with its monitor,
  and under ``guard(..., monitor=False)`` (the guard's own loop work without monitoring).

Each run's step time is the mean over its steps after a warm-up (``--warmup``), taken by a timing
callback that every Lightning variant carries (the plain loops time themselves). Rounds interleave the
variants in a rotating order in this one process; the figures are medians over rounds of each variant's
step time minus the baseline's step time *in the same round* (so a burst of load on the shared machine
hits both sides of a difference), in µs per step and in % of the baseline step. Set-up (planning,
``start``/``close``) is outside the timed steps.

Also printed: the monitor's per-step calls timed alone (``batch_ready`` + ``step_end`` on a step that
does not log, and the extra cost of a step that logs: the median of 20 log boundaries 50 steps apart,
with 3 ms of GIL-free time per step as a training step leaves TensorBoard's background flusher),
which is the floor the loop figures cannot show on a noisy machine. Target (issues #22, #29):
monitoring <= 0.2% of the step.

Run:  python benchmarks/monitor_overhead.py --in-process [--rounds 15] [--steps 300] [--json PATH] 2>/dev/null

``--close`` instead prints what closing the monitor costs at the end of a run, door by door (issue #40:
under a second for a small run): ``guard`` on the demo (``resource-guard demo``'s TinyGPT, 12 steps), the
Lightning callback on a small ``Trainer.fit`` (an MLP, 40 steps) and the Trainer callback on a tiny GPT-2
(20 steps), each with the default profiler window, ``--close-reps`` runs each (default 3, medians). The
table gives ``RunMonitor.close`` as a whole (wall and the closing thread's CPU time), its parts (the
profiler's events read into records, their summary, the trace file, the wait for the memory picture,
the rest), the memory picture's drawing on its own thread from the start, and the loop's wait for it
before the profiler window (see :func:`close_times`).

Run:  python benchmarks/monitor_overhead.py --close [--close-reps 3] [--json PATH]

Wall time is what a user feels, and on a shared machine it is also what other processes disturb most;
the training thread's CPU time (``time.thread_time``) leaves out the time the thread was not running, so
its differences are steadier, but it also leaves out the monitor's waits (the TensorBoard flush at a log
boundary waits for the writer's thread). Both are printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TARGET = 0.002
BATCH = 64


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, 768), nn.GELU(), nn.Linear(768, 256), nn.LayerNorm(256), nn.Linear(256, 10)
    )


def _data(n_batches: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n_batches * BATCH, 256, generator=g),
        torch.randint(0, 10, (n_batches * BATCH,), generator=g),
    )


# -- Lightning -------------------------------------------------------------------------------------------


def _per_step(stamps: list[tuple[int, int]], warmup: int) -> tuple[float, float]:
    """Mean (wall, training-thread CPU) seconds per step after ``warmup`` steps."""
    if len(stamps) <= warmup + 1:
        raise RuntimeError(f"only {len(stamps)} steps ran")
    n = len(stamps) - 1 - warmup
    (w0, c0), (w1, c1) = stamps[warmup], stamps[-1]
    return (w1 - w0) / n / 1e9, (c1 - c0) / n / 1e9


def _stamp() -> tuple[int, int]:
    return time.perf_counter_ns(), time.thread_time_ns()


def lightning_run(variant: str, steps: int, warmup: int, root: str) -> tuple[float, float]:
    """Mean (wall, CPU) seconds per training step after ``warmup`` steps of one ``Trainer.fit``."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor
    from lightning.pytorch.loggers import TensorBoardLogger

    from resource_guard import ResourceGuard

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = _mlp()
            self.batch_size = BATCH

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_data(steps), batch_size=self.batch_size)

    class Timing(Callback):
        def __init__(self) -> None:
            self.stamps: list[tuple[int, int]] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.stamps.append(_stamp())

    callbacks: list[Callback] = []
    if variant == "empty":
        callbacks.append(Callback())
    elif variant == "guard":
        callbacks.append(
            ResourceGuard(
                precision="32-true", checkpointing=False, accumulation=1, profile=False, headroom=0.0
            )
        )
    elif variant == "dsm":
        callbacks.append(DeviceStatsMonitor(cpu_stats=True))
    timing = Timing()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(root, name=variant),
        log_every_n_steps=50,
        callbacks=[*callbacks, timing],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module())
    return _per_step(timing.stamps, warmup)


# -- plain PyTorch ---------------------------------------------------------------------------------------


def plain_run(variant: str, steps: int, warmup: int, root: str) -> tuple[float, float]:
    """Mean (wall, CPU) seconds per step after ``warmup`` steps: a bare loop, or the loop under ``guard``."""
    from resource_guard import guard

    torch.manual_seed(0)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(_data(steps), batch_size=BATCH)
    stamps: list[tuple[int, int]] = []
    if variant == "bare":
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stamps.append(_stamp())
    else:
        monitor = variant == "guard"
        with guard(
            model,
            optimizer,
            device="cpu",
            precision="32-true",
            checkpointing=False,
            headroom=0.0,
            monitor=monitor,
            profile=False,
            log_dir=f"{root}/{variant}-{time.perf_counter_ns()}" if monitor else None,
        ) as g:
            for x, y in g.iterate(loader):
                with g.autocast():
                    loss = nn.functional.cross_entropy(model(x), y)
                g.backward(loss)
                stamps.append(_stamp())
    return _per_step(stamps, warmup)


# -- the monitor's own calls -----------------------------------------------------------------------------


def monitor_calls(log_dir: str, n: int = 5000) -> tuple[float, float]:
    """Seconds of ``batch_ready`` + ``step_end`` on a step that does not log, and the extra seconds of
    a step that logs (TensorBoard in ``log_dir``), with no training around them."""
    from resource_guard.observe.monitor import RunMonitor

    batch = (torch.randn(BATCH, 256), torch.randint(0, 10, (BATCH,)))
    mon = RunMonitor(log_dir, profile=False, summary=False, log_every_n_steps=10**9)
    mon.start()
    for _ in range(50):
        mon.batch_ready(batch)
        mon.step_end()
    best = []
    for _ in range(5):
        t = time.perf_counter_ns()
        for _ in range(n):
            mon.batch_ready(batch)
            mon.step_end()
        best.append((time.perf_counter_ns() - t) / n / 1e9)
    mon.close()
    per_step = min(best)
    # a logging step as a run meets it: every 50th step, 3 ms of compute (a sleep: the GIL released, as
    # torch ops release it) between steps, so TensorBoard's flusher runs while the loop computes
    mon = RunMonitor(log_dir, profile=False, summary=False, log_every_n_steps=50)
    mon.start()
    logging_steps: list[float] = []
    for i in range(1, 50 * 21 + 1):
        time.sleep(0.003)
        mon.batch_ready(batch)
        t = time.perf_counter_ns()
        mon.step_end()
        if i % 50 == 0 and i > 50:
            logging_steps.append((time.perf_counter_ns() - t) / 1e9)
    mon.close()
    per_logging_step = statistics.median(logging_steps)
    return per_step, max(0.0, per_logging_step - per_step)


def dispatch_costs(n: int = 2000) -> dict[str, float]:
    """Seconds per training step that Lightning spends calling one callback's per-step hooks (those of
    ``on_train_batch_start`` .. ``on_train_batch_end``), beyond a Trainer with no callback: the fixed
    cost of being a callback. ``guard`` here is ``ResourceGuard``'s dispatch alone (no monitor running).
    """
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.trainer import call

    from resource_guard import ResourceGuard

    makers = {
        "none": lambda: None,
        "empty": Callback,
        "guard": lambda: ResourceGuard(monitor=False, profile=False),
    }
    batch, loss = torch.randn(2, 32), torch.zeros((), requires_grad=True)
    runs = {}
    for name, make in makers.items():
        callback = make()
        trainer = L.Trainer(
            max_steps=1,
            callbacks=[callback] if callback is not None else [],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(BoringModel())
        optimizer = trainer.optimizers[0]
        hooks = [
            ("on_train_batch_start", (batch, 0)),
            ("on_before_backward", (loss,)),
            ("on_after_backward", ()),
            ("on_before_optimizer_step", (optimizer,)),
            ("on_before_zero_grad", (optimizer,)),
            ("on_train_batch_end", ({"loss": loss}, batch, 0)),
        ]
        runs[name] = (trainer, hooks)
    out = dict.fromkeys(runs, math.inf)
    for _ in range(15):  # round-robin, best of 15: what the calls cost when nothing else runs
        for name, (trainer, hooks) in runs.items():
            t = time.perf_counter_ns()
            for _ in range(n):
                for hook, args in hooks:
                    call._call_callback_hooks(trainer, hook, *args)
            out[name] = min(out[name], (time.perf_counter_ns() - t) / n / 1e9)
    return {name: value - out["none"] for name, value in out.items() if name != "none"}


def in_run(steps: int, block: int, part: str, warmup: int = 200) -> dict[str, float]:
    """The monitor's cost inside one ``guard`` run: blocks of ``block`` steps alternate between the
    monitor on and ``part`` of it off (``"all"``; ``"clock"``, the phase switches; ``"monitor"``, the
    per-step calls and log boundaries). The same model, memory layout and data on both sides, so the
    differences are not buried under the run-to-run spread of separate runs (a freshly built model's
    step varies by ~3% from one run to the next, ten times the effect). Returns the medians over block
    pairs of (on − off) training-thread CPU and wall time per step, in seconds, and their quartiles.

    Reaches into the guard for the switch (``_run.monitor``, ``_clock``, the stepper's ``clock``): a
    benchmark of internals, not an API.
    """
    from resource_guard import guard

    torch.manual_seed(0)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = _data(256)

    def batches():
        for i in range(steps):
            if i % 256 == 0:
                loader = iter(DataLoader(data, batch_size=BATCH))
            yield next(loader)

    means: dict[str, dict[bool, list[float]]] = {"cpu": {True: [], False: []}, "wall": {True: [], False: []}}
    with tempfile.TemporaryDirectory() as tmp, guard(
        model, optimizer, device="cpu", precision="32-true", checkpointing=False, headroom=0.0,
        profile=False, log_dir=tmp,
    ) as g:  # fmt: skip
        on, saved = True, None
        cpu, wall = [], []
        t0, w0 = time.thread_time(), time.perf_counter()
        for n, (x, y) in enumerate(g.iterate(batches()), start=1):
            with g.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            g.backward(loss)
            t1, w1 = time.thread_time(), time.perf_counter()
            cpu.append(t1 - t0)
            wall.append(w1 - w0)
            t0, w0 = t1, w1
            if n % block:
                continue
            if n > warmup:  # the block's first step holds the switch: left out
                means["cpu"][on].append(statistics.mean(cpu[1:]))
                means["wall"][on].append(statistics.mean(wall[1:]))
            cpu, wall = [], []
            on = not on
            if on:
                g._run.monitor, g._clock, g._stepper.clock = saved
                continue
            saved = (g._run.monitor, g._clock, g._stepper.clock)
            if part in ("all", "monitor"):
                g._run.monitor = None
            if part in ("all", "clock"):
                g._clock = g._stepper.clock = None
        if not on:
            g._run.monitor, g._clock, g._stepper.clock = saved
    out: dict[str, float] = {}
    for kind, by in means.items():
        pairs = [a - b for a, b in zip(by[True], by[False])]
        out[f"{kind}_s"] = statistics.median(pairs)
        out[f"{kind}_q1_s"], _, out[f"{kind}_q3_s"] = statistics.quantiles(pairs, n=4)
        out[f"{kind}_step_s"] = statistics.median(by[False])
    out["pairs"] = len(pairs)
    return out


def close_times(reps: int = 1) -> dict[str, dict[str, Any]]:
    """Each door's ``RunMonitor.close`` on a small run (see the module docstring), as a table of its parts.

    The parts are timed here from outside (a wrapper around each, this benchmark only): reading the
    profiler's events into records, the summary of those records, the trace file (torch writing the
    JSON, then the wait for its compression, which runs on a thread meanwhile), the wait for the
    memory picture, and the rest of the close (the report, its files, TensorBoard); and the closing
    thread's CPU time (``close CPU``: what the close costs on an idle machine, where a loaded one
    stretches the wall time; the trace's compression runs on a thread of its own). Also the memory
    picture's own drawing on its thread and the loop's wait for it before the profiler window (both
    outside the close). ``reps`` > 1 repeats each door and prints the median of each column.
    """
    from resource_guard.observe import outputs, profiling
    from resource_guard.observe.monitor import RunMonitor

    parts: dict[str, float] = {}
    seen: dict[str, Any] = {}

    def timed(owner: Any, name: str, label: str) -> Any:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            begun = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts[label] = parts.get(label, 0.0) + time.perf_counter() - begun

        setattr(owner, name, wrapper)
        return original

    class Job(outputs.PictureJob):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen["job"] = self

    close = RunMonitor.close

    def closing(self: RunMonitor, exc: BaseException | None = None) -> Any:
        seen["monitor"] = self
        begun, cpu = time.perf_counter(), time.thread_time()
        try:
            return close(self, exc)
        finally:
            parts["close"] = parts.get("close", 0.0) + time.perf_counter() - begun
            parts["close CPU"] = parts.get("close CPU", 0.0) + time.thread_time() - cpu

    RunMonitor.close = closing  # type: ignore[method-assign]
    originals = [
        (RunMonitor, "close", close),
        (profiling, "_records", timed(profiling, "_records", "events read")),
        (profiling, "summarize_events", timed(profiling, "summarize_events", "summary")),
        (profiling.StepProfiler, "_export", timed(profiling.StepProfiler, "_export", "trace file")),
        (profiling._TraceFile, "finish", timed(profiling._TraceFile, "finish", "trace file")),
        (outputs.MonitorOutputs, "_picture", timed(outputs.MonitorOutputs, "_picture", "picture wait")),
        (outputs, "PictureJob", outputs.PictureJob),
    ]
    outputs.PictureJob = Job  # type: ignore[misc]
    columns = ("close", "close CPU", "events read", "summary", "trace file", "picture wait", "rest")
    results: dict[str, dict[str, Any]] = {}
    print(f"close of each door, seconds ({reps} run(s) each, median); load average {os.getloadavg()[0]:.1f}")
    print(
        f"  {'door':<14}{'steps':>6}"
        + "".join(f"{c:>13}" for c in columns)
        + f"{'drawn (thread)':>16}{'loop wait':>11}"
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for door, run in (
                ("guard (demo)", _demo),
                ("Lightning", _lightning_small),
                ("Trainer", _trainer),
            ):
                rows: list[dict[str, float]] = []
                report = None
                for rep in range(reps):
                    parts.clear()
                    seen.clear()
                    report = run(f"{tmp}/{door[:5]}{rep}")
                    if report is None:
                        break
                    row = {c: parts.get(c, 0.0) for c in columns[:-1]}
                    row["rest"] = row["close"] - sum(row[c] for c in columns[2:-1])
                    job = seen.get("job")
                    row["drawn"] = job.wall_s if job is not None else math.nan
                    row["loop wait"] = getattr(seen.get("monitor"), "_picture_wait_s", math.nan)
                    row["report close_s"] = (
                        report.stats.close_s if report.stats.close_s is not None else math.nan
                    )
                    rows.append(row)
                if report is None:
                    print(f"  {door:<14} skipped (not installed)")
                    continue
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                results[door] = {"steps": report.stats.steps, "median_s": med, "runs": rows,
                                 "report_close_parts": dict(report.stats.close_parts or {})}  # fmt: skip
                print(
                    f"  {door:<14}{report.stats.steps:>6}" + "".join(f"{med[c]:>13.3f}" for c in columns)
                    + f"{med['drawn']:>16.3f}{med['loop wait']:>11.3f}"
                )  # fmt: skip
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return results


def _demo(root: str) -> Any:
    from resource_guard.demo import run_demo

    return run_demo(log_dir=root).report


def _lightning_small(root: str) -> Any:
    import lightning as L

    from resource_guard import ResourceGuard

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    rg = ResourceGuard(log_dir=f"{root}/rg")
    trainer = L.Trainer(
        max_steps=40, default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[rg],
    )  # fmt: skip
    trainer.fit(Net(), DataLoader(_data(40), batch_size=BATCH))
    return rg.report


def _trainer(root: str) -> Any:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    except ImportError:
        return None
    from resource_guard import ResourceGuardCallback

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    rows = [{"input_ids": torch.arange(32) % 128, "labels": torch.arange(32) % 128} for _ in range(80)]
    args = TrainingArguments(
        root, use_cpu=True, report_to=[], save_strategy="no", max_steps=20, logging_steps=5,
        disable_tqdm=True, per_device_train_batch_size=4,
    )  # fmt: skip
    callback = ResourceGuardCallback(verbose=False)
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=rows, callbacks=[callback]).train()
    return callback.report


def _summary(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    """Per variant: the median step, and the medians over rounds of its difference from the baseline of
    the same round (µs per step, share of the baseline's step), with the quartiles of the share."""
    out = {}
    for name, values in times.items():
        row = {"step_ms_median": statistics.median(values) * 1e3}
        if name != base:
            diffs = [v - b for v, b in zip(values, times[base])]
            share = [v / b - 1 for v, b in zip(values, times[base])]
            row["overhead_us_per_step_median"] = statistics.median(diffs) * 1e6
            row["overhead_share_median"] = statistics.median(share)
            row["overhead_share_q1"], _, row["overhead_share_q3"] = statistics.quantiles(share, n=4)
        out[name] = row
    return out


def _print(title: str, rows: dict[str, dict[str, float]], base: str) -> None:
    print(title)
    for name, row in rows.items():
        line = f"  {name:<7} {row['step_ms_median']:.3f} ms/step"
        if name != base:
            line += (
                f"   {row['overhead_us_per_step_median']:+7.1f} us/step   "
                f"{row['overhead_share_median']:+.2%} of the step "
                f"(quartiles {row['overhead_share_q1']:+.2%} .. {row['overhead_share_q3']:+.2%})"
            )
        print(line)


def whole_runs(args: argparse.Namespace) -> dict[str, Any]:
    """The default: whole runs in fresh processes (:mod:`overhead_runs`), printed as a table."""
    import overhead_runs

    if args.threads is not None:
        os.environ["RG_BENCH_THREADS"] = str(args.threads)
    loops = [name.strip() for name in args.loops.split(",") if name.strip()]
    unknown = set(loops) - set(overhead_runs.LOOPS)
    if unknown:
        raise SystemExit(f"--loops: unknown {sorted(unknown)}; choose from {sorted(overhead_runs.LOOPS)}")
    steps = {"small": args.steps, "lightning": args.steps, "large": max(60, args.steps // 4)}
    load = os.getloadavg()[0]
    results = overhead_runs.compare(loops, args.reps, steps, args.warmup)
    overhead_runs.print_table(results, steps, args.reps, load)
    return {"steps": steps, "reps": args.reps, "load_before": load, "loops": results}


def hook_cost(tensors: int = 300, calls: int = 200) -> dict[str, float]:
    """What a post-accumulate-grad hook on every trainable tensor costs a backward, like the one
    ``frontdoors/guard/observed.py`` installs (a callable object whose function reads the clock and sets
    two attributes): µs per backward on a model of ``tensors`` parameter tensors, 1 torch thread, the
    training thread's CPU time, median over alternating blocks with and without the hooks."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(tensors // 2)))
    x = torch.randn(8, 16)

    class Watch:
        _inside = False
        _last = 0.0
        pending = False

        def grad_accumulated(self, param: torch.Tensor) -> None:
            if not self._inside:
                self._last = time.perf_counter()
                self.pending = True

    class Hook:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __call__(self, *args: Any) -> Any:
            return self.fn(*args)

    def block(n: int) -> float:
        begun = time.thread_time()
        for _ in range(n):
            model(x).sum().backward()
        return (time.thread_time() - begun) / n

    block(20)
    off: list[float] = []
    on: list[float] = []
    hook = Hook(Watch().grad_accumulated)
    for _ in range(calls // 20):
        off.append(block(20))
        handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
        on.append(block(20))
        for handle in handles:
            handle.remove()
    base, extra = statistics.median(off), statistics.median(a - b for a, b in zip(on, off))
    print(
        f"post-accumulate-grad hooks on {tensors} tensors: +{extra * 1e6:.0f} us per backward "
        f"({extra / tensors * 1e6:.2f} us per tensor) on a {base * 1e3:.2f} ms forward + backward "
        f"(+{extra / base:.1%}); training thread's CPU time, median of {len(on)} block pairs"
    )
    return {"tensors": tensors, "us_per_backward": extra * 1e6, "base_ms": base * 1e3, "share": extra / base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--only", choices=("lightning", "plain"), default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--close", action="store_true", help="instead: each door's close time")
    parser.add_argument("--close-reps", type=int, default=3, help="--close: runs of each door (median)")
    parser.add_argument("--in-process", action="store_true", help="instead: the in-process comparison")
    parser.add_argument("--hooks", action="store_true", help="instead: the unchanged loop's grad hooks")
    parser.add_argument("--reps", type=int, default=5, help="whole runs: repetitions (default 5)")
    parser.add_argument(
        "--loops", default="small,large,lightning", help="whole runs: loops (small, large, lightning)"
    )
    parser.add_argument("--threads", type=int, default=None, help="whole runs: torch threads (all cores)")
    parser.add_argument(
        "--in-run", type=int, default=0, metavar="STEPS",
        help="instead: the monitor's cost inside one guard run of STEPS steps, by part (blocks of 25)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.hooks:
        results = hook_cost()
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    if not (args.close or args.in_process or args.in_run):
        results = whole_runs(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in ("lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    if args.close:
        results = close_times(args.close_reps)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    if args.in_run:
        results = {}
        print(f"inside one guard run: {args.in_run} steps, blocks of 25 alternating on / off, 1 torch thread")
        for part in ("all", "clock", "monitor"):
            row = results[part] = in_run(args.in_run, 25, part)
            print(
                f"  {part:<8} off: {row['cpu_s'] * 1e6:+6.2f} us/step CPU "
                f"({row['cpu_s'] / row['cpu_step_s']:+.2%} of {row['cpu_step_s'] * 1e3:.2f} ms; quartiles "
                f"{row['cpu_q1_s'] * 1e6:+.1f} .. {row['cpu_q3_s'] * 1e6:+.1f}), "
                f"{row['wall_s'] * 1e6:+6.2f} us/step wall, {row['pairs']} block pairs"
            )
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    doors = {
        "lightning": (("none", "empty", "guard", "dsm"), lightning_run, "Lightning Trainer.fit"),
        "plain": (("bare", "nomon", "guard"), plain_run, "plain loop"),
    }
    if args.only:
        doors = {args.only: doors[args.only]}
    walls: dict[str, dict[str, list[float]]] = {d: {v: [] for v in spec[0]} for d, spec in doors.items()}
    cpus: dict[str, dict[str, list[float]]] = {d: {v: [] for v in spec[0]} for d, spec in doors.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for variants, run, _ in doors.values():  # warm-up: imports, thread pools, the first plan
            for v in variants:
                run(v, 60, 10, tmp)
        for r in range(args.rounds):
            for door, (variants, run, _) in doors.items():
                k = r % len(variants)
                for v in variants[k:] + variants[:k]:
                    wall, cpu = run(v, args.steps, args.warmup, tmp)
                    walls[door][v].append(wall)
                    cpus[door][v].append(cpu)
        per_step, per_log = monitor_calls(f"{tmp}/calls")
        dispatch = dispatch_costs() if "lightning" in doors else {}
    results: dict[str, Any] = {"steps": args.steps, "rounds": args.rounds, "warmup": args.warmup}
    print(f"{args.rounds} interleaved rounds of {args.steps} steps ({args.warmup} warm-up), 1 torch thread")
    for door, (variants, _, title) in doors.items():
        base = variants[0]
        results[door] = {"wall": _summary(walls[door], base), "thread_cpu": _summary(cpus[door], base)}
        _print(f"{title}, wall time (vs {base}):", results[door]["wall"], base)
        _print(f"{title}, training thread's CPU time (vs {base}):", results[door]["thread_cpu"], base)
    first = next(iter(doors))
    # the share of a step is taken of the baseline's training-thread CPU time per step: what the step
    # takes when the thread is not kept waiting by other processes (an idle machine's wall time)
    step_s = statistics.median(cpus[first][doors[first][0][0]])
    direct = (per_step + per_log / 50) / step_s
    results["monitor_calls"] = {
        "us_per_step": per_step * 1e6,
        "us_per_logging_step_extra": per_log * 1e6,
        "share_of_step_at_log_every_50": direct,
    }
    print(
        f"monitor calls alone: {per_step * 1e6:.2f} us per step, +{per_log * 1e6:.0f} us per logging step; "
        f"{direct:.3%} of a {step_s * 1e3:.2f} ms step at log_every_n_steps=50"
    )
    if dispatch:
        results["lightning_dispatch_us_per_step"] = {k: v * 1e6 for k, v in dispatch.items()}
        parts = ", ".join(f"{k} {v * 1e6:.2f}" for k, v in dispatch.items())
        print(f"Lightning's dispatch of one callback's per-step hooks, us per step beyond none: {parts}")
        total = dispatch["guard"] + per_step + per_log / 50
        results["guard_direct_share_of_step"] = total / step_s
        print(
            f"ResourceGuard(profile=False) direct: dispatch + monitor calls + logging steps / 50 = "
            f"{total * 1e6:.2f} us per step, {total / step_s:.3%} of the step"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
