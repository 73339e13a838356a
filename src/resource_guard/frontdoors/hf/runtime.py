"""Run-time pieces of the Hugging Face ``Trainer`` door (:mod:`~resource_guard.frontdoors.hf.trainer`): the
model's forward pre-hook object, accelerate's autocast wrapper taken off for a trace (the one private seam),
the Trainer's TensorBoard run, its monitor, and the messages of a step that does not fit.

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
    warn_at_user,
)
from resource_guard.frontdoors.hf import step as hf_step

if TYPE_CHECKING:
    from resource_guard.planning.planner import Plan

__all__ = [
    "ModelHook",
    "build_monitor",
    "checkpointed",
    "default_collator",
    "kept_message",
    "mib",
    "plan_writer",
    "tensorboard_run_dir",
    "tensorboard_writer",
    "too_big_message",
    "without_accelerate_autocast",
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


def plan_writer(args: Any, text: str, state: Any) -> Any:
    """On process zero of a run reporting to TensorBoard: a writer into the Trainer's TensorBoard run
    (``None`` without one), the pre-flight ``text`` written to it under ``resource_guard/plan``."""
    if args.process_index != 0 or "tensorboard" not in (args.report_to or []):
        return None
    writer = tensorboard_writer(args)
    if writer is not None:
        with contextlib.suppress(Exception):  # a broken writer is the monitor's to report
            head, _, rest = text.partition("\n")
            writer.add_text("resource_guard/plan", f"{head}\n\n{rest}", state.global_step)
    return writer


def build_monitor(
    args: Any,
    made: Plan,
    log_dir: str | os.PathLike[str],
    profile: Any,
    writer: Any,
    flops_per_step: float | None = None,
    cadence: dict[str, Any] | None = None,
) -> Any:
    """The :class:`~resource_guard.RunMonitor` of a Trainer run (not started; see
    :func:`~resource_guard.frontdoors.run.new_monitor`): one step per optimizer step (the Trainer's
    ``global_step``, its loggers' x-axis), the loader's settings from ``args``, the step's model FLOPs
    (``flops_per_step``: one micro-step's, times the accumulation; MFU where the device's peak is known);
    only process zero writes."""
    from resource_guard.frontdoors.run import new_monitor

    rank0 = args.process_index == 0
    return new_monitor(
        made,
        torch.device(args.device),
        log_dir if rank0 else None,
        **(cadence or {}),  # the callback's log_every_n_steps / log_interval_s
        profile=profile,
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
    )
