"""The amount of training and the result of :func:`~resource_guard.planning.projection.project_training`.

Example:
    >>> row = ProjectionRow(device="t4", gpus=2, nodes=1, fits=False, reason="needs 20 GiB")
    >>> row.to_dict()["reason"]
    'needs 20 GiB'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from resource_guard.devices import DeviceSpec
from resource_guard.errors import ConfigurationError
from resource_guard.planning.steptime import Calibration, Interconnect, StepFlops, StepTime, tokens_per_sample

__all__ = [
    "Projection",
    "ProjectionRow",
    "checkpointing_on",
    "remaining_markdown",
    "remaining_run",
    "training_samples",
]


@dataclass(frozen=True)
class ProjectionRow:
    """One device × GPU count: the plan, the step time, hours and cost (``None``: unknown / no fit)."""

    device: str
    gpus: int
    nodes: int
    fits: bool
    plan: dict[str, Any] | None = None
    step_s: float | None = None
    hours: float | None = None
    usd_per_hour: float | None = None
    cost_usd: float | None = None
    calibrated: bool = False
    recommended: tuple[str, ...] = ()
    reason: str = ""
    bound: str | None = None
    efficiency: float | None = None
    time: StepTime | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        t = self.time
        return {
            "device": self.device,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "fits": self.fits,
            "plan": self.plan,
            "step_s": self.step_s,
            "hours": self.hours,
            "usd_per_hour": self.usd_per_hour,
            "cost_usd": self.cost_usd,
            "calibrated": self.calibrated,
            "recommended": list(self.recommended),
            "reason": self.reason,
            "bound": self.bound,
            "efficiency": self.efficiency,
            "flops_per_step": None if t is None else t.flops,
            "compute_s": None if t is None else t.compute_s,
            "memory_s": None if t is None else t.memory_s,
            "comm_s": None if t is None else t.comm_s,
        }


@dataclass(frozen=True)
class Projection:
    """The rows, sorted by cost (fitting rows with a price first, then by hours; non-fitting last).

    ``step_model``: ``"per-operator"`` where GPU rows were timed by the per-operator model
    (:mod:`resource_guard.planning.gpu_time`), else ``"whole-step"`` (``efficiency`` of the peak).
    """

    rows: tuple[ProjectionRow, ...]
    train_samples: int
    target_batch_size: int
    optimizer_steps: int
    tokens_per_sample: int | None
    flops: StepFlops
    efficiency: float
    calibration: Calibration | None
    interconnect: Interconnect
    plan_calls: int
    seconds: float
    step_model: str = "whole-step"

    def recommended(self, label: str) -> ProjectionRow | None:
        """The row marked ``label`` (``"cheapest"`` or ``"fastest"``), or None."""
        return next((r for r in self.rows if label in r.recommended), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "train_samples": self.train_samples,
            "target_batch_size": self.target_batch_size,
            "optimizer_steps": self.optimizer_steps,
            "tokens_per_sample": self.tokens_per_sample,
            "flops_per_sample": self.flops.forward_per_sample + self.flops.backward_per_sample,
            "efficiency": self.efficiency,
            "step_model": self.step_model,
            "calibration": None if self.calibration is None else vars(self.calibration),
            "interconnect": vars(self.interconnect),
            "plan_calls": self.plan_calls,
            "seconds": self.seconds,
            "projection": [r.to_dict() for r in self.rows],
        }

    def table(self) -> str:
        """A markdown table of the rows."""
        head = "| device | GPUs | plan | step | hours | $/h/GPU | cost | bound | |"
        lines = [head, "|---|---:|---|---:|---:|---:|---:|---|---|"]
        for r in self.rows:
            mark = " ".join(f"**{m}**" for m in r.recommended) + (" (calibrated)" if r.calibrated else "")
            if not r.fits:
                lines.append(f"| {r.device} | {_gpus(r)} | does not fit: {r.reason} | | | | | | |")
                continue
            lines.append(
                f"| {r.device} | {_gpus(r)} | {_plan_text(r.plan)} | {_num(r.step_s, 's')} | {_num(r.hours)} "
                f"| {_num(r.usd_per_hour, '', '$')} | {_num(r.cost_usd, '', '$')} | {r.bound} | {mark} |"
            )
        return "\n".join(lines)


def _gpus(r: ProjectionRow) -> str:
    return f"{r.nodes}×{r.gpus // r.nodes}" if r.nodes > 1 else str(r.gpus)


def _num(value: float | None, unit: str = "", prefix: str = "") -> str:
    if value is None:
        return "-"
    text = f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
    return f"{prefix}{text}{unit}"


def _plan_text(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    ckpt = p.get("checkpointing")
    ckpt = (
        ""
        if not ckpt or str(ckpt).lower() in ("none", "off")
        else " +ckpt"
        if ckpt is True
        else f" +ckpt:{ckpt}"
    )
    return f"{p['micro_batch_size']}×{p['accumulation_steps']} {p['precision']} {p['strategy']}{ckpt}"


def checkpointing_on(value: Any) -> bool:
    """Whether a plan's ``checkpointing`` (a flag, or a mode name such as ``"selective"``) recomputes."""
    return bool(value) and str(value).lower() not in ("none", "off", "false")


def remaining_run(
    device: DeviceSpec | None, *, step_s: float, steps_done: int, total_steps: int, gpus: int = 1
) -> dict[str, Any]:
    """ETA and cost of a run's remaining optimizer steps at its measured step time and catalog price.

    >>> remaining_run(None, step_s=2.0, steps_done=10, total_steps=1810)["eta_hours"]
    1.0
    """
    left = max(total_steps - steps_done, 0)
    hours = left * step_s / 3600
    price = None if device is None else device.price_per_hour_usd
    return {
        "device": None if device is None else device.name,
        "remaining_steps": left,
        "step_s": step_s,
        "eta_hours": hours,
        "usd_per_hour": price,
        "cost_usd": None if price is None else hours * price * gpus,
    }


def remaining_markdown(left: dict[str, Any]) -> str:
    """One markdown line for :func:`remaining_run`'s result.

    >>> remaining_markdown(remaining_run(None, step_s=2.0, steps_done=10, total_steps=1810))
    '**Projection**: 1,800 steps left at 2 s/step: ETA 1.00 h; cost unknown (no catalog price)'
    """
    price = left.get("usd_per_hour")
    cost = (
        f"cost ${left['cost_usd']:,.2f} at ${price:g}/h per device ({left['device']})"
        if price is not None and left.get("cost_usd") is not None
        else "cost unknown (no catalog price)"
    )
    return (
        f"**Projection**: {left['remaining_steps']:,} steps left at {left['step_s']:.3g} s/step: "
        f"ETA {left['eta_hours']:.2f} h; {cost}"
    )


def training_samples(
    batch: Any,
    *,
    train_samples: int | None = None,
    train_tokens: int | None = None,
    epochs: float | None = None,
    dataset_size: int | None = None,
) -> int:
    """The number of training samples from exactly one of samples, tokens, or epochs × dataset size."""
    given = [
        train_samples is not None,
        train_tokens is not None,
        epochs is not None or dataset_size is not None,
    ]
    if sum(given) != 1:
        raise ConfigurationError(
            "give exactly one of `train_samples`, `train_tokens`, or `epochs` with `dataset_size` "
            f"(got train_samples={train_samples!r}, train_tokens={train_tokens!r}, epochs={epochs!r}, "
            f"dataset_size={dataset_size!r})"
        )
    for name, value in (
        ("train_samples", train_samples),
        ("train_tokens", train_tokens),
        ("dataset_size", dataset_size),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigurationError(f"`{name}={value!r}` must be an int >= 1")
    if train_samples is not None:
        return train_samples
    if train_tokens is not None:
        per_sample = tokens_per_sample(batch)
        if per_sample is None:
            raise ConfigurationError(
                f"`train_tokens={train_tokens}`: the batch has no 2-D integer tensor of token ids to tell "
                "the tokens per sample; give `train_samples` instead"
            )
        return math.ceil(train_tokens / per_sample)
    if epochs is None or dataset_size is None:
        raise ConfigurationError("`epochs` and `dataset_size` go together: give both")
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
        raise ConfigurationError(f"`epochs={epochs!r}` must be a number > 0")
    return math.ceil(epochs * dataset_size)
