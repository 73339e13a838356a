"""The for-each probe against the steps it stands for: is for-each faster here, and by how much?

`observe/optimizer_facts.foreach_probe` times an optimizer's step on zero tensors shaped like its
parameters, ``foreach=False`` against ``foreach=True``; the optimizer-step finding predicts its gain from
that. Which path is faster, and by how much, is this machine's answer, so it is printed here rather than
asserted in a unit test. For each parameter set: the probe's two figures and their ratio, beside the
same optimizer stepping real parameters in a bare loop (median of ``--steps`` steps per path,
interleaved).

Run:  python benchmarks/optimizer_probe.py [--steps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from resource_guard.observe.optimizer_facts import foreach_probe

SETS = {  # name -> (count, shape)
    "360 x 32x32 (small layers)": (360, (32, 32)),
    "200 x 16x16": (200, (16, 16)),
    "48 x 512x512": (48, (512, 512)),
    "8 x 2048x2048 (few large)": (8, (2048, 2048)),
}


def _params(count: int, shape: tuple[int, ...]) -> list[torch.nn.Parameter]:
    out = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(shape))
        p.grad = torch.randn(shape) * 1e-3
        out.append(p)
    return out


def bare_loop(count: int, shape: tuple[int, ...], steps: int) -> tuple[float, float]:
    """Median seconds of one AdamW step, for-loop then for-each, interleaved."""
    loop = torch.optim.AdamW(_params(count, shape), foreach=False)
    each = torch.optim.AdamW(_params(count, shape), foreach=True)
    loop.step(), each.step()  # state exists from the first step
    times: dict[str, list[float]] = {"loop": [], "each": []}
    for _ in range(steps):
        for name, opt in (("loop", loop), ("each", each)):
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["loop"]), statistics.median(times["each"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="steps per path in the bare loop")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; AdamW, seconds per step")
    header = f"{'parameters':<28} {'probe loop':>11} {'probe each':>11} {'ratio':>6}"
    header += f" {'bare loop':>10} {'bare each':>10} {'ratio':>6}"
    print(header)
    for name, (count, shape) in SETS.items():
        probe = foreach_probe(torch.optim.AdamW(_params(count, shape), foreach=False))
        assert probe is not None
        loop_s, each_s = bare_loop(count, shape, args.steps)
        print(
            f"{name:<28} {probe['for_loop_s']:>11.5f} {probe['foreach_s']:>11.5f}"
            f" {probe['foreach_s'] / probe['for_loop_s']:>6.2f}"
            f" {loop_s:>10.5f} {each_s:>10.5f} {each_s / loop_s:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
