"""Predicted vs published: Hugging Face's bert-large training runs on a Tesla V100-SXM2-16GB.

Source: the Transformers docs "Efficient training on a single GPU" (``perf_train_gpu_one``, Jan 2022;
the same numbers later in ``model_memory_anatomy.md`` @ 249ef8164cfbd8e288c2f6d8395539b9e90e8300):
``bert-large-uncased`` ``AutoModelForSequenceClassification`` (2 labels, eager attention, dropout 0.1),
512 random sequences of 512 tokens *without* an attention mask, labels, HF ``Trainer`` defaults, on a
V100-SXM2 16 GB (driver 460.91, CUDA 11.2; torch 1.10 was the release of that date). The published
figure is NVML's "used" after training, in MiB: the CUDA context plus the caching allocator's reserved
memory; the docs measured the context (``torch.ones((1, 1)).to("cuda")``) at 1343 MiB.

What that run did, reproduced here (``--as-today`` drops the first three and prints the plain
estimate of the same model for today's torch):

- The Trainer's optimizer was ``adamw_hf``, transformers' own ``AdamW`` (one parameter at a time,
  one square-root temporary), or ``Adafactor(scale_parameter=False, relative_step=False)``, with
  ``clip_grad_norm_(max_norm=1.0)`` before every step (after ``GradScaler.unscale_`` in fp16).
- Gradients are never freed: the Trainer calls ``model.zero_grad()``, which in torch < 2.0 zeroes
  them in place (``set_to_none=False``). Every step after the first starts with all gradients
  allocated, and backward adds each new gradient into its old one: ``for_device(...,
  gradients_kept=True)``.
- torch 1.10's softmax kept its *input* for backward as well as its output (the schema
  ``_softmax_backward_data(grad, output, dim, self)``; dropped in torch 1.11 by pytorch/pytorch#66018,
  "Avoid saving self for softmax and log_softmax"). BERT of that time added its float32 extended
  mask ``(1 - ones) * -10000`` of shape (B, 1, 1, S) to the scores, so that input is float32 under
  fp16 autocast too. The attention below is that of transformers 4.16 with such a softmax.

The prediction: ``estimate_memory(..., device="v100-16gb")`` on a meta-device model (nothing of its
size is allocated), then ``.for_device("v100-16gb")``. Compared: the predicted reserved against the
published figure − 1343 MiB, and the predicted device total, which is the predicted reserved plus the
context *of that software*: 1343 MiB with CUDA's eager module loading (before CUDA 11.7 / torch
1.13). ``for_device`` itself assumes today's lazy loading (see
``resource_guard.estimate.allocation.allocator``).

Run: ``python benchmarks/public_gpu.py [--only SUBSTRING] [--as-today]`` (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

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


# -- the run of January 2022 ------------------------------------------------------------------------
class _SoftmaxKeepingInput(torch.autograd.Function):
    """``softmax`` as torch 1.10's autograd saved it: input and output (only the output is needed)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        out = torch.softmax(x, dim)
        ctx.save_for_backward(x, out)
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, out = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, ctx.dim, x.dtype), None


def _attention_2022(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """transformers 4.16's ``BertSelfAttention`` core for a batch without an attention mask."""
    scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(query.size(-1))
    # BertModel made torch.ones((B, S)) (float32), extended it to the parameters' dtype: float32
    extended = (1.0 - torch.ones(query.size(0), 1, 1, key.size(-2), dtype=torch.float32)) * -10000.0
    probs = _SoftmaxKeepingInput.apply(scores + extended, -1)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


@contextlib.contextmanager
def _bert_of_2022() -> Iterator[None]:
    from transformers.models.bert import modeling_bert

    saved = modeling_bert.eager_attention_forward
    modeling_bert.eager_attention_forward = _attention_2022
    try:
        yield
    finally:
        modeling_bert.eager_attention_forward = saved


class _AdamWHF(torch.optim.Optimizer):
    """The memory behaviour of ``transformers.AdamW`` (the Trainer's ``adamw_hf``): a for-loop over the
    parameters, moments updated in place, one ``sqrt`` temporary of the parameter's size."""

    def __init__(self, params: Any, lr: float = 5e-5, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:  # fmt: skip
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
                bias1, bias2 = 1.0 - beta1 ** state["step"], 1.0 - beta2 ** state["step"]
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] * math.sqrt(bias2) / bias1)


def _trainer_optimizer(name: str, as_today: bool) -> Any:
    """A factory of the Trainer's optimizer of 2022 (``as_today``: torch's AdamW, no clipping)."""
    from transformers.optimization import Adafactor

    def build(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        if name == "adamw":
            opt: Any = _AdamWHF(params) if not as_today else torch.optim.AdamW(params)
        else:
            opt = Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False)
        if as_today:
            return opt  # type: ignore[no-any-return]
        step = opt.step

        def clip_then_step(closure: Any = None) -> None:  # the Trainer clips before every step
            torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, foreach=False)
            step()

        opt.step = clip_then_step
        return opt  # type: ignore[no-any-return]

    return build


def predict(row: Published, as_today: bool = False) -> dict[str, Any]:
    from resource_guard import estimate_memory

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _bert_large(row.checkpointing)
    gen = torch.Generator().manual_seed(0)
    batch = {  # the docs' dataset: input_ids and labels, no attention_mask
        "input_ids": torch.randint(100, 30000, (row.batch, 512), generator=gen),
        "labels": torch.zeros(row.batch, dtype=torch.long),
    }
    era = contextlib.nullcontext() if as_today else _bert_of_2022()
    with warnings.catch_warnings(), native_quiet(), era:
        warnings.simplefilter("ignore")
        opt = _trainer_optimizer(row.optimizer, as_today)
        est = estimate_memory(model, opt, batch, precision=row.precision, device="v100-16gb")
    # the Trainer's model.zero_grad() zeroes the gradients (torch < 2.0): every later step starts with them
    return {"estimate": est, "fit": est.for_device("v100-16gb", gradients_kept=not as_today)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="")
    parser.add_argument("--as-today", action="store_true",
                        help="the plain estimate for today's torch, not the run of 2022")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("public_gpu: needs `transformers`; nothing compared.")
        return 0
    transformers.logging.set_verbosity_error()
    head = (
        f"{'row':<28} {'published':>9} {'pred total':>10} {'err':>7} {'pub-ctx':>8} {'pred resv':>9} "
        f"{'err':>7} {'pred alloc':>10}"
    )
    print(head + "\n" + "-" * len(head))
    errors = []
    summary = ""
    for row in (r for r in ROWS if args.only in r.name):
        out = predict(row, args.as_today)
        est, fit = out["estimate"], out["fit"]
        reserved = fit.reserved_peak_bytes / MiB
        total = reserved + CONTEXT_MIB  # the context of that software (eager module loading)
        pub_reserved = row.used_mib - CONTEXT_MIB
        err_total, err_resv = (total - row.used_mib) / row.used_mib, (reserved - pub_reserved) / pub_reserved
        errors.append((row.name, err_total, err_resv))
        summary = est.assumed_target
        print(
            f"{row.name:<28} {row.used_mib:>9,} {total:>10,.0f} {err_total:>+7.1%} {pub_reserved:>8,} "
            f"{reserved:>9,.0f} {err_resv:>+7.1%} {fit.allocated_peak_bytes / MiB:>10,.0f}"
            + ("" if est.method == "traced" else f"  ({est.method})")
        )
    print(f"(MiB; published = NVML used on a V100-SXM2-16GB; pub-ctx = published − {CONTEXT_MIB} MiB "
          f"context; pred total = pred resv + {CONTEXT_MIB})")  # fmt: skip
    if errors:
        worst = max(errors, key=lambda e: abs(e[2]))
        setup = "today's torch and Trainer" if args.as_today else "the run of Jan 2022 reproduced"
        print(f"predicted as: {summary.split(', autocast')[0]}; {setup}")
        print(f"worst reserved error: {worst[2]:+.1%} ({worst[0]}); "
              f"max |device total error|: {max(abs(e[1]) for e in errors):.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
