"""Precision names (Lightning's) and what each means for a training step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from resource_guard.errors import ConfigurationError

__all__ = ["PRECISIONS", "PrecisionSpec", "parse_precision", "autocast_context"]


@dataclass(frozen=True)
class PrecisionSpec:
    """What a Lightning precision name implies.

    Attributes:
        name: the Lightning name, e.g. ``"bf16-mixed"``.
        param_dtype: dtype the parameters are kept in.
        autocast_dtype: dtype autocast computes in, or ``None`` for no autocast.
        loss_scaling: whether a GradScaler scales the loss (``"16-mixed"``).
    """

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    loss_scaling: bool

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.param_dtype


PRECISIONS: dict[str, PrecisionSpec] = {
    "32-true": PrecisionSpec("32-true", torch.float32, None, False),
    "16-mixed": PrecisionSpec("16-mixed", torch.float32, torch.float16, True),
    "bf16-mixed": PrecisionSpec("bf16-mixed", torch.float32, torch.bfloat16, False),
    "16-true": PrecisionSpec("16-true", torch.float16, None, False),
    "bf16-true": PrecisionSpec("bf16-true", torch.bfloat16, None, False),
    "64-true": PrecisionSpec("64-true", torch.float64, None, False),  # a float64 model (scientific loops)
}

_ALIASES = {
    "64": "64-true",
    64: "64-true",
    "32": "32-true",
    32: "32-true",
    "16": "16-mixed",
    16: "16-mixed",
    "bf16": "bf16-mixed",
}


def parse_precision(precision: str | int | PrecisionSpec) -> PrecisionSpec:
    """Return the :class:`PrecisionSpec` of a Lightning precision name (a spec is returned as is).

    >>> parse_precision("bf16-mixed").autocast_dtype
    torch.bfloat16
    """
    if isinstance(precision, PrecisionSpec):
        return precision
    key = _ALIASES.get(precision, precision)
    if isinstance(key, str) and key in PRECISIONS:
        return PRECISIONS[key]
    raise ConfigurationError(
        f"precision={precision!r} is not a known precision; use one of {', '.join(PRECISIONS)}."
    )


@contextlib.contextmanager
def autocast_context(spec: PrecisionSpec, device_type: str) -> Iterator[None]:
    """Autocast for ``spec`` on ``device_type`` (a no-op for the ``-true`` precisions)."""
    if spec.autocast_dtype is None:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=spec.autocast_dtype):
        yield
