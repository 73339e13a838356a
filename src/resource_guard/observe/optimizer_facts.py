"""What the report needs to know of an optimizer: which implementation its step runs (a Python
for-loop over the tensors, the multi-tensor for-each path, or a fused kernel) and over how many tensors.

Example:
    >>> import torch
    >>> params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    >>> facts = describe_optimizer(torch.optim.AdamW(params, foreach=False))
    >>> facts["name"], facts["tensors"], facts["for_loop"]
    ('AdamW', 3, True)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["describe_optimizer"]


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
    """``name``, ``tensors`` (parameters), ``foreach``/``fused`` as set, ``for_loop`` (the step runs a
    for-loop: ``foreach=False``, or left unset with a parameter off CUDA, where PyTorch's default picks
    for-each only for CUDA tensors) and ``fused_available`` (the class takes ``fused``)."""
    params = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
    defaults = dict(getattr(optimizer, "defaults", {}) or {})
    foreach, fused = defaults.get("foreach"), defaults.get("fused")
    has_foreach = "foreach" in defaults
    if fused or foreach:
        for_loop = False
    elif foreach is None and has_foreach:
        for_loop = not params or not all(isinstance(p, torch.Tensor) and p.is_cuda for p in params)
    else:
        for_loop = has_foreach  # foreach=False; an optimizer without a for-each path is not "slow" here
    return {
        "name": type(optimizer).__name__,
        "tensors": len(params),
        "foreach": foreach,
        "fused": fused,
        "for_loop": bool(for_loop),
        "fused_available": "fused" in defaults,
    }
