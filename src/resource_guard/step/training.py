"""One training step, written once and used by the estimator (on fake tensors) and by measurement.

A step is: forward (under autocast for ``*-mixed``), loss, backward (scaled for ``16-mixed``),
optimizer step (with unscale), ``zero_grad(set_to_none=True)``.

The loss of a step is the caller's ``loss_fn`` or, by default, the model's own output (a scalar, or
``output.loss``). :class:`StandInLoss` is what the front doors (``guard``) plan from when the training
loop computes the loss itself and no ``loss_fn`` was given: a cross-entropy-shaped reduction of the
outputs (see its docstring). ``estimate_memory`` and ``plan`` keep the strict default: they never
guess a loss unless handed the stand-in explicitly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from resource_guard.errors import ConfigurationError
from resource_guard.step.precision import PrecisionSpec, autocast_context

__all__ = [
    "LossFn",
    "OptimizerArg",
    "OutputsDropped",
    "StandInLoss",
    "default_loss_fn",
    "call_loss_fn",
    "map_tensors",
    "iter_tensors",
    "batch_size_of",
]

LossFn = Callable[[nn.Module, Any], Any]
# an optimizer over the model's parameters, a factory ``params -> Optimizer``, or a user step's list of them
OptimizerArg = (
    torch.optim.Optimizer
    | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    | list[torch.optim.Optimizer]
)


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested batch; containers keep their type.

    Handles tensors, mappings, lists, tuples, namedtuples and dataclass instances; other leaves are
    returned unchanged.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def iter_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested batch, in order."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(visit, obj)
    return found


def batch_size_of(batch: Any) -> int | None:
    """The leading dimension shared by the batch's tensors, or ``None`` when it cannot be told."""
    sizes = {t.shape[0] for t in iter_tensors(batch) if t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def default_loss_fn(model: nn.Module, batch: Any) -> Any:
    """Call the model the usual way and return its output.

    A Mapping batch → ``model(**batch)``; a tuple/list → ``model(*batch)``; else ``model(batch)``.
    """
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return model(*batch)
    return model(batch)


def _scalar_in_tuple(output: Any) -> torch.Tensor | None:
    """The one one-element float tensor of a returned tuple (nanoGPT's ``logits, loss = model(x, y)``)."""
    if not isinstance(output, (tuple, list)):
        return None
    found = [t for t in output if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()]
    return found[0].reshape(()) if len(found) == 1 else None


def _as_loss(output: Any) -> torch.Tensor:
    in_tuple = _scalar_in_tuple(output)
    if in_tuple is not None:
        return in_tuple
    if isinstance(output, torch.Tensor):
        if output.numel() == 1:
            return output.reshape(())
        raise ConfigurationError(
            f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss; pass "
            "`loss_fn=lambda model, batch: ...` that returns the scalar loss (or "
            "`loss_fn=resource_guard.step.training.StandInLoss()` to plan from a cross-entropy stand-in)."
        )
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    if isinstance(loss, torch.Tensor):
        raise ConfigurationError(
            f"the output's loss has shape {tuple(loss.shape)}, not a scalar; reduce it (e.g. `.mean()`) in "
            "the model or the loss function (`loss_fn=lambda model, batch: ...`)."
        )
    raise ConfigurationError(
        f"cannot find a scalar loss in the model's output ({type(output).__name__}): it is neither a "
        "scalar tensor, nor a tuple with one, nor has `.loss` / `['loss']`; pass "
        "`loss_fn=lambda model, batch: ...` that returns it."
    )


def _standin_of(tensor: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy`` against class 0 over the last dim: what a cross-entropy keeps, under the
    precision policy in force (autocast runs it in float32; the target's policy decides its dtypes).

    Outputs that are already log-probabilities (the model ends in ``log_softmax``, as pytorch/examples'
    mnist and word_language_model do, the loop then calling ``F.nll_loss``) go through ``F.nll_loss``:
    a cross-entropy would add a second ``log_softmax`` that loop never runs."""
    if tensor.dim() == 0 or tensor.numel() == 0:
        return tensor.float().sum()
    flat = tensor.reshape(-1, tensor.shape[-1])
    target = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    if type(tensor.grad_fn).__name__ == "LogSoftmaxBackward0":
        return nn.functional.nll_loss(flat, target)
    return nn.functional.cross_entropy(flat, target)


class StandInLoss:
    """The loss to plan from when the training loop computes its own loss from the model's outputs.

    Calls the model as a training loop would: a Mapping batch → ``model(**batch)`` (only the keys
    ``forward`` accepts), a tuple/list → ``model(*batch)`` without the trailing items ``forward``
    does not require (the targets of ``(inputs, targets)``), else ``model(batch)``. When the output
    carries a loss (a scalar, or ``.loss`` / ``["loss"]``) that loss is used as is, exactly.
    Otherwise the outputs stand in for the loss: each floating-point output tensor that requires
    grad (under ``no_grad``, as in an evaluation step: every one; only ``logits`` when a mapping or
    ``ModelOutput`` has them) goes through
    ``F.cross_entropy`` over its last dimension against class 0 — the kernels, saved tensors and
    gradients of a cross-entropy over logits (the commonest loss), under whatever precision policy
    the step runs (CPU or the target's CUDA autocast). A loss that keeps more
    (label smoothing, a float32 copy of shifted logits) is under-counted by that difference; pass
    ``loss_fn=`` for an exact estimate.

    ``used`` becomes True once the outputs had to stand in; :attr:`REASON` says so in a plan.

    Example:
        >>> model = torch.nn.Linear(8, 5)
        >>> loss_fn = StandInLoss()
        >>> loss = loss_fn(model, torch.randn(4, 8))
        >>> loss.shape, loss.dtype, loss_fn.used
        (torch.Size([]), torch.float32, True)
    """

    REASON = (
        "loss: stand-in (a cross-entropy over the model's outputs against class 0), "
        "as no `loss_fn` was given and the model returns no loss; pass loss_fn= for an exact estimate"
    )

    keep_outputs = True  # the traced step keeps the model's outputs alive (see `training_step`)

    def __init__(self) -> None:
        self.used = False

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        output = _call_as_the_loop_does(model, batch)
        own = _own_loss(output)
        if own is not None:
            return own
        return self.stand_in(output)

    def stand_in(self, output: Any) -> torch.Tensor:
        """The stand-in loss over ``output``'s floating tensors (and the note that one was used)."""
        tensors = _standin_tensors(output)
        if not tensors:
            return _as_loss(output)  # nothing to stand in for: the default's clear error
        self.used = True
        total = _standin_of(tensors[0])
        for tensor in tensors[1:]:
            total = total + _standin_of(tensor)
        return total

    def __repr__(self) -> str:
        return "StandInLoss()"


def _call_as_the_loop_does(model: nn.Module, batch: Any) -> Any:
    """``model(...)`` on the batch, leaving out what ``forward`` does not take (see :class:`StandInLoss`)."""
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: call it the default way
        return default_loss_fn(model, batch)
    kinds = {p.kind for p in params}
    if isinstance(batch, Mapping):
        if inspect.Parameter.VAR_KEYWORD in kinds:
            return model(**batch)
        names = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
        return model(**{k: v for k, v in batch.items() if k in names})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        if inspect.Parameter.VAR_POSITIONAL in kinds:
            return model(*batch)
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        required = sum(1 for p in params if p.kind in positional and p.default is p.empty)
        return model(*batch[: max(required, 1)])
    return model(batch)


def _own_loss(output: Any) -> torch.Tensor | None:
    """The loss the model's output carries (scalar output, one scalar in a tuple, ``.loss``,
    ``["loss"]``), else None."""
    in_tuple = _scalar_in_tuple(output)
    if in_tuple is not None:
        return in_tuple
    if isinstance(output, torch.Tensor):
        return output.reshape(()) if output.numel() == 1 else None
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss.reshape(()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _standin_tensors(output: Any) -> list[torch.Tensor]:
    """The outputs a stand-in loss reduces: the tensor, a container's ``logits``, else its float tensors."""
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    found = [logits] if isinstance(logits, torch.Tensor) else iter_tensors(output)
    # under no_grad (an evaluation step) nothing requires grad: every floating-point output counts
    grad = torch.is_grad_enabled()
    return [t for t in found if t.is_floating_point() and (t.requires_grad or not grad)]


class OutputsDropped:
    """``loss_fn`` whose step frees the model's outputs once the loss is computed (``keep_outputs=False``).

    Example:
        >>> OutputsDropped(lambda model, batch: model(batch).sum()).keep_outputs
        False
    """

    keep_outputs = False

    def __init__(self, loss_fn: LossFn | None) -> None:
        self.loss_fn = loss_fn

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        return (self.loss_fn or default_loss_fn)(model, batch)

    def __repr__(self) -> str:
        return f"OutputsDropped({self.loss_fn!r})"


def call_loss_fn(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """Run ``loss_fn`` (or the default) and return a scalar loss tensor that autograd can differentiate."""
    loss = _as_loss((loss_fn or default_loss_fn)(model, batch))
    if not loss.requires_grad:
        raise ConfigurationError(
            f"the loss ({loss.dtype}) does not require grad, so backward has nothing to differentiate: "
            "compute it from the model's output, outside `torch.no_grad()` / `torch.inference_mode()` and "
            "without `.detach()` or `.item()`."
        )
    return loss


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn | None,
    spec: PrecisionSpec,
    device_type: str,
    *,
    on_phase: Callable[[str], None] | None = None,
    loss_scale: float | None = None,
    optimizer_step: Callable[[], None] | None = None,
    keep_outputs: bool | None = None,
) -> None:
    """One full training step. ``on_phase`` is told "forward", "backward", "optimizer", "zero_grad".

    ``loss_scale`` stands for a GradScaler's scale (``16-mixed``): the loss is multiplied by it and the
    gradients divided by it before the step, as ``GradScaler.unscale_`` does. ``optimizer_step``
    replaces ``optimizer.step()`` (the estimator uses it to trace each optimizer code path).

    ``keep_outputs``: what ``model(...)`` returned stays alive until the optimizer step is done, as a
    loop's variable does (``logits, loss = model(x, y)``, ``output = model(x); loss = crit(output, y)``);
    ``False``: freed once the loss is computed (a step function that returns only the loss, as
    Lightning's ``training_step``). Default: ``loss_fn``'s own ``keep_outputs`` attribute, else True.
    """
    notify = on_phase or (lambda _phase: None)
    keep = keep_outputs if keep_outputs is not None else bool(getattr(loss_fn, "keep_outputs", True))
    kept: list[Any] = []
    notify("forward")
    handle = model.register_forward_hook(lambda _m, _a, out: kept.append(out)) if keep else None
    try:
        with autocast_context(spec, device_type):
            loss = call_loss_fn(model, batch, loss_fn)
    finally:
        if handle is not None:
            handle.remove()
    notify("backward")
    if loss_scale is not None:
        (loss.float() * loss_scale).backward()
    else:
        loss.backward()
    del loss
    notify("optimizer")
    if loss_scale is not None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
    (optimizer_step or optimizer.step)()
    kept.clear()  # the loop's next forward rebinds its variables
    notify("zero_grad")
    optimizer.zero_grad(set_to_none=True)
    notify("done")
