"""Per-rank prediction beside a real 2-rank CPU run (gloo) of FSDP2 ``fully_shard`` and of DDP.

Each rank trains a small residual MLP stack (8 blocks) for two warm-up steps, then four measured
steps under torch.profiler's memory records (rank 0); the measured per-rank peak is the live bytes at
the start of the step (parameter shards, optimizer state, batch; gradients are set to None) plus the
highest running total of the step's allocations, of the smallest step whose peak the profiler recorded whole
(``families.recorded_peak``: gloo frees some collective buffers on its worker thread, unrecorded).
The prediction is :func:`resource_guard.planning.strategy.rank_memory` of a single-device trace, under FSDP's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` and under DDP with fp32. DDP's
gradient buckets are allocated when DDP is constructed, before the measured step, so the measured
side adds them as one copy of every gradient (the reducer does not expose them); the step itself and
every other byte are measured. For FSDP2, rank 0 also estimates its own sharded module
(``estimate_memory`` of the ``fully_shard``-ed model: the traced per-rank step, read from the module).

Run: ``nice -n 10 python benchmarks/fsdp_gloo.py``.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DIM, HIDDEN, DEPTH, BATCH, SEQ = 256, 1024, 8, 8, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _local_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _worker(rank: int, strategy: str, path: str, port: int) -> None:
    from families import recorded_peak

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = Net()
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(BATCH, SEQ, DIM)
    sharded = ""
    if strategy == "fsdp" and rank == 0:
        from resource_guard.estimate import estimate_memory

        sharded = str(estimate_memory(model, opt, x, _loss, device="cpu").peak_bytes)

    def step() -> None:
        _loss(model, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    gc.collect()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    start = _local_bytes([*model.parameters(), *state, x])
    if strategy == "ddp":  # the reducer's buckets: one copy of every gradient, kept for the run
        start += sum(p.numel() * p.element_size() for p in model.parameters())
    steps = []  # (peak, whole): the smallest step with a whole peak is the truth (families.recorded_peak)
    for _ in range(4):
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            step()
        steps.append(recorded_peak(prof))
    peak = min([p for p, whole in steps if whole] or [p for p, _ in steps])
    if rank == 0:
        with open(path, "w") as f:
            f.write(f"{start + peak}\n{sharded}")
    dist.destroy_process_group()


def measured(strategy: str) -> int:
    """The real per-rank peak of rank 0."""
    return measured_and_estimated(strategy)[0]


def measured_and_estimated(strategy: str) -> tuple[int, int | None]:
    """The real per-rank peak of rank 0, and (FSDP2) rank 0's estimate of its sharded module."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "peak")
        with socket.socket() as sock:  # a free port for the rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_worker, args=(strategy, path, port), nprocs=2)
        with open(path) as f:
            real, sharded = f.read().split("\n")
    return int(real), int(sharded) if sharded else None


def predicted(strategy: str) -> int:
    from resource_guard.estimate import estimate_memory
    from resource_guard.estimate.fsdp.sharding import fsdp_precision, trace_spec
    from resource_guard.planning.strategy import rank_memory, unit_param_bytes

    model = Net()
    opt = lambda ps: torch.optim.AdamW(ps, foreach=True)  # noqa: E731
    if strategy == "fsdp":
        policy = fsdp_precision("bf16-mixed", "params")
        policy = type(policy)(
            policy.name, "32-true", policy.policy, torch.bfloat16, torch.bfloat16, torch.float32, None
        )
        est = estimate_memory(
            model, opt, torch.randn(BATCH, SEQ, DIM), _loss, precision=trace_spec(policy), device="cpu"
        )
        units = unit_param_bytes(model, policy)
        return rank_memory(est, "fsdp", 2, units=units, policy=policy).per_rank_bytes
    est = estimate_memory(model, opt, torch.randn(BATCH, SEQ, DIM), _loss, device="cpu")
    return rank_memory(est, "ddp", 2).per_rank_bytes


def main() -> None:
    torch.set_num_threads(1)
    print(
        f"{'strategy':>8} {'measured MiB':>12} {'predicted MiB':>13} {'error':>7}  "
        "estimate of the sharded module (MiB, error)"
    )
    for strategy in sys.argv[1:] or ("fsdp", "ddp"):
        (real, sharded), pred = measured_and_estimated(strategy), predicted(strategy)
        own = f"{sharded / 2**20:.2f} {(sharded - real) / real:+.1%}" if sharded is not None else "-"
        print(
            f"{strategy:>8} {real / 2**20:>12.2f} {pred / 2**20:>13.2f} {(pred - real) / real:>+7.1%}  {own}"
        )


if __name__ == "__main__":
    main()
