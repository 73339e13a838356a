"""Traced estimates of model families the test suite does not have, vs the real CPU step.

Mixture-of-experts (Mixtral, Qwen2-MoE), a state-space model (Mamba, the slow path), speech with CTC
loss (wav2vec2), detection with a set-based loss (DETR: Hungarian matching through scipy), CLIP,
DeBERTa-v2, Swin, ConvNeXt, MobileNetV2, Whisper, BART, a ``torch.compile``'d model (the eager step
of the compiled module is estimated, and the estimate says so), peft LoRA where peft is installed,
and an FSDP2-sharded LLaMA on 2 real gloo CPU ranks (``fully_shard`` per decoder layer and the root;
rank 0 estimates its sharded module, then both ranks train and rank 0 measures its own step: the
smallest of the steps whose peak the profiler recorded whole, the largest beside it; and a wider, shallower
one), each
in 32-true and bf16-mixed (FSDP2: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
with autocast on top). For every case: the estimate's method (traced,
traced-recovered or analytic), which operators were recovered, and the error against
``measure_training_step`` (torch.profiler's memory records of a real CPU step).

MoE routing: transformers' MoE layers sort the tokens by expert and run ``torch._grouped_mm`` over
``tokens x top_k`` rows, so no tensor's size depends on the routing; the estimate holds for any
routing of the batch (the all-on-one-expert worst case included). Layers that loop over experts
with ``torch.where(mask)`` are traced with every token on every expert (``nonzero`` assumed full):
an upper bound.

Run:  python benchmarks/families.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import socket
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import native_stderr_silenced  # noqa: E402

from resource_guard.estimate import estimate_memory, measure_training_step  # noqa: E402
from resource_guard.estimate.host.measure import live_bytes  # noqa: E402
from resource_guard.estimate.host.quiet import quiet_profile  # noqa: E402
from resource_guard.step.precision import parse_precision  # noqa: E402
from resource_guard.step.training import training_step  # noqa: E402

__all__ = ["FAMILIES", "build"]

Built = tuple[nn.Module, torch.optim.Optimizer, Any, "Callable[[nn.Module, Any], Any] | None"]
PRECISIONS = ("32-true", "bf16-mixed")


def _ids(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(7))


def _lm(model: nn.Module, vocab: int = 128) -> tuple[nn.Module, Any]:
    ids = _ids(vocab, 2, 16)
    return model, {"input_ids": ids, "labels": ids.clone()}


def mixtral() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    return _lm(T.MixtralForCausalLM(cfg))


def qwen2_moe() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    return _lm(T.Qwen2MoeForCausalLM(cfg))


def mamba() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.MambaConfig(
        vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        use_mambapy=False,
    )  # fmt: skip
    return _lm(T.MambaForCausalLM(cfg))


def wav2vec2_ctc() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0,
        layerdrop=0.0,  # LayerDrop skips layers at random; the estimate keeps them all (an upper bound)
    )  # fmt: skip
    labels = _ids(32, 2, 10)
    labels[1, 7:] = -100
    return T.Wav2Vec2ForCTC(cfg), {"input_values": torch.randn(2, 1600), "labels": labels}


def detr() -> tuple[nn.Module, Any]:
    import transformers as T

    backbone = T.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], out_features=["stage4"]
    )
    cfg = T.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone, d_model=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=10, num_labels=5,
    )  # fmt: skip
    labels = [
        {
            "class_labels": torch.tensor([1, 3]),
            "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2], [0.3, 0.3, 0.1, 0.2]]),
        },
        {"class_labels": torch.tensor([2]), "boxes": torch.tensor([[0.4, 0.6, 0.3, 0.3]])},
    ]
    return T.DetrForObjectDetection(cfg), {"pixel_values": torch.randn(2, 3, 64, 64), "labels": labels}


def clip() -> tuple[nn.Module, Any]:
    import transformers as T

    text = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 32}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 8}  # fmt: skip
    model = T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    batch = {"input_ids": _ids(128, 4, 12), "pixel_values": torch.randn(4, 3, 32, 32), "return_loss": True}
    return model, batch


def deberta_v2() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.DebertaV2Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"], num_labels=3,
    )  # fmt: skip
    return T.DebertaV2ForSequenceClassification(cfg), {
        "input_ids": _ids(128, 2, 16),
        "labels": torch.tensor([0, 2]),
    }


def swin() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=4,
        num_labels=5,
    )
    return T.SwinForImageClassification(cfg), {
        "pixel_values": torch.randn(2, 3, 32, 32),
        "labels": torch.tensor([1, 4]),
    }


def convnext() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5, image_size=32)
    return T.ConvNextForImageClassification(cfg), {
        "pixel_values": torch.randn(2, 3, 32, 32),
        "labels": torch.tensor([1, 4]),
    }


def mobilenet_v2() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_labels=5)
    return T.MobileNetV2ForImageClassification(cfg), {
        "pixel_values": torch.randn(2, 3, 32, 32),
        "labels": torch.tensor([1, 4]),
    }


def whisper() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.WhisperConfig(
        vocab_size=128, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=32, max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
    )  # fmt: skip
    batch = {"input_features": torch.randn(2, 16, 64), "labels": _ids(128, 2, 8)}
    return T.WhisperForConditionalGeneration(cfg), batch


def bart() -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.BartConfig(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    return T.BartForConditionalGeneration(cfg), {"input_ids": _ids(128, 2, 16), "labels": _ids(128, 2, 12)}


def compiled() -> tuple[nn.Module, Any]:
    """``torch.compile`` of a small MLP; the estimate is of the eager step of the compiled module."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    return torch.compile(inner), (torch.randn(32, 64), torch.randint(0, 10, (32,)))


def _xent(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def peft_lora() -> tuple[nn.Module, Any]:
    import peft
    import transformers as T

    cfg = T.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64,
    )  # fmt: skip
    model = peft.get_peft_model(
        T.LlamaForCausalLM(cfg), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    return _lm(model)


def qlora() -> tuple[nn.Module, Any]:
    """QLoRA: the decoder's linear layers quantized to bitsandbytes 4-bit NF4 (frozen), LoRA on top."""
    import bitsandbytes as bnb
    import peft
    import transformers as T

    cfg = T.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64,
    )  # fmt: skip
    model = T.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    q = bnb.nn.Linear4bit(
                        child.in_features, child.out_features, bias=child.bias is not None,
                        compute_dtype=torch.float32, quant_type="nf4",
                    )  # fmt: skip
                    q.load_state_dict(child.state_dict())
                    setattr(parent, name, q.to("cpu"))  # .to() quantizes
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return _lm(model)


def _sharded_llama(hidden: int, layers: int, seq: int) -> tuple[nn.Module, Any]:
    import transformers as T

    cfg = T.LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    ids = _ids(512, 4, seq)
    return T.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids.clone()}


def fsdp2_llama() -> tuple[nn.Module, Any]:
    """A LLaMA sharded by the caller with ``fully_shard`` per decoder layer and the root."""
    return _sharded_llama(64, 8, 64)


FAMILIES: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "mixtral": mixtral,
    "qwen2-moe": qwen2_moe,
    "mamba": mamba,
    "wav2vec2-ctc": wav2vec2_ctc,
    "detr": detr,
    "clip": clip,
    "deberta-v2": deberta_v2,
    "swin": swin,
    "convnext": convnext,
    "mobilenet-v2": mobilenet_v2,
    "whisper": whisper,
    "bart": bart,
    "compiled-mlp": compiled,
}
if importlib.util.find_spec("peft") is not None:
    FAMILIES["peft-lora-llama"] = peft_lora
    if importlib.util.find_spec("bitsandbytes") is not None:
        FAMILIES["qlora-4bit-llama"] = qlora


def fsdp2_llama_wide() -> tuple[nn.Module, Any]:
    """A wider, shallower LLaMA (hidden 128, 4 layers), sharded as :func:`fsdp2_llama`: its bf16-mixed
    peak is a backward prefetch, where the all-gather input (the shards cast to bf16) counts."""
    return _sharded_llama(128, 4, 32)


FSDP_RANKS = 2
SHARDED: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "fsdp2-llama-2rank": fsdp2_llama,
    "fsdp2-llama-wide-2rank": fsdp2_llama_wide,
}
"""Families run sharded by FSDP2 over ``FSDP_RANKS`` real gloo CPU ranks."""
_LOSS = {"compiled-mlp": _xent}


def build(name: str, precision: str) -> Built:
    """A fresh, seeded ``(model, optimizer, batch, loss_fn)`` of family ``name`` (``*-true`` casts)."""
    torch.manual_seed(0)
    model, batch = FAMILIES[name]()
    if precision in ("bf16-true", "16-true"):
        model.to(torch.bfloat16 if precision == "bf16-true" else torch.float16)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt, batch, _LOSS.get(name)


def run(name: str, precision: str) -> dict[str, Any]:
    row: dict[str, Any] = {"case": f"{name}/{precision}"}
    model, opt, batch, loss_fn = build(name, precision)
    with native_stderr_silenced():
        est = estimate_memory(model, opt, batch, loss_fn, precision=precision, device="cpu")
    row.update(est=est.peak_bytes, method=est.method, recovered=est.recovered_ops, notes=est.warnings)
    del model, opt, batch
    gc.collect()
    model, opt, batch, loss_fn = build(name, precision)
    with native_stderr_silenced():
        truth = measure_training_step(model, opt, batch, loss_fn, precision=precision)
    row["true"] = truth.peak_bytes
    row["error_pct"] = 100.0 * (row["est"] - row["true"]) / row["true"]
    return row


def _shard(model: nn.Module, precision: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if precision == "bf16-mixed":  # torchtitan's policy, with Lightning's autocast on top
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


STEPS = 8
"""Measured steps per sharded case; the truth is the smallest whole one (see ``recorded_peak``)."""


def recorded_peak(prof: torch.profiler.profile) -> tuple[int, bool]:
    """The highest running total of a profiled step's CPU allocations (as ``measure_training_step``),
    and whether the profiler recorded it whole.

    Under gloo some frees are missing from the records: the last reference to a collective's buffers
    (the clone of the reduce-scatter input that gloo's work holds, an all-gather output) is sometimes
    dropped on gloo's worker thread after the work ran, where the profiler records nothing (a tensor
    freed on another thread leaves no record). The memory is freed (a later allocation of the step gets
    the same address) but the running total stays that much too high from then on. The peak is whole
    when every block alive at it has its free recorded later in the step (before its address is handed
    out again); otherwise a block counted there may already have been freed.
    """
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
        stack.extend(node.children)
    events.sort()
    live: dict[int, int] = {}  # address -> index of its allocation
    lost = 0  # blocks still counted whose address was handed out again: their free went unrecorded
    freed: set[int] = set()  # allocations whose free was recorded
    running = peak = 0
    at_peak: list[int] = []
    whole = True
    for i, (_, size, ptr) in enumerate(events):
        if size > 0:
            lost += ptr in live
            live[ptr] = i
        elif ptr in live:
            freed.add(live.pop(ptr))
        running += size
        if running > peak:
            peak, at_peak, whole = running, list(live.values()), not lost
    return peak, whole and all(i in freed for i in at_peak)


def _measured_sharded_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: Any, spec: Any
) -> tuple[int, bool]:
    """One real step of this rank: its peak bytes, and whether the record is whole (``recorded_peak``)."""
    gc.collect()
    start = live_bytes(model, opt, batch)
    with quiet_profile() as prof:
        training_step(model, opt, batch, None, spec, "cpu")
    peak, whole = recorded_peak(prof)
    return start + peak, whole


def _sharded_rank(rank: int, name: str, precision: str, path: str, port: int) -> None:
    """One gloo rank: shard, (rank 0) estimate the sharded module, then train and measure."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=FSDP_RANKS)
    try:
        torch.manual_seed(0)
        model, batch = SHARDED[name]()
        model.train()
        _shard(model, precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        lines = []
        if rank == 0:
            with native_stderr_silenced():
                est = estimate_memory(model, opt, batch, precision=precision, device="cpu")
            lines = [str(est.peak_bytes), est.method, est.layout.describe(), *est.warnings]  # type: ignore[attr-defined]
        spec = parse_precision(precision)
        for _ in range(2):  # warm-up: optimizer state
            training_step(model, opt, batch, None, spec, "cpu")
        steps = [_measured_sharded_step(model, opt, batch, spec) for _ in range(STEPS)]
        whole = [peak for peak, ok in steps if ok]
        if rank == 0:
            with open(path, "w") as f:
                true = min(whole or [peak for peak, _ in steps])
                most = max(peak for peak, _ in steps)
                f.write("\n".join([str(true), str(most), str(len(whole)), *lines]))
    finally:
        dist.destroy_process_group()


def run_sharded(name: str, precision: str) -> dict[str, Any]:
    """Estimate and measure rank 0 of ``FSDP_RANKS`` real gloo ranks of family ``name``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0")
        with socket.socket() as sock:  # a free port for the rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_sharded_rank, args=(name, precision, path, port), nprocs=FSDP_RANKS)
        with open(path) as f:
            true, most, whole, est, method, sharding, *notes = f.read().split("\n")
    row: dict[str, Any] = {"case": f"{name}/{precision}", "true": int(true), "est": int(est)}
    row.update(method=method, recovered=(), notes=tuple(notes), sharding=sharding, true_max=int(most))
    row["whole_steps"] = int(whole)
    row["error_pct"] = 100.0 * (row["est"] - row["true"]) / row["true"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=None, help="run only cases whose name contains SUBSTRING")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    rows = []
    print(f"{'case':<28} {'true KiB':>10} {'est KiB':>10} {'error':>8}  method / recovered operators")
    for name in [*FAMILIES, *SHARDED]:
        for precision in PRECISIONS:
            if args.only is not None and args.only not in f"{name}/{precision}":
                continue
            try:
                row = run_sharded(name, precision) if name in SHARDED else run(name, precision)
            except Exception as exc:  # a report: record and carry on
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                print(f"{name + '/' + precision:<28} FAILED {why}")
                continue
            rows.append(row)
            what = row["method"] + (": " + "; ".join(row["recovered"]) if row["recovered"] else "")
            if "sharding" in row:
                what += (
                    f" ({row['sharding']}; rank 0, {row['whole_steps']}/{STEPS} steps with a whole peak, "
                    f"largest recorded {row['true_max'] / 1024:.1f} KiB)"
                )
            print(
                f"{row['case']:<28} {row['true'] / 1024:>10.1f} {row['est'] / 1024:>10.1f} "
                f"{row['error_pct']:>+7.2f}%  {what}",
                flush=True,
            )
    if not rows:
        return 0
    errors = [abs(r["error_pct"]) for r in rows]
    traced = sum(r["method"] != "analytic" for r in rows)
    print(
        f"\ncases {len(rows)}, families {len({r['case'].split('/')[0] for r in rows})}: traced "
        f"{100 * traced / len(rows):.0f}%, median |error| {statistics.median(errors):.2f}%, "
        f"max |error| {max(errors):.2f}%, worst under {min(r['error_pct'] for r in rows):+.2f}%"
    )
    print(
        "MoE routing: static shapes (grouped_mm over tokens x top_k rows): any routing, worst case included"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
