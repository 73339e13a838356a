"""How long ``plan()`` takes for LLaMA-shaped models at scale (targets: 70B on 8-64 GPUs ≤ 10 s, 8B ≤ 3 s).

The models are transformers ``LlamaForCausalLM`` built on the meta device from the published shapes
(no weights); the planner traces them on fake tensors, two shallow depths per configuration
(:mod:`resource_guard.estimate.blocks`), and sizes DDP and FSDP per rank on H100-80GB, bf16-mixed
(FSDP: bf16 parameters gathered per unit, Lightning's ``FSDPStrategy``), sequence 4096, 16 sequences
per rank. Prints the plan and the wall time of each call.

Run: ``nice -n 10 python benchmarks/plan_speed.py``.
"""

from __future__ import annotations

import time
import warnings

import torch

from resource_guard import plan

SHAPES = {  # hidden, intermediate, layers, heads, kv heads (Llama-3 8B / 70B)
    "8B": (4096, 14336, 32, 32, 8),
    "70B": (8192, 28672, 80, 64, 8),
}
SEQ = 4096
PER_RANK = 16


def build(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv = SHAPES[name]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=128256,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'model':>5} {'gpus':>4} {'seconds':>8} {'traces':>6}  plan")
    for name, worlds in (("8B", (1, 8)), ("70B", (8, 16, 32, 64))):
        model = build(name)
        ids = torch.zeros(1, SEQ, dtype=torch.long)
        batch = {"input_ids": ids, "labels": ids}
        for world in worlds:
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    p = plan(
                        model, torch.optim.AdamW, batch, device="h100-sxm", precision="bf16-mixed",
                        world_size=world, target_batch_size=PER_RANK * world,
                    )  # fmt: skip
                    text = (
                        f"{p.micro_batch_size}×{p.accumulation_steps} {p.strategy}"
                        f"{' +ckpt' if p.checkpointing else ''}, {p.fit.device_total_bytes / 2**30:.1f} GiB, "
                        f"{p.verdict}"
                    )
                    traces = p.traces
                except Exception as exc:  # noqa: BLE001 - a benchmark prints what happened
                    text, traces = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}", -1
            seconds = time.perf_counter() - started
            print(f"{name:>5} {world:>4} {seconds:>8.2f} {traces:>6}  {text}")


if __name__ == "__main__":
    main()
