"""Per-GPU peak predicted for llm-foundry's published MPT benchmark runs, against the GPUs they ran on.

The table (``benchmarks/data/llm_foundry_runs.csv``, every data row of
``scripts/train/benchmarking/README.md`` in mosaicml/llm-foundry at commit
8c8dd48f72168c5d51e2f7b151595892a8fba43d; see ``benchmarks/data/README.md``) lists 216 runs that
ran: MPT 125M-70B, A100-40GB/80GB and H100-80GB, 8-512 GPUs, FSDP, bf16, with micro-batch, sharding,
Composer mixed-precision mode and activation checkpointing stated. Each MPT is built on the meta
device with the published shapes (its parameter count is checked against the table's NumParams),
traced at the published micro-batch and sequence length by extrapolation from 1 and 2 blocks
(:func:`resource_guard.estimate.blocks.estimate_by_blocks`), and sized per rank by
:mod:`resource_guard.planning.strategy` under the row's FSDP policy:

- ``MP Mode`` DEFAULT -> ``params-fp32-reduce`` (bf16 params, fp32 reduce), PURE -> ``params``;
- ``Sharding Strategy`` FULL_SHARD -> ``fsdp``, SHARD_GRAD_OP -> ``fsdp_grad_op``;
- ``Activation Checkpointing`` True -> every block checkpointed; AdamW (fp32 state, as
  DecoupledAdamW); ``amp_fp8`` rows are modelled as bf16 (TransformerEngine keeps bf16 weights);
- the loss is flash-attn's fused cross-entropy (ComposerMPTCausalLM's default ``loss_fn``), norms
  are MPT's ``low_precision_layernorm``, attention is flash (no sequence × sequence matrix).

Prints one line per row (predicted per-GPU device total vs capacity, verdict) and the share predicted
to fit or fit tight (target >= 95%), then published out-of-memory reports, which must not fit.

Run: ``nice -n 10 python benchmarks/llm_foundry.py [--limit N]``.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from resource_guard.devices import resolve_device
from resource_guard.estimate.blocks import estimate_by_blocks
from resource_guard.estimate.fsdp.sharding import fsdp_precision, trace_spec
from resource_guard.planning.checkpointing import apply_checkpointing
from resource_guard.planning.strategy import phase_peaks, rank_fit, rank_memory, unit_param_bytes

DATA = Path(__file__).parent / "data" / "llm_foundry_runs.csv"
GiB = 2**30
VOCAB = 50368
# d_model, n_heads, n_layers (scripts/train/yamls/pretrain/mpt-*.yaml); expansion ratio 4
SHAPES = {
    "125m": (768, 12, 12),
    "350m": (1024, 16, 24),
    "760m": (1536, 12, 24),
    "1b": (2048, 16, 24),
    "3b": (2560, 20, 32),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 56, 48),
    "70b": (8192, 64, 80),
}
DEVICES = {"h100_80gb": "h100-sxm", "a100_80gb": "a100-80gb", "a100_40gb": "a100-40gb"}
MP_MODE = {"DEFAULT": "params-fp32-reduce", "PURE": "params"}
SHARDING = {"FULL_SHARD": "fsdp", "SHARD_GRAD_OP": "fsdp_grad_op"}


class LowPrecisionLayerNorm(nn.LayerNorm):
    """MPT's ``low_precision_layernorm``: the norm runs in the autocast dtype, not fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else x.dtype
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            w = self.weight.to(dtype)
            b = self.bias.to(dtype)
            return F.layer_norm(x.to(dtype), self.normalized_shape, w, b, self.eps)


class MPTBlock(nn.Module):
    """MPT's block: pre-norm attention (fused Wqkv, flash attention) and a 4x GELU MLP, with biases."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm_1 = LowPrecisionLayerNorm(d)
        self.Wqkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.norm_2 = LowPrecisionLayerNorm(d)
        self.up_proj = nn.Linear(d, 4 * d)
        self.down_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.Wqkv(self.norm_1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.out_proj(a)
        return x + self.down_proj(F.gelu(self.up_proj(self.norm_2(x))))


class MPT(nn.Module):
    """``mpt_causal_lm``: tied token embedding, learned positions, ``n_layers`` blocks, final norm."""

    def __init__(self, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(MPTBlock(d, heads) for _ in range(layers))
        self.norm_f = LowPrecisionLayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm_f(x), self.wte.weight)
        targets = torch.roll(ids, -1, 1)
        return FusedCrossEntropy.apply(logits.view(-1, VOCAB), targets.reshape(-1))


class FusedCrossEntropy(torch.autograd.Function):
    """flash-attn's ``CrossEntropyLoss``, ComposerMPTCausalLM's default ``loss_fn: fused_crossentropy``.

    The kernel keeps the 16-bit logits and one log-sum-exp per row (no fp32 copy, no log-softmax
    tensor); its backward (``inplace_backward=False``) returns a new gradient of the logits' shape
    and dtype. The same memory, with torch operators.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        lse = torch.logsumexp(logits, -1).float()
        picked = logits.gather(1, targets[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, lse, targets)
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        logits, lse, targets = ctx.saved_tensors
        out = torch.softmax(logits, -1)
        out.scatter_add_(1, targets[:, None], torch.full_like(targets[:, None], -1, dtype=out.dtype))
        return out.mul_(grad / len(targets)), None


def mpt_params(d: int, layers: int, seq: int) -> int:
    return VOCAB * d + seq * d + layers * (12 * d * d + 13 * d) + 2 * d


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids)


_CACHE: dict[tuple, object] = {}


def predict(
    model_name: str,
    seq: int,
    gpus: int,
    device: str,
    micro: int,
    *,
    policy_name: str,
    strategy: str,
    ckpt: bool,
):
    """The per-rank device fit of one configuration (traces cached across GPU counts)."""
    d, heads, layers = SHAPES[model_name]
    with torch.device("meta"):
        model = MPT(d, heads, layers, seq)
    policy = fsdp_precision("bf16-mixed", policy_name)
    key = (model_name, seq, micro, ckpt, policy_name)
    if key not in _CACHE:
        handle = apply_checkpointing(model) if ckpt else None
        try:
            est = estimate_by_blocks(
                model,
                torch.optim.AdamW,
                torch.zeros(micro, seq, dtype=torch.long),
                _loss,
                blocks=[f"blocks.{i}" for i in range(layers)],
                precision=trace_spec(policy),
                device="cuda",
            )
        finally:
            if handle is not None:
                handle.remove()
        _CACHE[key] = (est, phase_peaks(est), unit_param_bytes(model, policy))
    est, peaks, units = _CACHE[key]  # type: ignore[misc]
    spec = resolve_device(device)
    rank = rank_memory(est, strategy, gpus, units=units, policy=policy, peaks=peaks)  # type: ignore[arg-type]
    return est, rank, rank_fit(est.for_device(spec), est, rank)  # type: ignore[attr-defined]


def published_runs(limit: int | None) -> None:
    rows = [r for r in csv.reader(line for line in DATA.open() if not line.startswith("#"))]
    header, rows = rows[0], rows[1:]
    rows = [dict(zip(header, r)) for r in rows][:limit]
    counts = {"fits": 0, "fits tight": 0, "does not fit": 0}
    worst: list[tuple[float, str]] = []
    started = time.perf_counter()
    print(
        f"{'model':>5} {'seq':>6} {'gpus':>4} {'gpu':>9} {'mb':>3} {'mp':>7} {'shard':>13} {'ckpt':>5} "
        f"{'predicted GiB':>13} {'capacity':>8} {'share':>6}  verdict"
    )
    for r in rows:
        d, _, layers = SHAPES[r["Model"]]
        seq = int(r["SeqLen (T)"])
        assert mpt_params(d, layers, seq) == int(r["NumParams"]), r  # the shapes are the published ones
        est, rank, fit = predict(
            r["Model"],
            seq,
            int(r["# GPUs"]),
            DEVICES[r["GPU"]],
            int(r["MicroBatchSize"]),
            policy_name=MP_MODE[r["MP Mode"]],
            strategy=SHARDING[r["Sharding Strategy"]],
            ckpt=r["Activation Checkpointing"] == "True",
        )
        assert est.parameter_count == int(r["NumParams"]), (est.parameter_count, r["NumParams"])
        counts[fit.verdict] += 1
        share = fit.device_total_bytes / fit.capacity_bytes
        worst.append((share, f"{r['Model']} seq {seq} ×{r['# GPUs']} {r['GPU']} mb {r['MicroBatchSize']}"))
        print(
            f"{r['Model']:>5} {seq:>6} {r['# GPUs']:>4} {r['GPU']:>9} {r['MicroBatchSize']:>3} "
            f"{r['MP Mode']:>7} {r['Sharding Strategy']:>13} {r['Activation Checkpointing']:>5} "
            f"{fit.device_total_bytes / GiB:>13.1f} {fit.capacity_bytes / GiB:>8.0f} {share:>6.1%}  "
            f"{fit.verdict}"
        )
    n = len(rows)
    ok = counts["fits"] + counts["fits tight"]
    print(
        f"\n{n} published runs: {counts['fits']} fit, {counts['fits tight']} fit tight, "
        f"{counts['does not fit']} do not fit -> {ok / n:.1%} predicted to fit or fit tight (target >= 95%); "
        f"{len(_CACHE)} estimates in {time.perf_counter() - started:.0f} s"
    )
    shares = sorted(s for s, _ in worst)
    print(
        f"predicted / capacity: median {shares[len(shares) // 2]:.1%}, max {shares[-1]:.1%} "
        f"({max(worst)[1]}); min {shares[0]:.1%}"
    )


# Published OOMs (sources in benchmarks/data/README.md); each must be predicted not to fit.
OOMS = [
    # O1: llm-foundry#468: MPT-7B pretrain yaml on 1× A100-80GB, FSDP FULL_SHARD/PURE on one rank, mb 1
    ("O1 MPT-7B 1×A100-80GB mb1 seq2048 +ckpt", "7b", 2048, 1, "a100_80gb", 1, "params", "fsdp", True),
    # the same on 1× A100-80GB at seq 512 (also tried in the issue)
    ("O1 MPT-7B 1×A100-80GB mb1 seq512 +ckpt", "7b", 512, 1, "a100_80gb", 1, "params", "fsdp", True),
]


def published_ooms() -> None:
    print("\npublished out-of-memory reports (must be predicted not to fit):")
    hits = 0
    for label, name, seq, gpus, gpu, micro, policy, strategy, ckpt in OOMS:
        _, _, fit = predict(
            name, seq, gpus, DEVICES[gpu], micro, policy_name=policy, strategy=strategy, ckpt=ckpt
        )
        hits += fit.verdict == "does not fit"
        print(
            f"  {label}: predicted {fit.device_total_bytes / GiB:.1f} of {fit.capacity_bytes / GiB:.0f} GiB"
            f" -> {fit.verdict}"
        )
    print(f"{hits}/{len(OOMS)} published OOMs predicted not to fit")


# litgpt tutorials/resource-tables.md @ b73298666d31691e0c639d3f47b0d0829ba44dab: LoRA (r=8, alpha=16,
# dropout 0.05, on q and v) of Llama-2, bf16-true, one A100-SXM4-40GB, the longest Alpaca sample
# (1304 tokens) first; "Max GPU RAM" is torch.cuda.max_memory_allocated() / 1e9.
LITGPT = [  # (label, layers, hidden, intermediate, heads, micro-batch, measured GB allocated or None: OOM)
    ("Llama-2-7B LoRA mb1", 32, 4096, 11008, 32, 1, 21.30),
    ("Llama-2-7B LoRA mb2", 32, 4096, 11008, 32, 2, 29.07),
    ("Llama-2-7B LoRA mb4", 32, 4096, 11008, 32, 4, None),
    ("Llama-2-13B LoRA mb1", 40, 5120, 13824, 40, 1, 38.12),
    ("Llama-2-13B LoRA mb2", 40, 5120, 13824, 40, 2, None),
]


class LoRALinear(nn.Module):
    """litgpt's LoRA linear: frozen base plus ``dropout(x) @ A.T @ B.T × alpha / r`` trained."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: int = 16) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, r, device=base.weight.device))
        self.dropout = nn.Dropout(0.05)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scaling


def litgpt_lora_runs() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    print("\nlitgpt LoRA fine-tuning on one A100-40GB (bf16-true, 1304 tokens), published measurements:")
    device = resolve_device("a100-40gb")
    for label, layers, hidden, inter, heads, micro, measured in LITGPT:
        config = LlamaConfig(
            hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, vocab_size=32000, attn_implementation="sdpa",
        )  # fmt: skip
        with torch.device("meta"):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
            for layer in model.model.layers:
                attn = layer.self_attn
                attn.q_proj, attn.v_proj = LoRALinear(attn.q_proj), LoRALinear(attn.v_proj)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
        ids = torch.zeros(micro, 1304, dtype=torch.long)
        est = estimate_by_blocks(
            model, torch.optim.AdamW, {"input_ids": ids, "labels": ids},
            blocks=[f"model.layers.{i}" for i in range(layers)], precision="bf16-true", device="cuda",
        )  # fmt: skip
        fit = est.for_device(device)
        got = f"measured {measured:.2f} GB allocated" if measured is not None else "published: out of memory"
        print(
            f"  {label}: predicted {fit.allocated_peak_bytes / 1e9:.2f} GB allocated, device total "
            f"{fit.device_total_bytes / GiB:.1f} of {fit.capacity_bytes / GiB:.0f} GiB -> {fit.verdict}; "
            f"{got}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="only the first N rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    published_runs(args.limit)
    published_ooms()
    litgpt_lora_runs()


if __name__ == "__main__":
    main()
