"""Console rendering for people at a terminal: the run report, a plan, a plan that does not fit, the
pre-flight result and the device table, as aligned tables with colour.

Files and TensorBoard keep Markdown (:mod:`resource_guard.report.markdown`); this module is what the
``resource-guard`` commands and the front doors' end-of-run summary print. It uses ``rich`` (imported
only when something is printed). Colour and styles are used only when the stream is a terminal;
``NO_COLOR`` (https://no-color.org) turns colour off there too, and ``FORCE_COLOR`` is rich's own
override. On a pipe or a file the output is plain text: no ANSI codes, no Markdown syntax, tables
aligned with spaces, at the width of ``COLUMNS`` or :data:`PIPE_WIDTH`.

Example:
    >>> import io
    >>> from resource_guard.report.findings import RunStats, analyze
    >>> out = io.StringIO()
    >>> render_report(analyze(RunStats(steps=3, data_wait_share=0.5)), make_console(out))
    >>> "verdict input-bound" in out.getvalue() and "**" not in out.getvalue()
    True
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from resource_guard.devices import format_bytes
from resource_guard.report.breakdown import PHASE_LABELS, PHASE_LETTERS, phase_line, phase_rows, stacked_bar
from resource_guard.report.markdown import Rendered, format_value, memory_note, summary_rows

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from resource_guard.planning.nofit import NoFitReport
    from resource_guard.planning.planner import Plan
    from resource_guard.planning.search import Alternative
    from resource_guard.report.types import RunStats

__all__ = [
    "PIPE_WIDTH",
    "SEVERITY_STYLES",
    "make_console",
    "render_devices",
    "render_nofit",
    "render_plan",
    "render_preflight",
    "render_report",
    "render_summary",
]


class Report(Rendered, Protocol):
    """What this module reads of a :class:`~resource_guard.Report` (no import: findings imports us)."""

    def summary_line(self) -> str: ...


PIPE_WIDTH = 120  # columns when the output is not a terminal (and COLUMNS is unset)
SEVERITY_STYLES = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
_MiB = 2**20


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def make_console(
    file: TextIO | None = None, *, stderr: bool = False, force_terminal: bool | None = None
) -> Console:
    """A rich ``Console`` on ``file`` (default stdout, or stderr): styled only on a terminal.

    ``force_terminal`` overrides the terminal check (tests; ``FORCE_COLOR`` does the same from the
    environment). ``NO_COLOR`` set to anything non-empty removes colour (bold and dim stay).
    """
    from rich.console import Console

    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    terminal = _is_terminal(stream) if force_terminal is None else force_terminal
    if force_terminal is None and os.environ.get("FORCE_COLOR"):
        terminal = True
    no_color = bool(os.environ.get("NO_COLOR"))
    width = None
    if not terminal:
        try:
            width = int(os.environ.get("COLUMNS", "")) or PIPE_WIDTH
        except ValueError:
            width = PIPE_WIDTH
    return Console(
        file=stream,
        force_terminal=terminal,
        no_color=no_color,
        color_system=("auto" if terminal else None),
        width=width,
        markup=False,
        highlight=False,
        emoji=False,
        soft_wrap=not terminal,
    )


def _print(console: Console, *objects: Any) -> None:
    """``console.print``; off a terminal without the trailing spaces rich pads table cells with."""
    if console.is_terminal:
        console.print(*objects)
        return
    with console.capture() as captured:
        console.print(*objects)
    console.file.write("\n".join(line.rstrip() for line in captured.get().split("\n")))


def _table(*columns: str, right: Iterable[int] = (), title: str | None = None) -> Table:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False, show_edge=False)
    aligned = set(right)
    for i, name in enumerate(columns):
        table.add_column(name, justify="right" if i in aligned else "left", no_wrap=i in aligned)
    return table


def _text(*parts: tuple[str, str] | str) -> Any:
    """A line of (text, style) parts."""
    from rich.text import Text

    return Text.assemble(*parts)


# -- the run report ---------------------------------------------------------------------------------
def render_report(report: Report, console: Console | None = None) -> None:
    """The report: verdict, the measured summary, the findings with evidence and advice, the profiler
    window and the notes."""
    console = console or make_console()
    s = report.stats
    style = SEVERITY_STYLES.get(report.findings[0].severity, "") if report.findings else "green"
    _print(
        console,
        _text(
            ("resource_guard report", "bold"),
            ": verdict ",
            (report.verdict, style or "bold"),
            f" ({s.steps} steps on {s.device})",
        ),
    )
    table = _table("metric", "value", right=(1,))
    for name, value in summary_rows(s):
        if value != "-":  # unknown on this run: left out here, kept in report.md/report.json
            table.add_row(name, value)
    _print(console, table)
    _render_breakdown(console, s)
    for f in report.findings:
        _print(console)
        _print(
            console,
            _text(
                (f"{f.severity.upper():<8}", SEVERITY_STYLES.get(f.severity, "")),
                " ",
                (f.id, "bold"),
                f"  {f.title}",
            ),
        )
        if f.evidence:
            ev = ", ".join(f"{k}={format_value(v)}" for k, v in f.evidence.items() if v is not None)
            _print(console, _text(("  evidence: ", "dim"), ev))
        for advice in f.advice:
            _print(console, f"  - {advice}")
    if s.profile is not None:
        p = s.profile
        _print(console)
        _print(
            console,
            _text(("Profiler window", "bold"), f": {p.steps} steps recorded; trace {p.trace_path or '-'}"),
        )
        if p.top_ops:
            ops = _table("op", "calls/step", "self CPU us/step", right=(1, 2))
            for name, calls, us in p.top_ops:
                ops.add_row(name, str(calls), f"{us:.1f}")
            _print(console, ops)
    note = memory_note(s)
    for n in (*s.notes, *([note] if note else [])):
        _print(console, _text(("note: ", "dim"), n))


def _render_breakdown(console: Console, s: RunStats) -> None:
    rows = phase_rows(s)
    if not rows:
        return
    table = _table("phase", "ms/step", "share", right=(1, 2), title="Where the time goes")
    for phase, seconds, share in rows:
        table.add_row(PHASE_LABELS[phase], f"{seconds * 1e3:.2f}", f"{share:.1%}")
    _print(console, table)
    legend = ", ".join(f"{PHASE_LETTERS[p]} {PHASE_LABELS[p]}" for p, _, _ in rows)
    _print(console, _text(f"  |{stacked_bar(s)}|  ", (legend, "dim")))


def render_summary(report: Report, console: Console | None = None) -> None:
    """The end-of-run summary of the front doors: one line, the step's breakdown by phase, then each
    finding that is not healthy."""
    console = console or make_console(stderr=True)
    _print(console, report.summary_line())
    line = phase_line(report.stats)
    if line:
        _print(console, _text("  ", (line, "dim")))
    for f in report.findings:
        if f.id != "healthy":
            _print(
                console, _text("  ", (f.severity, SEVERITY_STYLES.get(f.severity, "")), f" {f.id}: {f.title}")
            )


# -- plans ------------------------------------------------------------------------------------------
def _alternatives(rows: Sequence[Alternative]) -> Table:
    table = _table("config (micro×accum)", "predicted peak", "fits", "relative cost", right=(1, 3))
    for r in rows:
        style = "bold" if r.chosen else ("dim" if not r.fits else "")
        fits = _text(("yes", "green") if r.fits else ("no", "red"))
        table.add_row(
            r.config() + (" (chosen)" if r.chosen else ""),
            f"{r.predicted_peak_bytes / _MiB:,.1f} MiB",
            fits,
            f"{r.relative_cost:.2f}",
            style=style,
        )
    return table


def render_plan(plan: Plan, console: Console | None = None) -> None:
    """The plan: the decision, its reasons, the alternatives it beat."""
    console = console or make_console()
    f = plan.fit
    _print(
        console,
        _text(
            ("Plan", "bold"),
            f": {plan.micro_batch_size} × {plan.accumulation_steps} accumulation × {plan.world_size} "
            f"({plan.strategy}) = {plan.target_batch_size} on {plan.device.name}, {plan.precision}, "
            f"checkpointing {'on' if plan.checkpointing else 'off'}",
        ),
    )
    _print(
        console,
        f"  predicted {f.device_total_bytes / _MiB:,.1f} of {f.usable_bytes / _MiB:,.1f} MiB usable "
        f"({plan.traces} traces)",
    )
    for reason in plan.reasons:
        _print(console, f"  - {reason}")
    if plan.alternatives:
        _print(console, _alternatives(plan.alternatives))


def render_nofit(report: NoFitReport, console: Console | None = None) -> None:
    """Why nothing fits (a :class:`DoesNotFitError`'s report): needed vs usable, what would help."""
    console = console or make_console()
    _print(
        console,
        _text(
            ("DOES NOT FIT", "bold red"),
            f" {report.device}: the smallest configuration ({report.smallest_config}) needs "
            f"{report.needed_bytes / _MiB:,.1f} MiB, {report.usable_bytes / _MiB:,.1f} MiB usable "
            f"(capacity {report.capacity_bytes / _MiB:,.1f} MiB)",
        ),
    )
    for s in report.suggestions:
        _print(console, f"  - {s}")
    if report.alternatives:
        _print(console, _alternatives(report.alternatives))


# -- pre-flight and devices ----------------------------------------------------------------------------
def _fits_text(fits: bool) -> Any:
    return _text(("fits", "green") if fits else ("does not fit", "bold red"))


def _indented(table: Table) -> Any:
    from rich.padding import Padding

    return Padding(table, (0, 0, 0, 2), expand=False)


def render_preflight(
    target: str,
    estimate: Any,
    fit: Any,
    others: Sequence[Any],
    headroom: float,
    console: Console | None = None,
) -> None:
    """``resource-guard preflight``: the estimate's breakdown, the device's view, the other devices."""
    console = console or make_console()
    count, trainable = estimate.parameter_count / 1e6, estimate.trainable_parameter_count / 1e6
    batch = estimate.batch_size if estimate.batch_size is not None else "?"
    _print(console, _text(("resource-guard preflight", "bold"), f": {target}"))
    _print(
        console,
        f"  model {count:.1f}M parameters ({trainable:.1f}M trainable), batch {batch}, "
        f"{estimate.precision}, {estimate.trace_seconds:.1f} s",
    )
    _print(console, f"  {estimate.method_line}")
    if getattr(estimate, "assumed_target", ""):
        _print(console, f"  {estimate.assumed_target}")
    where = f"{estimate.peak_phase}, {estimate.peak_op}" if estimate.peak_phase else "analytic"
    _print(console)
    _print(console, _text(("one training step, live tensor memory at the peak", "bold"), f" ({where}):"))
    breakdown = _table("category", "bytes", right=(1,))
    for name, value in estimate.breakdown.items():
        breakdown.add_row(name, format_bytes(value))
    breakdown.add_row("peak", format_bytes(estimate.peak_bytes), style="bold")
    _print(console, _indented(breakdown))
    dev = fit.device
    _print(console)
    _print(console, _text((f"on {dev.name}", "bold"), f" ({dev.kind}, {format_bytes(fit.capacity_bytes)}):"))
    view = _table("what the device would show", "bytes", right=(1,))
    for label, value in (
        ("allocated peak (max_memory_allocated)", fit.allocated_peak_bytes),
        ("reserved peak (max_memory_reserved)", fit.reserved_peak_bytes),
        ("context + libraries", fit.context_bytes),
        ("device total (as nvidia-smi shows)", fit.device_total_bytes),
        (f"usable ({headroom:.0%} headroom kept free)", fit.usable_bytes),
    ):
        view.add_row(label, format_bytes(value))
    _print(console, _indented(view))
    if fit.fits:
        spare = format_bytes(fit.usable_bytes - fit.device_total_bytes)
        _print(console, _text("  ", ("FITS", "bold green"), f", {spare} to spare within the headroom"))
    elif getattr(fit, "verdict", None) == "fits tight":  # inside the headroom, within capacity
        into = format_bytes(fit.device_total_bytes - fit.usable_bytes)
        below = format_bytes(fit.capacity_bytes - fit.device_total_bytes)
        _print(
            console,
            _text("  ", ("FITS TIGHT", "bold yellow"), f": {into} into the headroom, {below} below capacity"),
        )
    else:
        more = format_bytes(fit.device_total_bytes - fit.usable_bytes)
        _print(console, _text("  ", ("DOES NOT FIT", "bold red"), f": needs {more} more than usable"))
    if others:
        _print(console)
        _print(console, _text(("other devices", "bold"), f" ({headroom:.0%} headroom):"))
        table = _table("device", "memory", "device total", "usable", "verdict", right=(1, 2, 3))
        for o in others:
            table.add_row(
                o.device.name,
                format_bytes(o.capacity_bytes),
                format_bytes(o.device_total_bytes),
                format_bytes(o.usable_bytes),
                _fits_text(o.fits),
            )
        _print(console, _indented(table))
    for note in estimate.warnings:
        _print(console, _text(("note: ", "dim"), note))


def render_devices(catalog: Any, local: Sequence[Any], console: Console | None = None) -> None:
    """``resource-guard devices``: the catalog, then what this machine has."""
    console = console or make_console()
    columns = ("name", "kind", "memory", "bf16", "cc", "bf16 TFLOP/s", "GB/s", "$/h")
    table = _table(*columns, right=(2, 5, 6, 7))
    for name in catalog.names():
        d = catalog.get(name)
        bf16 = d.peak_tflops.get("bf16")
        table.add_row(
            d.name,
            d.kind,
            format_bytes(d.memory_bytes),
            "yes" if d.bf16 else "no",
            d.compute_capability or "-",
            f"{bf16:g}" if bf16 else "-",
            f"{d.memory_bandwidth_gbps:g}" if d.memory_bandwidth_gbps else "-",
            f"{d.price_per_hour_usd:.2f}" if d.price_per_hour_usd else "-",
        )
    _print(console, _text(("device catalog", "bold"), ":"))
    _print(console, _indented(table))
    here = _table("name", "kind", "memory", "free", "description", right=(2, 3))
    for d in local:
        here.add_row(
            d.name, d.kind, format_bytes(d.memory_bytes), format_bytes(d.free_bytes), d.display_name or ""
        )
    _print(console)
    _print(console, _text(("detected on this machine", "bold"), ":"))
    _print(console, _indented(here))
