"""Predicted vs published: Hugging Face's bert-large training runs on a Tesla V100-SXM2-16GB.

Source: the Transformers docs "Efficient training on a single GPU" / "Model training anatomy"
(``docs/source/en/model_memory_anatomy.md`` @ 249ef8164cfbd8e288c2f6d8395539b9e90e8300 and the
older ``perf_train_gpu_one`` page, numbers as in its zh/ko translations): ``bert-large-uncased``
``AutoModelForSequenceClassification`` (2 labels, eager attention, dropout 0.1), sequence length 512,
HF ``Trainer`` with AdamW, on a V100-SXM2 16 GB, torch 1.10 / CUDA 11.2 (Jan 2022). The published
figure is NVML's "used" after training, in MB (MiB): CUDA context + the caching allocator's
reserved high-water mark. The docs measured the bare context at 1343 MiB on that machine.

The prediction: ``estimate_memory(..., device="v100-16gb")`` on a meta-device model (nothing of its
size is allocated), then ``.for_device("v100-16gb")``. Two comparisons per row: the predicted
device total (our context model + predicted reserved) against the published figure, and the
predicted reserved against published − 1343 MiB (the published context). AdamW is the for-loop
implementation (``foreach=False``): the Trainer of that time ran ``transformers.AdamW``, one
parameter at a time. Rows with gradient accumulation (ga4, bs=1): the estimate is of one step,
which starts without gradients; in micro-steps 2–4 the accumulated gradients are alive through
forward and backward, so for those rows the forward/backward points of the estimate's timeline are
re-counted with every gradient present, and the difference added to the device figures.

Run: ``python benchmarks/public_gpu.py [--only SUBSTRING]`` (about a minute per row on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import native_stderr_silenced as native_quiet  # noqa: E402

MiB = 2**20
CONTEXT_MIB = 1343  # "GPU memory occupied" after torch.ones((1, 1)).to("cuda"), as published


@dataclass(frozen=True)
class Published:
    name: str
    batch: int
    accumulation: int
    precision: str
    optimizer: str
    checkpointing: bool
    used_mib: int


ROWS = [
    Published("bs4 fp32 AdamW", 4, 1, "32-true", "adamw", False, 14949),
    Published("bs4 fp16 AdamW", 4, 1, "16-mixed", "adamw", False, 13939),
    Published("bs1 ga4 fp32 AdamW", 1, 4, "32-true", "adamw", False, 8681),
    Published("bs1 ga4 ckpt fp32 AdamW", 1, 4, "32-true", "adamw", True, 6775),
    Published("bs1 ga4 ckpt fp16 AdamW", 1, 4, "16-mixed", "adamw", True, 7275),
    Published("bs4 fp32 Adafactor", 4, 1, "32-true", "adafactor", False, 12295),
    Published("bs1 ga4 ckpt fp16 Adafactor", 1, 4, "16-mixed", "adafactor", True, 4847),
]


def _bert_large(checkpointing: bool) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(  # bert-large-uncased
        vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
        intermediate_size=4096, max_position_embeddings=512, num_labels=2, attn_implementation="eager",
    )  # fmt: skip
    with torch.device("meta"):
        model = BertForSequenceClassification(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.train()


def _optimizer(name: str) -> Any:
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0, foreach=False)
    from transformers.optimization import Adafactor

    return lambda params: Adafactor(params, scale_parameter=True, relative_step=True, lr=None)


def predict(row: Published) -> dict[str, Any]:
    from resource_guard import estimate_memory

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _bert_large(row.checkpointing)
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 30522, (row.batch, 512), generator=gen),
        "attention_mask": torch.ones(row.batch, 512, dtype=torch.long),
        "labels": torch.randint(0, 2, (row.batch,), generator=gen),
    }
    with warnings.catch_warnings(), native_quiet():
        warnings.simplefilter("ignore")
        opt = _optimizer(row.optimizer)
        est = estimate_memory(model, opt, batch, precision=row.precision, device="v100-16gb")
    fit = est.for_device("v100-16gb")
    extra = _accumulated_gradients_extra(est, model) if row.accumulation > 1 else 0
    return {"estimate": est, "fit": fit, "extra": extra}


def _accumulated_gradients_extra(est: Any, model: Any) -> int:
    """Bytes a later micro-step of accumulation peaks above the estimated (first) step."""
    from resource_guard.estimate import CATEGORIES

    grads = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)  # fp32 gradients
    g = CATEGORIES.index("gradients")
    later = max(
        sum(sizes) - sizes[g] + grads for phase, sizes in est.timeline if phase in ("forward", "backward")
    )
    return max(0, later - est.peak_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("public_gpu: needs `transformers`; nothing compared.")
        return 0
    transformers.logging.set_verbosity_error()
    head = (
        f"{'row':<32} {'published':>9} {'pred total':>10} {'err':>7} {'pub-ctx':>8} {'pred resv':>9} "
        f"{'err':>7} {'pred alloc':>10}"
    )
    print(head + "\n" + "-" * len(head))
    errors = []
    summary = ""
    for row in (r for r in ROWS if args.only in r.name):
        out = predict(row)
        est, fit, extra = out["estimate"], out["fit"], out["extra"]
        total, reserved = (fit.device_total_bytes + extra) / MiB, (fit.reserved_peak_bytes + extra) / MiB
        pub_reserved = row.used_mib - CONTEXT_MIB
        err_total, err_resv = (total - row.used_mib) / row.used_mib, (reserved - pub_reserved) / pub_reserved
        errors.append((row.name, err_total, err_resv))
        summary = getattr(est, "assumed_target", "as on v100-16gb (no target summary in this version)")
        print(
            f"{row.name:<32} {row.used_mib:>9,} {total:>10,.0f} {err_total:>+7.1%} {pub_reserved:>8,} "
            f"{reserved:>9,.0f} {err_resv:>+7.1%} {(fit.allocated_peak_bytes + extra) / MiB:>10,.0f}"
            + ("" if est.method == "traced" else f"  ({est.method})")
        )
    print("(MiB; published = NVML used on a V100-SXM2-16GB; pub-ctx = published − 1343 MiB context)")
    if errors:
        worst = max(errors, key=lambda e: abs(e[2]))
        print(f"predicted as: {summary.split(', autocast')[0]}")
        print(f"worst reserved error: {worst[2]:+.1%} ({worst[0]}); "
              f"max |device total error|: {max(abs(e[1]) for e in errors):.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
