"""``resource-guard``: pre-flight a training step from the command line, list devices, print run reports.

Exit codes: 0 fits, 1 does not fit, 2 bad input (a one-paragraph message, never a traceback).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from resource_guard.devices import format_bytes
from resource_guard.errors import DoesNotFitError, ResourceGuardError

__all__ = ["main", "load_target", "format_bytes"]

DEFAULT_TARGET = "resource_guard.demo:build"
_COMPARE = ("t4", "l4", "a10g", "rtx-4090", "a100-40gb", "a100-80gb", "h100-sxm")


class _BadInput(Exception):
    """Bad input on the command line: printed as one paragraph, exit 2."""


def _import_factory(target: str) -> Any:
    path, sep, attr = target.rpartition(":")
    if not sep or not path or not attr:
        raise _BadInput(f"TARGET {target!r} must be `path/to/file.py:factory` or `package.module:factory`.")
    if path.endswith(".py") or "/" in path or "\\" in path:
        file = Path(path)
        if not file.is_file():
            raise _BadInput(f"TARGET {target!r}: the file {str(file)!r} does not exist.")
        spec = importlib.util.spec_from_file_location(f"_resource_guard_target_{file.stem}", file)
        if spec is None or spec.loader is None:
            raise _BadInput(f"TARGET {target!r}: {str(file)!r} cannot be imported as a Python module.")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(file.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise _BadInput(
                f"TARGET {target!r}: importing {str(file)!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            raise _BadInput(f"TARGET {target!r}: cannot import module {path!r} ({exc}).") from exc
        except Exception as exc:
            raise _BadInput(
                f"TARGET {target!r}: importing {path!r} raised {type(exc).__name__}: {exc}"
            ) from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise _BadInput(
            f"TARGET {target!r}: {path!r} has no callable {attr!r}; callables there: {', '.join(names)}."
        )
    return factory


def load_target(target: str, batch_size: int | None = None) -> tuple[Any, Any, Any, Any]:
    """Call the factory named by ``target`` and return ``(model, optimizer, batch, loss_fn)``.

    The factory returns ``(model, optimizer, batch)`` or ``(model, optimizer, batch, loss_fn)``, or a
    mapping with those keys. With ``batch_size`` it must accept a ``batch_size`` argument.
    """
    factory = _import_factory(target)
    kwargs = {}
    if batch_size is not None:
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        accepts = "batch_size" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        if not accepts:
            raise _BadInput(f"--batch-size was given but {target!r} takes no `batch_size` argument.")
        kwargs["batch_size"] = batch_size
    try:
        built = factory(**kwargs)
    except Exception as exc:
        raise _BadInput(f"the factory {target!r} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(built, Mapping):
        try:
            return built["model"], built["optimizer"], built["batch"], built.get("loss_fn")
        except KeyError as exc:
            raise _BadInput(f"the factory {target!r} returned a mapping without key {exc}.") from exc
    if isinstance(built, Sequence) and not isinstance(built, (str, bytes)) and len(built) in (3, 4):
        model, optimizer, batch = built[:3]
        return model, optimizer, batch, built[3] if len(built) == 4 else None
    raise _BadInput(
        f"the factory {target!r} returned {type(built).__name__}; it must return (model, optimizer, batch) "
        "or (model, optimizer, batch, loss_fn)."
    )


def _fit_rows(estimate: Any, device: Any, headroom: float, catalog: Any) -> tuple[Any, list[Any]]:
    main = estimate.for_device(device, headroom=headroom, catalog=catalog)
    others = []
    if catalog is not None:
        for name in _COMPARE:
            if name in catalog and name != main.device.name:
                others.append(estimate.for_device(catalog.get(name), headroom=headroom))
    return main, others


def _print_report(target: str, estimate: Any, fit: Any, others: list[Any], headroom: float) -> None:
    out = print
    count = estimate.parameter_count / 1e6
    out(f"resource-guard preflight: {target}")
    out(
        f"  model {count:.1f}M parameters ({estimate.trainable_parameter_count / 1e6:.1f}M trainable), "
        f"batch {estimate.batch_size if estimate.batch_size is not None else '?'}, {estimate.precision}, "
        f"{estimate.trace_seconds:.1f} s"
    )
    out(f"  {estimate.method_line}")
    where = f"{estimate.peak_phase}, {estimate.peak_op}" if estimate.peak_phase else "analytic"
    out(f"\none training step, live tensor memory at the peak ({where}):")
    for name, value in estimate.breakdown.items():
        out(f"  {name:<18}{format_bytes(value):>14}")
    out(f"  {'peak':<18}{format_bytes(estimate.peak_bytes):>14}")
    dev = fit.device
    out(f"\non {dev.name} ({dev.kind}, {format_bytes(fit.capacity_bytes)}):")
    rows = [
        ("allocated peak (max_memory_allocated)", fit.allocated_peak_bytes),
        ("reserved peak (max_memory_reserved)", fit.reserved_peak_bytes),
        ("context + libraries", fit.context_bytes),
        ("device total (as nvidia-smi shows)", fit.device_total_bytes),
        (f"usable ({headroom:.0%} headroom kept free)", fit.usable_bytes),
    ]
    for label, value in rows:
        out(f"  {label:<40}{format_bytes(value):>14}")
    if fit.fits:
        out(f"  FITS, {format_bytes(fit.usable_bytes - fit.device_total_bytes)} to spare within the headroom")
    else:
        out(
            "  DOES NOT FIT: needs "
            f"{format_bytes(fit.device_total_bytes - fit.usable_bytes)} more than usable"
        )
    if others:
        yes = [f.device.name for f in others if f.fits]
        no = [f.device.name for f in others if not f.fits]
        out(f"\nother devices: fits on {', '.join(yes) or 'none'}; not on {', '.join(no) or 'none'}")
    for note in estimate.warnings:
        out(f"note: {note}")


def _preflight(args: argparse.Namespace) -> int:
    from resource_guard.devices import load_catalog, resolve_device
    from resource_guard.estimate import estimate_memory
    from resource_guard.step.precision import parse_precision

    if args.batch_size is not None and args.batch_size <= 0:
        raise _BadInput(f"--batch-size {args.batch_size} must be a positive integer.")
    if not 0 <= args.headroom < 0.9:
        raise _BadInput(f"--headroom {args.headroom} must be in [0, 0.9).")
    spec = parse_precision(args.precision)
    catalog = load_catalog(args.catalog)
    device = resolve_device(args.device, catalog)
    model, optimizer, batch, loss_fn = load_target(args.target, args.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = estimate_memory(model, optimizer, batch, loss_fn, precision=spec.name, device=device.kind)
    fit, others = _fit_rows(estimate, device, args.headroom, catalog)
    if args.json:
        payload = {
            "target": args.target,
            "estimate": estimate.to_dict(),
            "fit": fit.to_dict(),
            "other_devices": [f.to_dict() for f in others],
        }
        print(json.dumps(payload, indent=2))
    else:
        _print_report(args.target, estimate, fit, others, args.headroom)
    return 0 if fit.fits else 1


def _devices(args: argparse.Namespace) -> int:
    from resource_guard.devices import detect_local_devices, load_catalog

    catalog = load_catalog(args.catalog)
    local = detect_local_devices(catalog)
    if args.json:
        rows = [_spec_dict(catalog.get(n)) for n in catalog.names()]
        print(json.dumps({"catalog": rows, "detected": [_spec_dict(d) for d in local]}, indent=2))
        return 0
    print(
        f"{'name':<14}{'kind':<6}{'memory':>12}  {'bf16':<5}{'cc':<5}"
        f"{'bf16 TFLOP/s':>13}{'GB/s':>8}{'$/h':>7}"
    )
    for name in catalog.names():
        d = catalog.get(name)
        bf16 = d.peak_tflops.get("bf16")
        print(
            f"{d.name:<14}{d.kind:<6}{format_bytes(d.memory_bytes):>12}  {'yes' if d.bf16 else 'no':<5}"
            f"{d.compute_capability or '-':<5}{(f'{bf16:g}' if bf16 else '-'):>13}"
            f"{(f'{d.memory_bandwidth_gbps:g}' if d.memory_bandwidth_gbps else '-'):>8}"
            f"{(f'{d.price_per_hour_usd:.2f}' if d.price_per_hour_usd else '-'):>7}"
        )
    print("\ndetected on this machine:")
    for d in local:
        free = f", {format_bytes(d.free_bytes)} free" if d.free_bytes is not None else ""
        print(f"  {d.name:<10}{d.kind:<6}{format_bytes(d.memory_bytes)}{free}  {d.display_name}")
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

    return report_command(args.logdir, as_json=args.json)


def _demo(args: argparse.Namespace) -> int:
    from resource_guard.demo import run_demo

    if args.steps <= 0:
        raise _BadInput(f"--steps {args.steps} must be a positive integer.")
    try:
        g = run_demo(args.steps, log_dir=args.log_dir, memory_limit=args.memory_limit or None)
    except DoesNotFitError as exc:
        print(str(exc))
        return 1
    assert g.plan is not None
    print(g.plan.summary())
    print()
    print(g.report.to_markdown() if g.report is not None else "(monitoring was off: no report)")
    print(
        f"\nLogs: {args.log_dir}  (tensorboard --logdir {args.log_dir}; resource-guard report {args.log_dir})"
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resource-guard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preflight", help="estimate one training step and say whether it fits a device")
    pre.add_argument(
        "target",
        nargs="?",
        default=DEFAULT_TARGET,
        help=f"path/to/file.py:factory or package.module:factory (default: {DEFAULT_TARGET})",
    )
    pre.add_argument("--batch-size", type=int, default=None, help="passed to the factory as batch_size")
    pre.add_argument(
        "--precision", default="32-true", help="32-true, 16-mixed, bf16-mixed, 16-true, bf16-true"
    )
    pre.add_argument("--device", default="auto", help="a catalog name (a100-40gb), cpu, cuda[:N] or auto")
    pre.add_argument(
        "--headroom", type=float, default=0.1, help="fraction of memory to keep free (default 0.1)"
    )
    pre.add_argument("--catalog", default=None, help="a YAML device catalog merged over the bundled one")
    pre.add_argument("--json", action="store_true", help="print JSON instead of tables")
    dev = sub.add_parser("devices", help="list the device catalog and the devices detected here")
    dev.add_argument("--catalog", default=None, help="a YAML device catalog merged over the bundled one")
    dev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    demo = sub.add_parser("demo", help="train the embedded example model under guard and print the report")
    demo.add_argument("--steps", type=int, default=12, help="optimizer steps (default 12)")
    demo.add_argument("--log-dir", default="runs/demo", help="TensorBoard events and report (runs/demo)")
    demo.add_argument(
        "--memory-limit", default="256MiB", help="plan as if the device had this much memory ('' for none)"
    )
    rep = sub.add_parser("report", help="print the bottleneck report of a finished run")
    rep.add_argument("logdir", help="the run's log dir (report.json in it or in a directory below it)")
    rep.add_argument("--json", action="store_true", help="print report.json instead of markdown")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``resource-guard``; returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its usage message
        return 2 if exc.code not in (0, None) else 0
    handler = {"preflight": _preflight, "devices": _devices, "report": _report, "demo": _demo}[args.command]
    try:
        return handler(args)
    except (_BadInput, ResourceGuardError) as exc:
        print(f"resource-guard {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
