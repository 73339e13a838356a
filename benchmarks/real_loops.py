"""Loops as public scripts write them, each wrapped only in ``with guard(model, optimizer):``.

The loops live in ``benchmarks/real_loops/`` (one file each, ``build()`` and ``train(model, optimizer,
steps)``): a nanoGPT-like GPT with ``logits, loss = model(X, Y)`` and its own accumulation; an mnist-
like classifier with a test pass each epoch; time_sequence_prediction's float64 LBFGS closure loop;
word_language_model's sequence-first LSTM LM with manual SGD updates (``guard(model, None)``, its steps
counted as a backward then the next forward, its batch dim 1 read from its LSTM); transformers'
run_clm_no_trainer loop (``outputs = model(**batch)``, ``outputs.loss``, its own accumulation of 2) on a
GPT-2 built from its config; dcgan's two models and two Adam optimizers (``guard(nn.ModuleDict(...),
[optimizerD, optimizerG])``: its first step recorded, then replayed for the plan). Per loop it prints:
whether the pre-flight ran before the first forward, the predicted peak (the guard's plan) against the
real CPU peak of the loop as written (torch.profiler's memory records over the same steps run unguarded,
optimizer state created in the first), the optimizer steps the guard counted against those the loop ran
(a step post-hook of our own), the accumulation it found, the report's first finding, and the final loss
against the same loop without the guard.

Run: ``python benchmarks/real_loops.py [--steps 4]`` (CPU, about a minute).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from resource_guard import guard
from resource_guard.estimate.host.measure import allocation_deltas, live_bytes, peak_of
from resource_guard.estimate.host.quiet import quiet_profile

LOOPS = ("nanogpt", "classifier", "lbfgs", "word_lm", "hf_causal_lm", "dcgan")
HERE = Path(__file__).parent / "real_loops"


def load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"real_loops_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def unguarded(loop: Any, steps: int) -> tuple[float, int, int]:
    """The loop alone: its final loss, the optimizer steps it ran and its real CPU peak (bytes)."""
    torch.manual_seed(0)
    model, optimizer = loop.build()
    ran = [0]
    count = lambda *a: ran.__setitem__(0, ran[0] + 1)  # noqa: E731
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer] if optimizer is not None else []
    if optimizers:  # several (a GAN's): a step is each optimizer stepped once, counted at the last
        optimizers[-1].register_step_post_hook(count)
    else:  # manual updates: one update a backward, counted where it accumulates the first gradient
        next(model.parameters()).register_post_accumulate_grad_hook(count)
    gc.collect()
    start = live_bytes(model, *optimizers)
    with quiet_profile() as prof:
        loss = loop.train(model, optimizer, steps)
    return loss, ran[0], start + peak_of(allocation_deltas(prof))


def guarded(loop: Any, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, optimizer = loop.build()
    seen: list[bool] = []
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard(model, optimizer, log_dir=log_dir, profile=False) as g:
            # after the guard's own hook: was the run planned before the loop's first forward ran?
            model.register_forward_pre_hook(
                lambda m, a: seen.append(g.plan is not None) if m is model and not seen else None
            )
            loss = loop.train(model, optimizer, steps)
    report = g.report
    first = report.findings[0].id if report is not None and report.findings else "-"
    watch = g.summary().get("observed", {})
    return {
        "loss": loss,
        "preflight_first": bool(seen and seen[0]),
        # the plan's figure for the step as the loop runs it (refitted once the loop's later micro-steps
        # start with gradients allocated); on the CPU, what the allocator holds at the peak
        "predicted": g.plan.fit.allocated_peak_bytes if g.plan is not None else None,
        "method": g.plan.estimate.method if g.plan is not None else None,
        "steps": g.optimizer_steps,
        "accumulation": watch.get("accumulation"),
        "finding": first,
        "warnings": [str(w.message)[:100] for w in caught],
    }


def _full_batches(name: str, loop: Any, steps: int) -> list[Any]:
    """The loop's own data as the batches of one optimizer step each (its accumulation's micro-batches
    together: ``g.iterate`` splits them again where the plan says)."""
    if name == "nanogpt":
        g = torch.Generator().manual_seed(1337)
        out = []
        for _ in range(steps):
            parts = [loop.get_batch(g) for _ in range(loop.ACCUMULATION)]
            out.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
        return out
    if name == "classifier":
        return list(loop.loader(0, steps))
    rows = list(loop.loader(steps))  # hf_causal_lm: its accumulation's micro-batches, concatenated
    k = loop.ACCUMULATION
    return [
        {key: torch.cat([r[key] for r in rows[i : i + k]]) for key in rows[0]} for i in range(0, len(rows), k)
    ]


def full_way(name: str, loop: Any, steps: int) -> dict[str, Any]:
    """The loop as the README's full way writes it: ``for batch in g.iterate(batches)``, the forward under
    ``g.autocast()``, ``g.backward(loss)`` stepping the optimizer (the guard applies its plan)."""
    torch.manual_seed(0)
    model, optimizer = loop.build()

    def loss_of(m: Any, batch: Any) -> Any:
        if name == "nanogpt":
            return m(*batch)[1]
        if name == "classifier":
            return torch.nn.functional.nll_loss(m(batch[0]), batch[1])
        return m(**batch).loss

    loss = torch.zeros(())
    with (
        tempfile.TemporaryDirectory() as log_dir,
        guard(model, optimizer, loss_fn=loss_of, log_dir=log_dir, profile=False) as g,
    ):
        for batch in g.iterate(_full_batches(name, loop, steps)):
            with g.autocast():
                loss = loss_of(model, batch)
            g.backward(loss)
    assert g.plan is not None
    return {
        "steps": g.optimizer_steps,
        "plan": f"{g.plan.micro_batch_size}×{g.plan.accumulation_steps} {g.plan.precision}",
        "loss": float(loss.detach()),
        "finding": g.report.findings[0].id if g.report is not None and g.report.findings else "-",
    }


FULL_WAY = ("nanogpt", "classifier", "hf_causal_lm")  # the others are refused by g.iterate, by design


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="*", choices=LOOPS, default=LOOPS, help="the loops to run")
    args = parser.parse_args(argv)
    mib = 2**20
    print(
        "| loop | pre-flight before 1st forward | predicted MiB | real MiB | error | steps counted/run "
        "| accumulation | first finding | final loss guarded vs alone |"
    )
    print("|---|:-:|---:|---:|---:|:-:|:-:|---|---|")
    for name in args.only:
        loop = load(name)
        alone, ran, real = unguarded(loop, args.steps)
        got = guarded(loop, args.steps)
        predicted = got["predicted"]
        error = f"{predicted / real - 1:+.1%}" if predicted else "-"
        same = "identical" if got["loss"] == alone else f"{got['loss']!r} vs {alone!r}"
        print(
            f"| {name} | {'yes' if got['preflight_first'] else 'no'} | "
            f"{predicted / mib if predicted else float('nan'):.2f} ({got['method']}) | {real / mib:.2f} | "
            f"{error} | {got['steps']}/{ran} | {got['accumulation']} | {got['finding']} | {same} |"
        )
        for message in got["warnings"]:
            print(f"  warning ({name}): {message}")
    full = [name for name in args.only if name in FULL_WAY]
    if full:
        print("\nThe same loops adopted the README's full way (g.iterate / g.autocast / g.backward):")
        print("| loop | ran to the end | optimizer steps | plan | final loss | first finding |")
        print("|---|:-:|:-:|---|---:|---|")
        for name in full:
            done = full_way(name, load(name), args.steps)
            ok = "yes" if done["steps"] == args.steps and math.isfinite(done["loss"]) else "no"
            steps_run, final = f"{done['steps']}/{args.steps}", f"{done['loss']:.4f}"
            cells = [name, ok, steps_run, done["plan"], final, done["finding"]]
            print("| " + " | ".join(cells) + " |")
        print("(the LBFGS closure, manual-update and two-optimizer GAN loops are refused by g.iterate before")
        print(" any step, by design: their unchanged form above is the supported one)")


if __name__ == "__main__":
    main()
