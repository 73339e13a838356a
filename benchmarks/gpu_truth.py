"""GPU truth: the estimate for a GPU beside what that GPU reports, over a zoo of training steps.

For each row the model is built (seeded, random weights) on the CPU, the estimate is made for the GPU
(``estimate_memory(..., device=<gpu>)`` then ``.for_device(<gpu>)``), and then, on a real CUDA GPU,
the step runs ``--steps`` times (≥ 5; 16-mixed with a real ``torch.amp.GradScaler``) after
``torch.cuda.reset_peak_memory_stats()``, reading ``max_memory_allocated``, ``max_memory_reserved``
and the device's NVML "used" memory (context + reserved + everything else on the GPU; compare it with
the predicted device total only on an otherwise idle GPU). Each row runs in a fresh process
(``--row NAME``), so one row's cached blocks do not inflate the next.

The zoo covers 32-true, bf16-mixed, 16-mixed (GradScaler), activation checkpointing, SGD / AdamW /
Adafactor, a conv net, a cuDNN LSTM, a decoder with SDPA and one with eager attention, at batch sizes
where activations dominate.

Run on a GPU host:  ``python benchmarks/gpu_truth.py`` (all rows, prints the table)
Prediction only:    ``python benchmarks/gpu_truth.py --predict-only --device a100-40gb`` (any machine)
Without CUDA and without ``--predict-only`` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import native_stderr_silenced  # noqa: E402

MiB = 2**20
LossFn = Callable[[nn.Module, Any], torch.Tensor]


# -- the zoo ---------------------------------------------------------------------------------------
class Decoder(nn.Module):
    """A GPT-style decoder; ``attention="sdpa"`` (``F.scaled_dot_product_attention``) or ``"eager"``."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, attention: str, ckpt: bool) -> None:
        super().__init__()
        self.heads, self.attention, self.ckpt = heads, attention, ckpt
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(dim),
                    "qkv": nn.Linear(dim, 3 * dim),
                    "proj": nn.Linear(dim, dim),
                    "ln2": nn.LayerNorm(dim),
                    "up": nn.Linear(dim, 4 * dim),
                    "down": nn.Linear(4 * dim, dim),
                }
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def _attend(self, x: torch.Tensor, block: nn.ModuleDict) -> torch.Tensor:
        b, s, d = x.shape
        qkv = block["qkv"](block["ln1"](x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        else:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            probs = F.dropout(scores.masked_fill(~causal, float("-inf")).softmax(-1), 0.1, self.training)
            out = probs @ v
        return block["proj"](out.transpose(1, 2).reshape(b, s, d))

    def _block(self, x: torch.Tensor, block: nn.ModuleDict) -> torch.Tensor:
        x = x + self._attend(x, block)
        return x + block["down"](F.gelu(block["up"](block["ln2"](x))))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(self._block, x, block, use_reentrant=False) if self.ckpt else self._block(x, block)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class ConvNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for i in range(4):
            out = width * 2**i
            for conv_in in (c, out):
                layers += [nn.Conv2d(conv_in, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU()]
            layers.append(nn.MaxPool2d(2))
            c = out
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c, 1000)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(self.features(images).mean((2, 3))), labels)


class LstmLM(nn.Module):
    def __init__(self, vocab: int = 16000, dim: int = 1024, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return F.cross_entropy(self.head(out[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


class Mlp(nn.Module):
    def __init__(self, dim: int = 4096, layers: int = 6) -> None:
        super().__init__()
        self.net = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.GELU())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).float().pow(2).mean()


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    raise ValueError(name)


@dataclass(frozen=True)
class Row:
    name: str
    precision: str
    optimizer: str
    build: Callable[[], tuple[nn.Module, Any]]  # (model, batch); the model returns its loss


def _ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def _decoder(attention: str, ckpt: bool = False, batch: int = 8, seq: int = 1024) -> Callable[[], Any]:
    return lambda: (Decoder(32000, 768, 6, 12, attention, ckpt), (_ids(batch, seq, 32000),))


ROWS = [
    Row("mlp-4096x6/bs1024", "32-true", "adamw", lambda: (Mlp(), (torch.randn(1024, 4096),))),
    Row("convnet/bs64-224px", "bf16-mixed", "sgd",
        lambda: (ConvNet(), (torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,))))),
    Row("convnet/bs64-224px", "16-mixed", "sgd",
        lambda: (ConvNet(), (torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,))))),
    Row("lstm-2x1024/bs32-seq256", "16-mixed", "adamw", lambda: (LstmLM(), (_ids(32, 256, 16000),))),
    Row("lstm-2x1024/bs32-seq256", "32-true", "adamw", lambda: (LstmLM(), (_ids(32, 256, 16000),))),
    Row("decoder-sdpa/bs8-seq1024", "bf16-mixed", "adamw", _decoder("sdpa")),
    Row("decoder-sdpa/bs8-seq1024", "16-mixed", "adamw", _decoder("sdpa")),
    Row("decoder-sdpa/bs8-seq1024", "32-true", "adamw", _decoder("sdpa")),
    Row("decoder-sdpa/ckpt/bs16-seq1024", "bf16-mixed", "adamw", _decoder("sdpa", ckpt=True, batch=16)),
    Row("decoder-sdpa/bs8-seq1024", "bf16-mixed", "adafactor", _decoder("sdpa")),
    Row("decoder-eager/bs4-seq1024", "16-mixed", "adamw", _decoder("eager", batch=4)),
    Row("decoder-eager/bs4-seq1024", "bf16-mixed", "sgd", _decoder("eager", batch=4)),
    Row("decoder-eager/bs4-seq1024", "32-true", "adamw", _decoder("eager", batch=4)),
]  # fmt: skip


def _key(row: Row) -> str:
    return f"{row.name}/{row.precision}/{row.optimizer}"


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(*batch)


# -- prediction and measurement --------------------------------------------------------------------
def predict(row: Row, device: str) -> dict[str, Any]:
    from resource_guard import estimate_memory

    torch.manual_seed(0)
    model, batch = row.build()
    with warnings.catch_warnings(), native_stderr_silenced():
        warnings.simplefilter("ignore")
        est = estimate_memory(model, _optimizer(row.optimizer, model.parameters()), batch, _loss,
                              precision=row.precision, device=device)  # fmt: skip
    fit = est.for_device(device)
    return {
        "row": _key(row),
        "method": est.method,
        "assumed_target": est.assumed_target,
        "pred_allocated": fit.allocated_peak_bytes,
        "pred_reserved": fit.reserved_peak_bytes,
        "pred_device_total": fit.device_total_bytes,
        "trace_s": round(est.trace_seconds, 2),
    }


def _nvml_used_bytes() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
            handle = (
                pynvml.nvmlDeviceGetHandleByIndex(int(visible))
                if visible.isdigit()
                else pynvml.nvmlDeviceGetHandleByUUID(visible)
            )
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML is a nice-to-have here
        return None


def measure(row: Row, steps: int) -> dict[str, Any]:
    from resource_guard.step.precision import parse_precision

    spec = parse_precision(row.precision)
    torch.manual_seed(0)
    model, batch = row.build()
    model = model.to("cuda", dtype=spec.param_dtype)
    batch = tuple(t.to("cuda") for t in batch)
    optimizer = _optimizer(row.optimizer, model.parameters())
    scaler = torch.amp.GradScaler("cuda", enabled=spec.loss_scaling)

    def step() -> None:
        low = spec.autocast_dtype
        with torch.autocast("cuda", dtype=low or torch.float32, enabled=low is not None):
            loss = _loss(model, batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state now exists, as in the estimate's steady state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    nvml_peak = 0
    for _ in range(steps):
        step()
        torch.cuda.synchronize()
        nvml_peak = max(nvml_peak, _nvml_used_bytes() or 0)
    return {
        "allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
        "nvml_used": nvml_peak or None,
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
    }


# -- table -----------------------------------------------------------------------------------------
def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:,.0f}"


def _err(pred: int | None, true: int | None) -> str:
    return "-" if not pred or not true else f"{(pred - true) / true:+.1%}"


def print_table(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'row':<52} {'pred alloc':>10} {'alloc':>8} {'err':>7} {'pred resv':>10} {'resv':>8} "
        f"{'err':>7} {'pred total':>10} {'nvml':>8} {'err':>7}"
    )
    print(head + "\n" + "-" * len(head))
    for r in results:
        print(
            f"{r['row']:<52} {_mib(r['pred_allocated']):>10} {_mib(r.get('allocated')):>8} "
            f"{_err(r['pred_allocated'], r.get('allocated')):>7} {_mib(r['pred_reserved']):>10} "
            f"{_mib(r.get('reserved')):>8} {_err(r['pred_reserved'], r.get('reserved')):>7} "
            f"{_mib(r['pred_device_total']):>10} {_mib(r.get('nvml_used')):>8} "
            f"{_err(r['pred_device_total'], r.get('nvml_used')):>7}"
        )
    print("(MiB; err = (predicted - measured) / measured; targets: allocated ±3%, reserved ±8%)")
    for r in results:
        measured_on = f"; measured on {r['gpu']} (sm{r['capability'].replace('.', '')})" if "gpu" in r else ""
        print(f"  {r['row']}: predicted {r['assumed_target']}{measured_on}")


def run_row(row: Row, device: str, steps: int, predict_only: bool) -> dict[str, Any]:
    result = predict(row, device)
    if not predict_only:
        result.update(measure(row, steps))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default=None, help="catalog name or cuda:N (default: cuda:0 / a100-40gb)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--predict-only", action="store_true", help="only the prediction half (any machine)")
    parser.add_argument("--only", default="", help="rows whose name contains this")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one row, in this process
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    if args.steps < 5:
        parser.error("--steps must be at least 5")
    cuda = torch.cuda.is_available()
    if not cuda and not args.predict_only:
        print("gpu_truth: no CUDA device here; nothing measured (use --predict-only for the predictions).")
        return 0
    device = args.device or ("cuda:0" if cuda and not args.predict_only else "a100-40gb")
    rows = [r for r in ROWS if args.only in _key(r)]
    if args.row is not None:  # a child: one row, result as JSON on the last line
        row = next(r for r in ROWS if _key(r) == args.row)
        print(json.dumps(run_row(row, device, args.steps, args.predict_only)))
        return 0
    results = []
    for row in rows:
        if args.predict_only:
            results.append(run_row(row, device, args.steps, True))
            continue
        cmd = [sys.executable, __file__, "--row", _key(row), "--device", device, "--steps", str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{_key(row)}: failed\n{done.stderr[-2000:]}")
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print_table(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
