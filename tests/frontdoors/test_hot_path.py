"""The front doors' per-step work (issue #22: "the per-step cost goes down, not up").

- Lightning: ``ResourceGuard`` leaves the per-batch hooks it inherits unchanged set to ``None`` on the
  instance, and Lightning's dispatcher then skips them (a private behaviour of
  ``lightning.pytorch.trainer.call._call_callback_hooks``: these tests fail loudly if it changes).
- ``guard``: a batch that fits the micro-batch is yielded as it is (no slicing, no rebuilt containers);
  one that does not is still split.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.profilers import Profiler
from torch import nn

from resource_guard import guard
from resource_guard.frontdoors.lightning.callback import ResourceGuard
from resource_guard.frontdoors.lightning.internals import STEP_HOOKS as _STEP_HOOKS


class Actions(Profiler):
    """Records the actions Lightning profiles: one ``[Callback]<key>.<hook>`` per hook it calls."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def start(self, action_name: str) -> None:
        self.seen.add(action_name)

    def stop(self, action_name: str) -> None:
        pass

    def summary(self) -> str:
        return ""


def fit(callback: Callback, **trainer: Any) -> set[str]:
    actions = Actions()
    L.Trainer(
        max_steps=2,
        limit_val_batches=1,
        val_check_interval=1,
        callbacks=[callback],
        profiler=actions,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer,
    ).fit(BoringModel())
    prefix = f"[Callback]{callback.state_key}."
    return {a[len(prefix) :] for a in actions.seen if a.startswith(prefix)}


def test_lightning_skips_the_per_batch_hooks_the_callback_does_not_define() -> None:
    called = fit(ResourceGuard(monitor=False, profile=False))
    assert {"on_train_batch_start", "on_train_batch_end", "on_fit_start", "on_train_start"} <= called
    assert not called & {"on_before_backward", "on_after_backward", "on_before_optimizer_step"}
    assert not called & {"on_before_zero_grad", "on_validation_batch_start", "on_validation_batch_end"}


def test_a_subclass_that_defines_a_per_batch_hook_still_gets_it() -> None:
    seen: list[str] = []

    class Mine(ResourceGuard):
        def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
            seen.append("backward")

        def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
            seen.append("validation")

    called = fit(Mine(monitor=False, profile=False))
    assert {"on_before_backward", "on_validation_batch_end"} <= called
    assert "on_after_backward" not in called and "backward" in seen and "validation" in seen
    assert set(_STEP_HOOKS) >= {"on_before_backward", "on_validation_batch_end", "on_train_batch_start"}


def test_a_callback_made_by_copy_keeps_skipping() -> None:
    import copy
    import pickle

    for made in (copy.deepcopy(ResourceGuard()), pickle.loads(pickle.dumps(ResourceGuard()))):
        assert made.on_before_backward is None and callable(made.on_train_batch_start)


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.inputs: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return self.lin(x)


@pytest.mark.parametrize("split", [False, True])
def test_guard_yields_a_fitting_batch_as_it_is_and_splits_the_others(split: bool) -> None:
    model = Recorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    yielded = []
    # split: plan as usual, then force two micro-batches of 4 per batch of 8 (the shape guard, which
    # answers from the plan it started with, off: this is the plan's own split)
    with guard(
        model, optimizer, device="cpu", monitor=False, target_batch_size=8, check_shapes=not split
    ) as g:
        if split:
            g._setup(batches[0])
            assert g.plan is not None
            g.plan = dataclasses.replace(g.plan, micro_batch_size=4)
        for batch in g.iterate(batches):
            yielded.append(batch)
            loss = nn.functional.mse_loss(model(batch[0]), batch[1])
            g.backward(loss)
    assert g.optimizer_steps == 3
    if split:
        assert len(yielded) == 6 and all(b[0].shape[0] == 4 for b in yielded)
    else:
        assert [id(b) for b in yielded] == [id(b) for b in batches]  # the same objects, not rebuilt
        assert all(a is b[0] for a, b in zip(model.inputs, batches))
