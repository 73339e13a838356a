"""A small Lightning run with the ResourceGuard callback, written for real (BoringModel, CPU): the run the
TensorBoard tab's tests read."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
from lightning.pytorch.demos.boring_classes import BoringModel

from resource_guard.frontdoors.lightning.callback import ResourceGuard


def write_lightning_run(root: Path, *, max_steps: int, log_every_n_steps: int) -> None:
    """Train a BoringModel under ``ResourceGuard()`` with ``default_root_dir=root``; the Trainer and the
    callback log every ``log_every_n_steps`` steps (the callback has its own argument: it does not follow
    the Trainer's)."""
    L.Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        log_every_n_steps=log_every_n_steps,
        callbacks=[ResourceGuard(log_every_n_steps=log_every_n_steps)],
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).fit(BoringModel())
