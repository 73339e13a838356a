"""What the planner says: the reasons of a plan, and the report when nothing fits (:class:`NoFitReport`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resource_guard.devices import Catalog, DeviceSpec
from resource_guard.errors import DoesNotFitError
from resource_guard.planning.search import CHECKPOINT_COST, Alternative, Candidate, Tracer, render_table
from resource_guard.planning.strategy import gpus_needed
from resource_guard.step.batching import divisors

__all__ = ["NoFitReport", "batch_reasons", "no_fit_error"]

_MiB = 2**20


@dataclass(frozen=True)
class NoFitReport:
    """Why nothing fits and what would (the ``report`` of :class:`DoesNotFitError`)."""

    device: str
    capacity_bytes: int
    usable_bytes: int
    needed_bytes: int
    smallest_config: str
    alternatives: tuple[Alternative, ...]
    fitting_devices: tuple[str, ...]
    gpus_needed: int | None
    suggestions: tuple[str, ...]
    traces: int

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["alternatives"] = [dict(a.__dict__, config=a.config()) for a in self.alternatives]
        out["fitting_devices"], out["suggestions"] = list(self.fitting_devices), list(self.suggestions)
        return out

    def summary(self) -> str:
        head = (
            f"Nothing fits {self.device}: the smallest configuration ({self.smallest_config}) needs "
            f"{self.needed_bytes / _MiB:,.1f} MiB, {self.usable_bytes / _MiB:,.1f} MiB usable "
            f"(capacity {self.capacity_bytes / _MiB:,.1f} MiB)."
        )
        return "\n".join([head, *(f"- {s}" for s in self.suggestions), "", render_table(self.alternatives)])


def batch_reasons(
    best: Candidate,
    found: list[Candidate],
    per_rank: int,
    target: int,
    world: int,
    tracer: Tracer,
) -> list[str]:
    """One line per decision about the batch, checkpointing and strategy of the chosen candidate."""
    out = []
    usable = best.fit.usable_bytes
    if best.micro == per_rank:
        out.append(f"the full per-rank batch of {per_rank} fits: no accumulation")
    else:
        over = tracer.smallest_failing(best.ckpt, best.strategy, best.micro)
        more = f"; {over[0]} needs {over[1] / _MiB:,.1f} MiB" if over else ""
        out.append(
            f"micro-batch {best.micro} × {per_rank // best.micro} accumulation steps: the largest divisor of "
            f"{per_rank} that fits {usable / _MiB:,.1f} MiB usable{more}"
        )
        reach = tracer.interpolated_limit(best.ckpt, best.strategy, best.micro)
        if reach is not None and reach >= 1.25 * best.micro:
            divs = divisors(per_rank)
            why = (
                f"{per_rank} is prime: its only divisors are 1 and {per_rank}"
                if len(divs) == 2
                else f"no divisor of {per_rank} lies between {best.micro} and {reach}"
            )
            out.append(
                f"compromise: about {reach} samples per micro-batch would fit, but micro × accumulation × "
                f"world_size must equal {target} exactly and {why}"
            )
    plain = [c for c in found if not c.ckpt and c.strategy == best.strategy]
    if best.ckpt:
        if plain:
            out.append(
                f"activation checkpointing on ({len(tracer.blocks)} modules): micro-batch {best.micro} "
                f"instead of {plain[0].micro} without it outweighs its ≈{CHECKPOINT_COST - 1:.0%} "
                "extra compute"
            )
        else:
            out.append(f"activation checkpointing on ({len(tracer.blocks)} modules): nothing fits without it")
    elif tracer.blocks:
        out.append(
            "activation checkpointing off: "
            + ("not needed" if best.micro == per_rank else "not worth its cost")
        )
    if world > 1:
        other = max((c for c in found if c.strategy != best.strategy), key=lambda c: c.micro, default=None)
        alt = ""
        if other is not None and other.micro > best.micro:
            alt = f"; {other.strategy} would allow micro-batch {other.micro} but costs more"
        elif other is not None:
            alt = f"; {other.strategy} fits too but is slower (FSDP all-gathers parameters in every pass)"
        out.append(
            f"strategy {best.strategy} over {world} ranks "
            f"({best.fit.device_total_bytes / _MiB:,.1f} MiB per rank){alt}"
        )
    return out


def no_fit_error(
    tracer: Tracer,
    spec: DeviceSpec,
    catalog: Catalog,
    headroom: float,
    rows: tuple[Alternative, ...],
    units: tuple[int, ...],
) -> DoesNotFitError:
    """The "does not fit" error: the smallest configuration tried, and what would make it fit."""
    smallest = min(tracer.smallest_points(), key=lambda p: p.fit.device_total_bytes)
    est, fit = smallest.estimate, smallest.fit
    fitting = tuple(
        d.name for d in sorted(catalog.values(), key=lambda d: d.memory_bytes)
        if d.kind != "cpu" and est.for_device(d, headroom=headroom).fits
    )  # fmt: skip
    count = gpus_needed(est, spec, units=units, headroom=headroom) if spec.kind != "cpu" else None
    config = (
        f"micro-batch {smallest.micro} {tracer.precision}{' with checkpointing' if smallest.ckpt else ''}"
    )
    tips = []
    if fitting:
        tips.append(f"at {config} it would fit on: {', '.join(fitting)}")
    if count is not None and count.count > 1:
        tips.append(
            f"FSDP full-shard over {count.count} × {spec.name} "
            f"({count.per_rank_bytes / _MiB:,.1f} MiB per rank)"
        )
    if tracer.blocks and not any(c.ckpt for c in tracer.evaluated.values()):
        tips.append("activation checkpointing was not allowed; checkpointing='auto' may help")
    if tracer.precision in ("32-true", "16-mixed", "bf16-mixed"):
        tips.append("bf16-true halves parameter, gradient and optimizer-state bytes")
    report = NoFitReport(
        device=spec.name,
        capacity_bytes=fit.capacity_bytes,
        usable_bytes=fit.usable_bytes,
        needed_bytes=fit.device_total_bytes,
        smallest_config=config,
        alternatives=rows,
        fitting_devices=fitting,
        gpus_needed=count.count if count is not None else None,
        suggestions=tuple(tips),
        traces=tracer.count,
    )
    return DoesNotFitError(report.summary(), report)
