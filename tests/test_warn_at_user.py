"""Quiet and pointed warnings (issue #37): a ResourceGuardWarning is located at the user's line, however
deep the door it came through, and names no argument the door does not take."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from resource_guard.errors import ResourceGuardWarning, warn_at_user
from resource_guard.frontdoors.guard.setup import flops_per_sample
from resource_guard.observe.throughput import count_flops


class Branchy(nn.Module):
    """A forward that reads a tensor's value: it cannot run on fake tensors (no FLOP count)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.sum() if bool(y.mean() > 0) else -y.sum()


def _caught(fn: object, *args: object, **kwargs: object) -> tuple[list[warnings.WarningMessage], int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        fn(*args, **kwargs)  # type: ignore[operator]
    return [w for w in caught if issubclass(w.category, ResourceGuardWarning)], line


def test_a_warning_from_inside_a_door_is_located_at_the_user_s_line() -> None:
    caught, line = _caught(flops_per_sample, Branchy(), torch.randn(8, 4), lambda m, b: m(b))
    assert len(caught) == 1 and "could not be run on fake tensors" in str(caught[0].message)
    assert Path(caught[0].filename).name == Path(__file__).name and caught[0].lineno == line


def test_count_flops_names_no_argument_the_caller_does_not_take() -> None:
    caught, _ = _caught(count_flops, Branchy(), torch.randn(8, 4), lambda m, b: m(b), remedy=None)
    text = str(caught[0].message)
    assert "flops_per_step" not in text and text.endswith("MFU will not be reported.")
    caught, _ = _caught(count_flops, Branchy(), torch.randn(8, 4), lambda m, b: m(b))
    assert "unless flops_per_step is given" in str(caught[0].message)  # the doors that take it


def test_warn_at_user_honours_the_filters() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceGuardWarning)
        with pytest.raises(ResourceGuardWarning, match="degraded"):
            warn_at_user("degraded")
