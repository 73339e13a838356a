"""Run-time pieces of the Hugging Face ``Trainer`` door (:mod:`~resource_guard.frontdoors.hf.trainer`): the
model's forward pre-hook object, accelerate's autocast wrapper taken off for a trace (the one private seam),
the agreement across ranks, the Trainer's TensorBoard run, and the messages of a step that does not fit.

Example:
    >>> mib(3 * 2**20)
    '3.0 MiB'
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from resource_guard.errors import (
    DoesNotFitError,
    PredictedOutOfMemoryError,
    warn_at_user,
)
from resource_guard.frontdoors.hf import step as hf_step

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = [
    "ModelHook",
    "agree",
    "build_monitor",
    "checkpointed",
    "default_collator",
    "kept_message",
    "mib",
    "tensorboard_run_dir",
    "tensorboard_writer",
    "too_big_message",
    "without_accelerate_autocast",
    "world",
]


class ModelHook:
    """A forward (pre-)hook: shared, not copied, by ``copy.deepcopy(model)`` (the estimates copy the model;
    a copied hook would copy the callback and all it holds). It ignores every module but the watched one."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __call__(self, module: nn.Module, *args: Any) -> None:
        self.fn(module, *args)

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelHook:
        return self


def without_accelerate_autocast(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """``model`` without the autocast wrapper accelerate puts on its ``forward`` under mixed precision,
    while the estimate traces it (the estimate emulates the target's autocast itself).

    The one private seam of this front door: accelerate's ``prepare_model`` keeps the original as
    ``model._original_forward`` and sets ``model.forward`` on the instance; the wrapper is taken off the
    instance for the trace and put back. ``tests/frontdoors/test_hf_trainer.py`` fails if that moves.
    """
    return _Unwrapped(model)


class _Unwrapped(contextlib.AbstractContextManager[None]):
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.saved: Any = None

    def __enter__(self) -> None:
        own = vars(self.model)
        if "forward" in own and hasattr(self.model, "_original_forward"):
            self.saved = own.pop("forward")

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            vars(self.model)["forward"] = self.saved
            self.saved = None


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def kept_message(acc: int, kept: Any, device: str) -> str:
    return (
        f"the Trainer's step does not fit: with gradient_accumulation_steps={acc}, micro-steps 2..{acc} "
        f"start with the gradients allocated and need {mib(kept.device_total_bytes)}, more than the "
        f"{mib(kept.usable_bytes)} usable on {device}. Stopped before step 0. Lower "
        "per_device_train_batch_size (raising gradient_accumulation_steps for the same effective batch), "
        "or let `plan_training_args(...)` choose."
    )


def too_big_message(rows: int, acc: int, precision: str, made: Plan) -> str:
    return (
        f"the Trainer's step does not fit: per_device_train_batch_size={rows} needs more than the "
        f"{mib(made.fit.usable_bytes)} usable on {made.device.name}; the largest per-device batch that "
        f"fits is {made.micro_batch_size} ({precision}, {mib(made.fit.device_total_bytes)}). Stopped "
        f"before step 0. Set per_device_train_batch_size={made.micro_batch_size} and "
        f"gradient_accumulation_steps={made.accumulation_steps * acc} for the same effective batch, or let "
        "`plan_training_args(...)` choose.\n\n" + made.summary()
    )


def checkpointed(model: nn.Module) -> bool:
    """Whether the model's own gradient checkpointing is on (``is_activation_checkpointing``, formerly
    ``is_gradient_checkpointing``)."""
    base = hf_step.base_model_of(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def default_collator() -> Any:
    from transformers import default_data_collator

    return default_data_collator


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree(error: BaseException | None, shapes_on: bool) -> tuple[BaseException | None, bool]:
    """One collective after every rank's pre-flight: this rank's error, or, when another rank failed,
    an error of the same kind saying so; and whether the shape guard stays on (on every rank, or on
    none: a rank must not wait in a per-batch agreement alone).

    Each rank sends 0 (its pre-flight failed), 1 (its batch is predicted to run out of memory:
    ``auto_find_batch_size`` is to lower it on every rank alike), 2 (fits, no shape guard) or 3; the
    smallest value decides.
    """
    if world() <= 1:
        return error, shapes_on
    from resource_guard.frontdoors.shape_guard import agree_min

    too_big = isinstance(error, PredictedOutOfMemoryError)
    mine = 2 + int(shapes_on) if error is None else int(too_big)
    agreed = agree_min(mine)
    if agreed >= 2:
        return None, agreed == 3
    if error is not None and agreed == mine:
        return error, False
    if agreed == 1:
        return PredictedOutOfMemoryError(
            "another rank's per-device batch is predicted to run out of memory. Every rank lowers the batch "
            "(auto_find_batch_size) before step 0."
        ), False
    return DoesNotFitError(
        "the Trainer's step does not fit on another rank; every rank stops before step 0 (that rank's "
        "error has the report).",
        None,
    ), False


def per_device_rows(args: Any, state: Any) -> int:
    """The per-device batch of this attempt: the Trainer's own (``state.train_batch_size``, which
    ``auto_find_batch_size`` lowers on each retry while ``args.per_device_train_batch_size`` stays), per
    GPU under ``DataParallel``."""
    total = getattr(state, "train_batch_size", None) or args.train_batch_size
    return max(1, int(total) // max(1, int(getattr(args, "n_gpu", 1) or 1)))


def predicted_oom_message(rows: int, made: Plan) -> str:
    """For :class:`~resource_guard.errors.PredictedOutOfMemoryError`: accelerate's loop reads its
    " out of memory." words (and lowers the batch); the user reads the figures."""
    full = next(
        (a for a in made.alternatives if a.micro_batch_size == rows and a.accumulation_steps == 1), None
    )
    needs = f"needs {mib(full.predicted_peak_bytes)}, " if full is not None else "needs "
    return (
        f"ResourceGuard predicts the step runs out of memory. Per-device batch {rows} {needs}more than the "
        f"{mib(made.fit.usable_bytes)} usable on {made.device.name}. auto_find_batch_size lowers the batch "
        "and tries again; no step has run."
    )


def tensorboard_run_dir(args: Any) -> Path | None:
    """The directory of the Trainer's TensorBoard run: ``args.logging_dir`` (transformers 4), the
    ``TENSORBOARD_LOGGING_DIR`` variable, else the newest run under ``<output_dir>/runs`` (the Trainer's
    ``TensorBoardCallback`` creates it at its ``on_train_begin``, which runs before user callbacks)."""
    named = getattr(args, "logging_dir", None) or os.environ.get("TENSORBOARD_LOGGING_DIR")
    if named:
        return Path(os.path.expanduser(named))
    runs = Path(args.output_dir) / "runs"
    if not runs.is_dir():
        return None
    found = [p for p in runs.iterdir() if p.is_dir()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def tensorboard_writer(args: Any) -> Any:
    run = tensorboard_run_dir(args)
    if run is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(run))
    except Exception as error:  # no tensorboard: the monitor writes its own files
        warn_at_user(f"ResourceGuardCallback: no TensorBoard writer ({error!r})")
        return None


def build_monitor(
    args: Any,
    state: Any,
    made: Plan,
    log_dir: str | os.PathLike[str],
    profile: Any,
    writer: Any,
    shapes: Any,
    flops_per_step: float | None = None,
) -> Any:
    """The :class:`~resource_guard.RunMonitor` of a Trainer run (not started): one step per optimizer step
    (the Trainer's ``global_step``, its loggers' x-axis), the plan's estimate and capacity, the loader's
    settings from ``args``, the step's model FLOPs (``flops_per_step``: one micro-step's, times the
    accumulation; MFU where the device's peak is known); only process zero writes."""
    from resource_guard.observe.monitor import RunMonitor

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    rank0 = args.process_index == 0
    steps = int(getattr(args, "logging_steps", 0) or 0)
    monitor = RunMonitor(
        log_dir if rank0 else None,
        device=device,
        log_every_n_steps=steps if steps >= 1 else 50,
        profile=profile,
        estimate=made.estimate,
        capacity_bytes=made.fit.capacity_bytes if on_gpu else None,
        planned_capacity_bytes=made.fit.capacity_bytes,
        device_spec=made.device if on_gpu and made.device.source == "detected" else None,
        writer=writer,
        rank=int(args.process_index),
        world_size=max(1, int(args.world_size)),
        loader_info={
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "prefetch_factor": args.dataloader_prefetch_factor,
        },
        precision=made.precision,
        flops_per_step=flops_per_step * max(1, int(args.gradient_accumulation_steps))
        if flops_per_step
        else None,
        phase_timing=True,  # switched at the Trainer's boundaries (frontdoors/hf/phases.py)
    )
    max_steps = int(getattr(state, "max_steps", 0) or 0)
    monitor.total_steps = max_steps if max_steps > 0 else None
    monitor.shape_stats = shapes.stats if shapes is not None else None
    from resource_guard.report.plan_advice import plan_rows

    monitor.plan_rows = plan_rows(made)  # the advice quotes the configuration it recommends
    for line in made.reasons:
        monitor.note(line)
    return monitor
