"""What an estimate of a 6.7B-parameter decoder step costs: wall time and peak RSS.

The model is a LLaMA-style decoder of 6.7B parameters (32 layers, hidden 4096, intermediate 11008,
32 heads, vocab 32000), sequence 2048, batch 1, AdamW, bf16-mixed, built on the ``meta`` device so
nothing of its size exists. Each tool runs in its own subprocess, so the peak RSS reported (from
``os.wait4``'s resource usage of that child) is that run's own, imports included:

- ``resource_guard``: ``estimate_memory(model, optimizer, batch, precision="bf16-mixed")`` with the
  default target (a ``meta`` model means a CUDA run), and again with ``device="cpu"`` to compare
  with MemTracker, which here can only run on CPU fake tensors.
- ``torch MemTracker``: PyTorch's reference, ``torch.distributed._tools.mem_tracker.MemTracker``,
  driving two real-code steps (forward under autocast, backward, ``AdamW.step``, ``zero_grad``) on
  fake tensors; the second step is the steady state with optimizer state allocated.

"wall s" is the time of the estimate itself (for MemTracker: fake conversion + tracked steps), not of
the imports or of building the meta model; "process s" is the whole subprocess. Targets (DESIGN.md):
ours ≤ 10 s and ≤ 500 MB peak RSS on a 2-core machine.

A second table times CPU-target estimates (``device="cpu"``) of a GPT-2-style model under 100M
parameters (10 layers, 768 wide, vocab 32000, 8 × 1024 tokens, meta device) at fp32, bf16-mixed and
16-mixed, each in a fresh process ("cold": the first estimate, the real-kernel probes included) and
then again in that process ("warm": probes cached). Target (issue #11): cold ≤ 3 s. ``--isa AVX2``
caps oneDNN (``ONEDNN_MAX_CPU_ISA``) to play an AVX2-only CPU, whose bf16 GEMMs oneDNN does not run.
"CPU s" is the process CPU time of the estimate: on a loaded machine it is the steadier figure.

Run:  python benchmarks/estimate_cost.py [--json PATH] [--skip-memtracker] [--only-small] [--isa AVX2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

TARGET_WALL_S = 10.0
TARGET_RSS_MB = 500.0
GIB = 2**30

CONFIG = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=2048,
    use_cache=False,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)
SEQ = 2048
BATCH = 1


# ----------------------------------------------------------------------------------------------------
# workers (run in a subprocess; print one JSON line)


def _rss_mb_self() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _meta_model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    return model.train()


def _batch() -> dict[str, Any]:
    import torch

    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids}


def worker_ours(device: str | None) -> dict[str, Any]:
    import torch

    from resource_guard.estimate import estimate_memory

    model = _meta_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)  # fine over meta params
    batch = _batch()
    n_params = sum(p.numel() for p in model.parameters())
    rss_before = _rss_mb_self()
    t0 = time.perf_counter()
    kwargs = {} if device is None else {"device": device}
    est = estimate_memory(model, optimizer, batch, precision="bf16-mixed", **kwargs)
    wall = time.perf_counter() - t0
    return {
        "params": n_params,
        "wall_s": wall,
        "rss_before_mb": rss_before,
        "peak_bytes": int(est.peak_bytes),
        "method": est.method,
        "breakdown": {k: int(v) for k, v in est.breakdown.items()},
        "warnings": [str(w) for w in est.warnings],
    }


SMALL_GPT = dict(vocab_size=32000, n_embd=768, n_layer=10, n_head=12, n_positions=1024)
SMALL_BATCH, SMALL_SEQ = 8, 1024
SMALL_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
TARGET_SMALL_CPU_S = 3.0


def worker_small_cpu(precision: str) -> dict[str, Any]:
    """A CPU-target estimate of the small GPT, cold (first in this process) and warm (again)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from resource_guard.estimate import estimate_memory

    config = GPT2Config(**SMALL_GPT, use_cache=False)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (SMALL_BATCH, SMALL_SEQ))
    times = []
    for _ in range(2):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        t0, c0 = time.perf_counter(), time.process_time()
        est = estimate_memory(model, optimizer, {"input_ids": ids, "labels": ids}, precision=precision,
                              device="cpu")  # fmt: skip
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "precision": precision,
        "cold_wall_s": times[0][0],
        "cold_cpu_s": times[0][1],
        "warm_wall_s": times[1][0],
        "peak_bytes": int(est.peak_bytes),
        "method": est.method,
        "warnings": [str(w) for w in est.warnings],
    }


def worker_memtracker() -> dict[str, Any]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _meta_model()
    n_params = sum(p.numel() for p in model.parameters())
    rss_before = _rss_mb_self()
    t0 = time.perf_counter()
    # Adaptation: MemTracker needs fake tensors, not meta ones. Building the model directly under
    # FakeTensorMode runs its random init, which fails on fake CUDA tensors in a CPU-only build (and
    # fake CUDA autograd aborts the process there too), so the meta model is materialised as *CPU*
    # fake tensors with ``to_empty`` (allow_non_fake_inputs lets empty_like see the meta originals).
    # The step is therefore the CPU one: autocast on "cpu", AdamW's per-parameter loop (no foreach).
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
        tracker = MemTracker()
        tracker.track_external(model, optimizer, ids)
        with tracker:
            for step in range(2):  # step 0 creates the optimizer state; step 1 is the steady state
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del loss
                if step == 0:
                    tracker.reset_mod_stats()
        snapshot = tracker.get_tracker_snapshot("peak")
    wall = time.perf_counter() - t0
    per_device = snapshot[torch.device("cpu")]
    return {
        "params": n_params,
        "wall_s": wall,
        "rss_before_mb": rss_before,
        "peak_bytes": int(per_device["Total"]),
        "method": "MemTracker/fake",
        "breakdown": {str(getattr(k, "value", k)): int(v) for k, v in per_device.items() if k != "Total"},
        "warnings": [],
    }


def _worker_main(kind: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    if kind == "ours":
        result = worker_ours(None)
    elif kind == "ours-cpu":
        result = worker_ours("cpu")
    elif kind == "memtracker":
        result = worker_memtracker()
    elif kind.startswith("small-cpu:"):
        result = worker_small_cpu(kind.split(":", 1)[1])
    else:
        raise SystemExit(f"unknown worker {kind!r}")
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------------
# driver


def _spawn_measured(kind: str, timeout: float = 1800.0, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one worker in a fresh interpreter, reaped with ``os.wait4`` to get that child's own peak RSS."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    # Drain the pipes without reaping (communicate would call waitpid and lose the rusage).
    chunks: dict[str, str] = {}

    def drain(name: str, stream: Any) -> None:
        chunks[name] = stream.read()

    threads = [
        threading.Thread(target=drain, args=("out", proc.stdout), daemon=True),
        threading.Thread(target=drain, args=("err", proc.stderr), daemon=True),
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    status = rusage = None
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            _, status, rusage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    for t in threads:
        t.join()
    process_s = time.perf_counter() - t0
    out, err = chunks.get("out", ""), chunks.get("err", "")
    result: dict[str, Any] = {
        "tool": kind,
        "process_s": process_s,
        "returncode": proc.returncode,
        "peak_rss_mb": rusage.ru_maxrss / 1024,  # Linux: KiB → MiB
    }
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT ") :]))
    if "peak_bytes" not in result:
        tail = (err or out).strip().splitlines()[-3:]
        result["failure"] = " | ".join(tail)[:400]
    return result


def small_cpu_table(isa: str | None) -> list[dict[str, Any]]:
    """Print and return the CPU-target small-GPT rows (one fresh process per precision)."""
    from resource_guard.devices import cpu_summary

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa} if isa else None
    cfg = SMALL_GPT
    print(
        f"CPU-target estimates: GPT-2-style, {cfg['n_layer']} layers, {cfg['n_embd']} wide, vocab "
        f"{cfg['vocab_size']}, {SMALL_BATCH} x {SMALL_SEQ} tokens, AdamW, device='cpu'"
    )
    print(f"cpu: {cpu_summary()}" + (f" (workers: ONEDNN_MAX_CPU_ISA={isa})" if isa else ""))
    header = (
        f"{'precision':<12} {'cold wall s':>11} {'cold CPU s':>11} {'warm wall s':>12} {'est peak GiB':>13}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for precision in SMALL_PRECISIONS:
        row = _spawn_measured(f"small-cpu:{precision}", env=env)
        rows.append(row)
        if "failure" in row:
            print(f"{precision:<12} FAILED (exit {row['returncode']}): {row['failure']}", flush=True)
            continue
        print(
            f"{precision:<12} {row['cold_wall_s']:>11.2f} {row['cold_cpu_s']:>11.2f} "
            f"{row['warm_wall_s']:>12.2f} {row['peak_bytes'] / GIB:>13.2f}",
            flush=True,
        )
    done = [r for r in rows if "failure" not in r]
    if done:
        worst = max(r["cold_wall_s"] for r in done)
        verdict = "PASS" if worst <= TARGET_SMALL_CPU_S and len(done) == len(rows) else "FAIL"
        print(f"parameters: {done[0]['params'] / 1e6:.1f} M")
        print(f"slowest cold estimate {worst:.2f} s   target <= {TARGET_SMALL_CPU_S:.0f} s   {verdict}\n")
    return rows


LABELS = {
    "ours": "resource_guard (target cuda)",
    "ours-cpu": "resource_guard (device=cpu)",
    "memtracker": "torch MemTracker (cpu fake)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON to PATH")
    parser.add_argument("--skip-memtracker", action="store_true", help="do not run the MemTracker reference")
    parser.add_argument("--only-small", action="store_true", help="only the CPU-target small-GPT table")
    parser.add_argument("--isa", default=None, help="ONEDNN_MAX_CPU_ISA for the small-GPT workers (AVX2)")
    args = parser.parse_args(argv)
    if args.worker:
        _worker_main(args.worker)
        return 0
    small = small_cpu_table(args.isa)
    if args.only_small:
        if args.json:
            Path(args.json).write_text(json.dumps(small, indent=2))
        return 0

    kinds = ["ours", "ours-cpu"] + ([] if args.skip_memtracker else ["memtracker"])
    print(
        f"LLaMA-style decoder: {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
        f"intermediate {CONFIG['intermediate_size']}, vocab {CONFIG['vocab_size']}, "
        f"seq {SEQ}, batch {BATCH}, AdamW, bf16-mixed, meta device\n"
    )
    header = (
        f"{'tool':<30} {'wall s':>7} {'peak RSS MB':>12} {'RSS pre MB':>11} {'est peak GiB':>13} "
        f"{'process s':>10}  method"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for kind in kinds:
        row = _spawn_measured(kind)
        rows.append(row)
        if "failure" in row:
            print(f"{LABELS[kind]:<30} FAILED (exit {row['returncode']}): {row['failure']}", flush=True)
            continue
        print(
            f"{LABELS[kind]:<30} {row['wall_s']:>7.2f} {row['peak_rss_mb']:>12.0f} "
            f"{row['rss_before_mb']:>11.0f} {row['peak_bytes'] / GIB:>13.2f} "
            f"{row['process_s']:>10.1f}  {row['method']}",
            flush=True,
        )

    print()
    params = next((r["params"] for r in rows if "params" in r), None)
    if params:
        print(f"parameters: {params / 1e9:.2f} B")
    ours = rows[0]
    if "failure" in ours:
        print("resource_guard estimate failed: targets FAIL")
    else:
        ok_wall = "PASS" if ours["wall_s"] <= TARGET_WALL_S else "FAIL"
        ok_rss = "PASS" if ours["peak_rss_mb"] <= TARGET_RSS_MB else "FAIL"
        print(f"wall time  {ours['wall_s']:7.2f} s   target <= {TARGET_WALL_S:.0f} s    {ok_wall}")
        print(
            f"peak RSS   {ours['peak_rss_mb']:7.0f} MB  target <= {TARGET_RSS_MB:.0f} MB  {ok_rss}"
            "   (whole subprocess, imports included; MB = MiB)"
        )
        bd = ", ".join(f"{k} {v / GIB:.2f}" for k, v in ours["breakdown"].items())
        print(f"breakdown at peak (GiB): {bd}")
        for w in ours.get("warnings", []):
            print(f"warning: {w}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
