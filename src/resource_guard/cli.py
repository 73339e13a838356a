"""``resource-guard``: pre-flight a training step from the command line, list devices, print run reports.

Exit codes: 0 fits (also "fits tight", inside the headroom, with a warning line; `--strict` makes that 1),
1 does not fit or grew beyond its memory budget (``--budget FILE``), or ``compare``'s step time regressed
beyond ``--max-step-regression``, 2 bad input (a one-paragraph
message, never a traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from resource_guard.cli_input import BadInput as _BadInput
from resource_guard.cli_input import load_target
from resource_guard.devices import format_bytes
from resource_guard.errors import DoesNotFitError, ResourceGuardError

__all__ = ["main", "load_target", "format_bytes"]

DEFAULT_TARGET = "resource_guard.demo:build"
_COMPARE = ("t4", "l4", "a10g", "rtx-4090", "a100-40gb", "a100-80gb", "h100-sxm")


def _fit_rows(estimate: Any, device: Any, headroom: float, catalog: Any) -> tuple[Any, list[Any]]:
    main = estimate.for_device(device, headroom=headroom, catalog=catalog)
    others = []
    if catalog is not None:
        for name in _COMPARE:
            if name in catalog and name != main.device.name:
                others.append(estimate.for_device(catalog.get(name), headroom=headroom))
    return main, others


def _print_report(target: str, estimate: Any, fit: Any, others: list[Any], headroom: float) -> None:
    from resource_guard.report.terminal import render_preflight

    render_preflight(target, estimate, fit, others, headroom)


def _preflight(args: argparse.Namespace) -> int:
    from resource_guard.devices import load_catalog, resolve_device
    from resource_guard.estimate import estimate_memory
    from resource_guard.step.precision import parse_precision

    if args.batch_size is not None and args.batch_size <= 0:
        raise _BadInput(f"--batch-size {args.batch_size} must be a positive integer.")
    if _wants_projection(args):
        if args.budget is not None:
            raise _BadInput(
                "--budget compares the estimate of one step; it cannot be combined with the time and cost "
                "projection (--train-tokens, --train-samples, --epochs, --dataset-size)."
            )
        return _preflight_projection(args)
    if args.update_budget and args.budget is None:
        raise _BadInput("--update-budget writes the file given by --budget FILE; pass --budget too.")
    if not 0 <= args.headroom < 0.9:
        raise _BadInput(f"--headroom {args.headroom} must be in [0, 0.9).")
    spec = parse_precision(args.precision)
    catalog = load_catalog(args.catalog)
    device = resolve_device(args.device, catalog)
    model, optimizer, batch, loss_fn = load_target(args.target, args.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = estimate_memory(model, optimizer, batch, loss_fn, precision=spec.name, device=device)
    fit, others = _fit_rows(estimate, device, args.headroom, catalog)
    budget = _budget(args, estimate, device.name, spec.name) if args.budget is not None else None
    if args.json:
        payload = {
            "target": args.target,
            "estimate": estimate.to_dict(),
            "fit": fit.to_dict(),
            "other_devices": [f.to_dict() for f in others],
        }
        if budget is not None:
            payload["budget"] = {
                "file": args.budget,
                "updated": args.update_budget,
                **{k: v for k, v in budget.__dict__.items() if k != "budget"},
                "passed": budget.passed,
            }
        print(json.dumps(payload, indent=2))
    else:
        _print_report(args.target, estimate, fit, others, args.headroom)
    over = budget is not None and not budget.passed and not args.update_budget
    if fit.verdict == "fits tight":  # exit 0 unless --strict; the warning line goes to stderr
        risks = "; ".join(fit.tight_risks[1:])
        print(f"warning: fits tight, within the {args.headroom:.0%} headroom: {risks}", file=sys.stderr)
        return 1 if args.strict or over else 0
    return 0 if fit.fits and not over else 1


def _budget(args: argparse.Namespace, estimate: Any, device: str, precision: str) -> Any:
    """Compare with (or, with --update-budget, record into) the budget file; one line on stderr."""
    from resource_guard.testing.budgets import check_budget_file, check_tolerance

    try:
        tolerance = check_tolerance(args.budget_tolerance, "--budget-tolerance")
    except ResourceGuardError:
        raise _BadInput(f"--budget-tolerance {args.budget_tolerance} must be in [0, 1), e.g. 0.02.") from None
    key = args.budget_key or f"{args.target} @ {device}, {precision}, batch {estimate.batch_size}"
    hint = "`resource-guard preflight ... --update-budget` records it"
    result = check_budget_file(
        args.budget, key, estimate, tolerance=tolerance, update=args.update_budget, update_hint=hint
    )
    if args.update_budget:
        was = f" (was {result.old_peak_bytes:,})" if result.old_peak_bytes is not None else " (new)"
        print(
            f"budget {key!r}: recorded {result.new_peak_bytes:,} bytes{was} in {args.budget}", file=sys.stderr
        )
    else:
        print(("budget failed: " if not result.passed else "budget: ") + result.message, file=sys.stderr)
    return result


# -- preflight --train-tokens/--train-samples/--epochs: time and cost over the catalog (issue #13) ----
class _DefaultPrecision(str):
    """The --precision default, told apart from an explicit ``--precision 32-true`` (projection: auto)."""


def _add_projection_args(pre: argparse.ArgumentParser) -> None:
    pre.set_defaults(precision=_DefaultPrecision("32-true"))
    group = pre.add_argument_group(
        "time and cost projection (any of --train-tokens, --train-samples, --epochs switches it on)"
    )
    group.add_argument("--train-tokens", type=int, default=None, help="tokens to train on")
    group.add_argument("--train-samples", type=int, default=None, help="samples to train on")
    group.add_argument("--epochs", type=float, default=None, help="epochs over --dataset-size samples")
    group.add_argument("--dataset-size", type=int, default=None, help="samples in one epoch")
    group.add_argument("--gpus", default="1,2,4,8", help="GPU counts to project (default 1,2,4,8)")
    group.add_argument("--devices", default=None, help="catalog devices, comma-separated (default: all GPUs)")
    group.add_argument("--target-batch-size", type=int, default=None, help="samples per optimizer step")
    group.add_argument("--max-hours", type=float, default=None, help="limit on the training's hours")
    group.add_argument("--max-cost", type=float, default=None, help="limit on the training's cost, USD")
    group.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="share of peak FLOP/s of the whole step (default: the per-operator model on GPUs)",
    )
    group.add_argument("--calibrate", default=None, help="a monitored run's log dir or report.json")
    group.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    group.add_argument("--inter-node-gbps", type=float, default=None, help="GB/s per GPU between nodes")


def _wants_projection(args: argparse.Namespace) -> bool:
    return any(
        getattr(args, k, None) is not None
        for k in ("train_tokens", "train_samples", "epochs", "dataset_size")
    )


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise _BadInput(f"{flag} {text!r} must be positive integers separated by commas, e.g. 1,2,4,8.")
    return values


def _preflight_projection(args: argparse.Namespace) -> int:
    from resource_guard.devices import load_catalog
    from resource_guard.planning.projection import project_training
    from resource_guard.planning.steptime import Calibration, Interconnect

    gpus = _int_list(args.gpus, "--gpus")
    catalog = load_catalog(args.catalog)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    calibration = Calibration.from_report(args.calibrate, catalog) if args.calibrate else None
    link = Interconnect(gpus_per_node=args.gpus_per_node, inter_node_gbps=args.inter_node_gbps)
    precision = "auto" if isinstance(args.precision, _DefaultPrecision) else args.precision
    model, optimizer, batch, loss_fn = load_target(args.target, args.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proj = project_training(
            model,
            optimizer,
            batch,
            loss_fn,
            train_samples=args.train_samples,
            train_tokens=args.train_tokens,
            epochs=args.epochs,
            dataset_size=args.dataset_size,
            target_batch_size=args.target_batch_size,
            devices=devices,
            gpus=gpus,
            max_hours=args.max_hours,
            max_cost=args.max_cost,
            precision=precision,
            headroom=args.headroom,
            efficiency=args.efficiency,
            calibration=calibration,
            interconnect=link,
            catalog=catalog,
        )
    if args.json:
        print(json.dumps({"target": args.target, **proj.to_dict()}, indent=2))
    else:
        _print_projection(args.target, proj)
    return 0 if proj.recommended("fastest") is not None else 1


def _print_projection(target: str, proj: Any) -> None:
    from resource_guard.planning.projection import checkpointing_on

    tokens = f", {proj.tokens_per_sample} tokens each" if proj.tokens_per_sample else ""
    flops = proj.flops.forward_per_sample + proj.flops.backward_per_sample
    cal = proj.calibration
    eff = (
        f"calibrated on {cal.device} ({cal.achieved_flops_per_s / 1e12:.3g} TFLOP/s measured, {cal.source})"
        if cal is not None
        else "assumed (no monitored run; --calibrate LOGDIR to measure it)"
    )
    if cal is not None and not any(r.calibrated for r in proj.rows):
        eff = (
            f"assumed: the run on {cal.device} has no catalog peak to turn into an efficiency, so it "
            f"calibrates only {cal.device} rows (--devices {cal.device})"
        )
    print(f"resource-guard preflight: {target}: time and cost to train")
    print(
        f"  {proj.train_samples:,} samples{tokens}; {proj.optimizer_steps:,} optimizer steps of "
        f"{proj.target_batch_size}; {flops / 1e9:,.3g} GFLOP per sample (forward + backward)"
    )
    if proj.step_model == "per-operator" and cal is None:
        print(
            "  step time: per-operator model of the traced step on each GPU (catalog peak and bandwidth, "
            "efficiency by operator class and size); --calibrate LOGDIR to measure it"
        )
    else:
        print(f"  efficiency {proj.efficiency:.0%} of peak: {eff}")
    link = proj.interconnect
    print(
        f"  interconnect: {link.gpus_per_node} GPUs/node, NVLink where the part has it else PCIe 4.0; "
        "between nodes 50 GB/s per GPU (H100/H200/MI300X) or 25 GB/s"
        if link.inter_node_gbps is None
        else f"  interconnect: {link.gpus_per_node} GPUs/node, {link.inter_node_gbps:g} GB/s/GPU across nodes"
    )
    head = (
        f"{'device':<11}{'GPUs':>6}  {'plan':<30}{'step':>10}{'hours':>10}{'$/h/GPU':>9}{'cost $':>11}  bound"
    )
    print("\n" + head)
    for r in proj.rows:
        gpus = f"{r.nodes}x{r.gpus // r.nodes}" if r.nodes > 1 else str(r.gpus)
        if not r.fits or r.step_s is None:
            print(f"{r.device:<11}{gpus:>6}  {'-- ' + (r.reason or 'does not fit')}")
            continue
        p = r.plan
        plan = f"{p['micro_batch_size']}x{p['accumulation_steps']} {p['precision']} {p['strategy']}"
        ckpt = p["checkpointing"]
        plan += "" if not checkpointing_on(ckpt) else " +ckpt" if ckpt is True else f" +ckpt:{ckpt}"
        price = f"{r.usd_per_hour:.2f}" if r.usd_per_hour is not None else "-"
        cost = f"{r.cost_usd:,.2f}" if r.cost_usd is not None else "-"
        marks = " ".join([*r.recommended, *(["(calibrated)"] if r.calibrated else [])])
        cells = f"{_seconds(r.step_s):>10}{r.hours:>10,.3g}{price:>9}{cost:>11}"
        tail = f"  {r.bound:<14}{'<- ' + marks if marks else ''}"
        print(f"{r.device:<11}{gpus:>6}  {plan:<30}{cells}{tail}".rstrip())
    if proj.recommended("fastest") is None:
        print("\nnothing fits within the limits (--max-hours, --max-cost)")
    print(f"\n({proj.plan_calls} plans for {len(proj.rows)} rows, {proj.seconds:.1f} s)")


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:,.3g} s"


def _devices(args: argparse.Namespace) -> int:
    from resource_guard.devices import detect_local_devices, load_catalog

    catalog = load_catalog(args.catalog)
    local = detect_local_devices(catalog)
    if args.json:
        rows = [_spec_dict(catalog.get(n)) for n in catalog.names()]
        print(json.dumps({"catalog": rows, "detected": [_spec_dict(d) for d in local]}, indent=2))
        return 0
    from resource_guard.report.terminal import render_devices

    render_devices(catalog, local)
    return 0


def _spec_dict(d: Any) -> dict[str, Any]:
    return {
        "name": d.name,
        "kind": d.kind,
        "memory_bytes": d.memory_bytes,
        "free_bytes": d.free_bytes,
        "bf16": d.bf16,
        "compute_capability": d.compute_capability,
        "peak_tflops": dict(d.peak_tflops),
        "memory_bandwidth_gbps": d.memory_bandwidth_gbps,
        "price_per_hour_usd": d.price_per_hour_usd,
        "display_name": d.display_name,
    }


def _report(args: argparse.Namespace) -> int:
    from resource_guard.report.findings import report_command

    return report_command(args.logdir, as_json=args.json, as_markdown=args.markdown)


@contextlib.contextmanager
def _summary_left_to_the_report() -> Iterator[None]:
    """The monitor's end-of-run summary lines, not printed: the demo prints the whole report after it."""
    import logging

    log = logging.getLogger("resource_guard")
    saved = (log.level, log.propagate)
    quiet = logging.NullHandler()
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(quiet)
    try:
        yield
    finally:
        log.removeHandler(quiet)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def _demo(args: argparse.Namespace) -> int:
    from resource_guard.demo import run_demo

    if args.steps <= 0:
        raise _BadInput(f"--steps {args.steps} must be a positive integer.")
    from resource_guard.planning.nofit import NoFitReport
    from resource_guard.report.terminal import make_console, render_nofit, render_plan, render_report

    console = make_console()
    limit = args.memory_limit or None
    print(
        f"resource-guard demo: {args.steps} optimizer steps of a small GPT (5.3M parameters) on synthetic "
        "tokens, on this CPU"
        + (f", planned as if the device had {limit}" if limit else "")
        + "; planning the step (traced on fake tensors)...",
        flush=True,
    )
    started = time.perf_counter()

    def planned(plan: Any) -> None:
        render_plan(plan, console)
        print(f"\ntraining {args.steps} steps...", flush=True)

    def stepped(k: int) -> None:  # a live counter where someone watches; nothing when piped
        if sys.stderr.isatty():
            per = (time.perf_counter() - started) / k
            end = "\n" if k == args.steps else ""
            sys.stderr.write(
                f"\r  step {k}/{args.steps}  {per:.2f} s/step  ETA {per * (args.steps - k):.0f} s {end}"
            )
            sys.stderr.flush()

    try:
        with _summary_left_to_the_report():
            g = run_demo(
                args.steps, log_dir=args.log_dir, memory_limit=limit, on_plan=planned, on_step=stepped
            )
    except DoesNotFitError as exc:
        if isinstance(exc.report, NoFitReport):
            render_nofit(exc.report, console)
        else:
            console.print(str(exc))
        return 1
    assert g.plan is not None
    console.print()
    if g.report is not None:
        render_report(g.report, console)
    else:
        console.print("(monitoring was off: no report)")
    console.print(
        f"\nLogs: {args.log_dir}  (tensorboard --logdir {args.log_dir}; resource-guard report {args.log_dir})"
    )
    return 0


# --help is plain text (argparse prints it as written): no reST markup, unlike the docstrings
_DESCRIPTION = """\
Pre-flight a PyTorch training step from the command line (will it fit, and
what would), list devices, train the bundled demo, print run reports.
"""
_EXIT_CODES = """\
exit codes:
  0  fits; also "fits tight" (inside the headroom), with a warning line
     on stderr, unless --strict
  1  does not fit, grew beyond its memory budget (--budget FILE), or no
     projected row is within --max-hours/--max-cost
  2  bad input (a one-paragraph message on stderr)
"""
_EPILOG = (
    _EXIT_CODES
    + """
examples:
  resource-guard preflight examples/gpt_small.py:build --device t4 \\
      --batch-size 8 --precision 16-mixed
  resource-guard preflight --train-tokens 1000000000 --gpus 1,8
  resource-guard demo --steps 12 --log-dir runs/demo
  resource-guard report runs/demo
"""
)
_PREFLIGHT = """\
Estimate one training step of TARGET on fake tensors (no GPU, no
model-sized memory) and say whether it fits the device.

TARGET is path/to/file.py:factory or package.module:factory; the factory
returns (model, optimizer, batch) or (model, optimizer, batch, loss_fn) and
takes batch_size when --batch-size is given. With --train-tokens,
--train-samples or --epochs it also projects time and cost over devices and
GPU counts.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resource-guard",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser(
        "preflight",
        help="estimate one training step and say whether it fits a device",
        description=_PREFLIGHT,
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pre.add_argument(
        "target",
        nargs="?",
        default=DEFAULT_TARGET,
        help=f"path/to/file.py:factory or package.module:factory (default: {DEFAULT_TARGET})",
    )
    pre.add_argument("--batch-size", type=int, default=None, help="passed to the factory as batch_size")
    pre.add_argument(
        "--precision",
        default="32-true",
        help="32-true (default), 16-mixed, bf16-mixed, 16-true, bf16-true",
    )
    pre.add_argument(
        "--device", default="auto", help="a catalog name (a100-40gb), cpu, cuda[:N] or auto (default)"
    )
    pre.add_argument(
        "--headroom", type=float, default=0.1, help="fraction of memory to keep free (default 0.1)"
    )
    pre.add_argument("--catalog", default=None, help="a YAML device catalog merged over the bundled one")
    pre.add_argument("--json", action="store_true", help="print JSON instead of tables")
    pre.add_argument(
        "--strict", action="store_true", help="exit 1 also when it only fits tight (inside the headroom)"
    )
    gate = pre.add_argument_group("memory budget (CI): fail when the step's estimate grows")
    gate.add_argument(
        "--budget", default=None, metavar="FILE", help="compare with the budget in FILE; exit 1 on growth"
    )
    gate.add_argument(
        "--update-budget", action="store_true", help="write (or refresh) this step's budget in FILE"
    )
    gate.add_argument(
        "--budget-key",
        default=None,
        help="the budget's key (default: 'TARGET @ DEVICE, PRECISION, batch N')",
    )
    gate.add_argument(
        "--budget-tolerance",
        type=float,
        default=0.02,
        help="growth allowed, a fraction of the budget's peak (default 0.02)",
    )
    _add_projection_args(pre)
    dev = sub.add_parser(
        "devices",
        help="list the device catalog and the devices detected here",
        description="List the device catalog (memory, bf16, compute capability, peak TFLOP/s, memory "
        "bandwidth, on-demand price) and the devices detected on this machine.",
    )
    dev.add_argument("--catalog", default=None, help="a YAML device catalog merged over the bundled one")
    dev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    demo = sub.add_parser(
        "demo",
        help="train the embedded example model under guard and print the report",
        description="Train the bundled small GPT for a few steps on the CPU under guard, under a memory "
        "cap that forces micro-batches with accumulation; write TensorBoard events, report.md, "
        "report.json, guard.json and memory.png to --log-dir; print the plan and the report.",
    )
    demo.add_argument("--steps", type=int, default=12, help="optimizer steps (default 12)")
    demo.add_argument("--log-dir", default="runs/demo", help="TensorBoard events and report (runs/demo)")
    demo.add_argument(
        "--memory-limit", default="256MiB", help="plan as if the device had this much memory ('' for none)"
    )
    rep = sub.add_parser(
        "report",
        help="print the bottleneck report of a finished run",
        description="Print the bottleneck report of a finished run as tables: LOGDIR/report.json, or the "
        "newest report.json below LOGDIR (a Lightning version directory, a Trainer's output_dir). "
        "Exit 2 when there is none.",
    )
    rep.add_argument("logdir", help="the run's log dir (report.json in it or in a directory below it)")
    shown = rep.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print report.json instead of the tables")
    shown.add_argument("--markdown", action="store_true", help="print the report as Markdown (report.md)")
    cmp = sub.add_parser(
        "compare",
        help="compare two finished runs: step time, phases, memory, findings",
        description="What changed from RUN_A to RUN_B: step time, each phase (ms per step, the largest "
        "change first), peak memory and the estimate (MiB), and the findings that appeared or went. "
        "Each run is a report.json, a run's log dir, or a log dir with a report.json below it. "
        "With --max-step-regression, exit 1 when RUN_B's step time regressed beyond it (the speed gate "
        "for CI, beside preflight's memory budget). Exit 2 when either has no readable report.",
    )
    cmp.add_argument("run_a", help="the first run (the baseline)")
    cmp.add_argument("run_b", help="the second run")
    cmp.add_argument("--json", action="store_true", help="print the comparison as JSON")
    cmp.add_argument(
        "--max-step-regression",
        default=None,
        metavar="PCT",
        help="speed gate (CI): exit 1 when RUN_B's mean step time is more than PCT above RUN_A's "
        "(10%% or 0.1)",
    )
    return parser


def _compare(args: argparse.Namespace) -> int:
    from resource_guard.tensorboard_plugin.compare import (
        compare_reports,
        compare_text,
        load_report,
        parse_regression,
        step_gate,
    )

    limit = None
    if args.max_step_regression is not None:
        try:
            limit = parse_regression(args.max_step_regression)
        except ValueError as exc:
            raise _BadInput(f"--max-step-regression {exc}") from None
    a, b = load_report(args.run_a), load_report(args.run_b)
    if a is None or b is None:
        path = args.run_a if a is None else args.run_b
        raise _BadInput(f"no readable report.json in {path!r} (is it the log dir of a finished run?)")
    gate = None
    if limit is not None:
        try:
            gate = step_gate(a, b, limit)
        except ValueError as exc:
            raise _BadInput(f"--max-step-regression: {exc}") from None
    if args.json:
        data = compare_reports(a, b)
        if gate is not None:
            data["step_gate"] = {"passed": gate[0], "max_regression": limit, "message": gate[1]}
        print(json.dumps(data, indent=2))
    else:
        print(compare_text(a, b, args.run_a, args.run_b))
        if gate is not None:
            print(f"\nspeed gate: {'passed' if gate[0] else 'FAILED'}: {gate[1]}")
    return 0 if gate is None or gate[0] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``resource-guard``; returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its usage message
        return 2 if exc.code not in (0, None) else 0
    handler = {
        "preflight": _preflight,
        "devices": _devices,
        "report": _report,
        "demo": _demo,
        "compare": _compare,
    }[args.command]
    try:
        return handler(args)
    except (_BadInput, ResourceGuardError) as exc:
        print(f"resource-guard {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `resource-guard report DIR | head`: the reader has gone, nothing to say
        # Python flushes stdout again at exit: point it at devnull so that flush cannot fail too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
