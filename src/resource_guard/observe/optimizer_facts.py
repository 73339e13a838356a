"""What the report needs to know of an optimizer: which implementation its step runs (a Python
for-loop over the tensors, the multi-tensor for-each path, or a fused kernel) and over how many tensors;
for a for-loop, what the for-each path would take instead, measured (:func:`foreach_probe`).

Example:
    >>> import torch
    >>> params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    >>> facts = describe_optimizer(torch.optim.AdamW(params, foreach=False))
    >>> facts["name"], facts["tensors"], facts["for_loop"]
    ('AdamW', 3, True)
"""

from __future__ import annotations

import inspect
import math
import time
from typing import Any

import torch

__all__ = ["describe_optimizer", "foreach_probe"]

_PROBE_ELEMENTS = 2**21  # elements of the probe's parameters (8 MiB in fp32; x4 with grads and Adam's state)
_PROBE_REPEATS = 5  # interleaved for-loop / for-each steps; the fastest of each counts
_PROBE_BUDGET_S = 0.3  # what the probe may cost the run's close: fewer tensors, then fewer repeats
_PROBE_MIN_STEPS = 6  # two paths: a first step each (the state), then at least two timed steps each


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


def foreach_probe(optimizer: Any, step_s: float | None = None) -> dict[str, float] | None:
    """The optimizer's step on its for-loop and on the for-each path, in seconds (``for_loop_s``,
    ``foreach_s``): measured once, on tensors shaped like its parameters (same dtypes and device), with
    its class and defaults, ``foreach=False`` against ``foreach=True``, fastest of a few interleaved
    steps each.

    The per-tensor overhead that for-each removes depends on the tensors' count and sizes, the
    optimizer and this machine (for-each takes 0.4 to 0.8 of the for-loop's time for AdamW over 360
    small tensors on a 2-core CPU), so it is measured rather than assumed. Where the parameters hold
    more than ``_PROBE_ELEMENTS`` elements, every k-th tensor is stepped and both times are scaled by
    k. ``step_s``, the run's measured optimizer step, bounds the probe's cost: k is raised until its
    ``_PROBE_MIN_STEPS`` steps on 1/k of the tensors fit ``_PROBE_BUDGET_S`` (a 1.4 s AdamW step of a
    loaded CPU: 3.9 s of probe at k = 3, about 0.3 s at k = 28). ``None`` where the class takes no
    ``foreach`` or a step fails.
    """
    params = [p for g in getattr(optimizer, "param_groups", ()) for p in g.get("params", ())]
    params = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad and not p.is_meta]
    defaults = dict(getattr(optimizer, "defaults", {}) or {})
    if not params or "foreach" not in defaults:
        return None
    total = sum(p.numel() for p in params)
    stride = max(1, math.ceil(total / _PROBE_ELEMENTS))
    if step_s is not None and step_s > 0:  # the run's own step says what a full probe step costs
        stride = max(stride, math.ceil(_PROBE_MIN_STEPS * step_s / _PROBE_BUDGET_S))
    stride = min(stride, len(params))
    chosen = params[::stride]
    try:  # the constructor's own arguments (AdamW's defaults hold a key its __init__ does not take)
        accepted = inspect.signature(type(optimizer)).parameters
    except (TypeError, ValueError):
        return None
    if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    defaults.pop("fused", None)  # the probe compares the two non-fused paths

    def made(foreach: bool) -> torch.optim.Optimizer:
        tensors = []
        for p in chosen:
            t = torch.zeros(p.shape, dtype=p.dtype, device=p.device, requires_grad=True)
            t.grad = torch.full_like(t, 1e-3)
            tensors.append(t)
        opt = type(optimizer)(tensors, **{**defaults, "foreach": foreach})
        opt.step()  # the state exists from the first step
        return opt

    device = chosen[0].device

    def timed(opt: torch.optim.Optimizer) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    try:
        loop, each = made(False), made(True)
        loop_s, each_s, begun = math.inf, math.inf, time.perf_counter()
        for i in range(_PROBE_REPEATS):
            loop_s = min(loop_s, timed(loop))
            each_s = min(each_s, timed(each))
            if i >= 1 and time.perf_counter() - begun > _PROBE_BUDGET_S:
                break
    except Exception:  # an optimizer whose constructor or step needs more than its defaults
        return None
    scale = len(params) / len(chosen)
    return {"for_loop_s": loop_s * scale, "foreach_s": each_s * scale}
