"""Per-operator recovery inside a fake-tensor trace: one failing operator does not end the estimate.

A fake (meta) kernel can refuse inputs its real kernel accepts: a CUDA-only dtype check
(``_grouped_mm`` insists on bf16; MoE models route every token through it), a data-dependent output
shape (``_ctc_loss``), no meta kernel at all, or a Python-level read of a value (``.item()``,
``bool(t)``, ``t.numpy()``). :class:`Recovery` computes such an operator's outputs another way and
remembers what it did, in this order:

1. ``rule``: a corrected fake rule (:data:`FAKE_RULES`): output shapes and dtypes from the inputs, as
   the real kernel allocates them;
2. ``shadow``: every tensor input has a real *shadow* value (batch-derived, see
   :class:`~resource_guard.estimate.trace.tracer.StorageTracker`): the real kernel runs on the shadows, exact;
3. ``real``: the real kernel runs on zero tensors of the inputs' shapes and strides (shadows where
   known), only when those fit :data:`REAL_BUDGET_BYTES`; the outputs become fresh fake tensors of the
   real outputs' shapes; ``unique``'s 1-D outputs are widened to the largest input (``widened``:
   zeros would give its smallest size);
4. ``assumed``: a value nobody knows (``.item()`` of a parameter-derived tensor): a bool made by
   ``all``/``any`` reads ``True`` (checks such as ``if not (boxes >= 0).all(): raise`` pass), any other
   bool ``False`` (LayerDrop's ``torch.rand([]) < p`` keeps its layers), a number ``0``; ``nonzero`` and
   ``masked_select`` keep every element (the most they can be).

``FakeTensorMode`` must be created with ``allow_fallback_kernels=False`` (:func:`fake_mode`): its own
fallback runs the real kernel on full-size zero tensors with no size limit, where step 3 is bounded.
Python code that reads a fake tensor through numpy (scipy's Hungarian matcher in DETR) never reaches
the dispatcher; :func:`fake_numpy` gives it the shadow or zeros.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from resource_guard.step.batching import SHADOW_MAX_NUMEL

__all__ = ["EXACT", "FAKE_RULES", "REAL_BUDGET_BYTES", "Recovery", "fake_mode", "fake_numpy"]

REAL_BUDGET_BYTES = 64 * 2**20  # the most real memory one operator's recovery may allocate for its inputs
EXACT = frozenset({"shadow"})  # recoveries that compute the real values: the estimate stays exact
_aten = torch.ops.aten
_CHECK_OPS = (_aten.all, _aten.any)
_HOW = {
    "rule": "a corrected fake rule",
    "shadow": "the real kernel on shadow values",
    "real": "the real kernel on zero tensors of the same shapes",
    "widened": "the real kernel on zero tensors, value-dependent sizes widened to the largest input",
    "assumed": "an assumed value",
}

_WIDENED = frozenset({"_unique", "_unique2", "unique_dim", "unique_consecutive"})
_NOTES = {  # what a recovery of these operators means for the estimate, said beside it
    ("_grouped_mm", "rule"): "tensor sizes do not depend on the MoE routing: any routing, the worst included",
    ("nonzero", "assumed"): "every element kept (MoE routing: every token on every expert, an upper bound)",
    ("masked_select", "assumed"): "every element kept (an upper bound)",
}

Rule = Callable[["Recovery", tuple, dict], Any]
FAKE_RULES: dict[Any, Rule] = {}
"""Corrected fake rules: ``op overload -> (recovery, args, kwargs) -> fake outputs``."""


def _rule(*names: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for name in names:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(_aten, packet, None), overload or "default", None)
            if op is not None:
                FAKE_RULES[op] = fn
        return fn

    return register


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


@_rule("_grouped_mm.default")
def _grouped_mm(rec: Recovery, args: tuple, kwargs: dict) -> torch.Tensor:
    """``torch._grouped_mm``: the meta kernel applies CUDA's bf16-only check; the CPU kernel runs any float.

    Shapes as ``torch._meta_registrations._create_grouped_mm_output_tensor``; dtype ``out_dtype`` or
    ``mat_a``'s.
    """
    a, b = args[0], args[1]
    offs = _arg(args, kwargs, 2, "offs")
    dtype = _arg(args, kwargs, 4, "out_dtype") or a.dtype
    if a.dim() == 2 and b.dim() == 2:
        shape: tuple[int, ...] = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.dim() == 2:  # (tokens, K) x (experts, K, N) -> (tokens, N): the MoE case
        shape = (a.shape[0], b.shape[-1])
    elif b.dim() == 2:
        shape = (a.shape[1], b.shape[1])
    else:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    return torch.empty(shape, dtype=dtype, device=a.device)


@_rule("_ctc_loss.default", "_ctc_loss.Tensor")
def _ctc_loss(rec: Recovery, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(neg_log_likelihood (B,), log_alpha (B, T, 2 * max_target_length + 1))``, as the kernels allocate."""
    log_probs, targets, target_lengths = args[0], args[1], args[3]
    batched = log_probs.dim() == 3
    steps, batch = log_probs.shape[0], (log_probs.shape[1] if batched else 1)
    if isinstance(target_lengths, (list, tuple)):
        longest = max(target_lengths, default=0)
    elif (shadow := rec.shadow_of(target_lengths)) is not None:
        with _disable_current_modes():
            longest = int(shadow.max()) if shadow.numel() else 0
    else:  # unknown lengths: the targets tensor bounds them
        longest = targets.shape[1] if targets.dim() == 2 else targets.numel()
        rec.counts[("_ctc_loss", "assumed")] += 1
    nll = torch.empty((batch,), dtype=log_probs.dtype, device=log_probs.device)
    alpha = torch.empty((batch, steps, 2 * longest + 1), dtype=log_probs.dtype, device=log_probs.device)
    return nll, alpha


@_rule("_ctc_loss_backward.default", "_ctc_loss_backward.Tensor")
def _ctc_loss_backward(rec: Recovery, args: tuple, kwargs: dict) -> torch.Tensor:
    """The gradient has ``log_probs``' shape and dtype; ``log_beta``, as large as ``log_alpha``, is scratch
    (``ctc_loss_backward_cpu_template`` and its CUDA twin allocate it and free it inside the operator)."""
    log_probs, log_alpha = args[1], args[6]
    rec.scratch_bytes += log_alpha.numel() * log_alpha.element_size()
    return torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.device)


class Recovery:
    """Computes the outputs of operators whose fake kernel failed, and counts what it did.

    Args:
        shadows: fake tensor -> real value (weak keys), shared with the tracker: read for inputs,
            written for outputs computed exactly.
        budget_bytes: the most real memory a ``real`` recovery may allocate for its inputs
            (default :data:`REAL_BUDGET_BYTES`, read when the recovery is made).

    Example:
        >>> rec = Recovery()
        >>> with fake_mode():
        ...     a, b = torch.empty(6, 4), torch.empty(2, 4, 3)
        ...     offs = torch.empty(2, dtype=torch.int32)
        ...     out = rec.recover(torch.ops.aten._grouped_mm.default, (a, b, offs), {}, RuntimeError("bf16"))
        >>> tuple(out.shape), rec.summary()[0].split(";")[0]
        ((6, 3), '`_grouped_mm`: a corrected fake rule (1x)')
    """

    def __init__(self, shadows: MutableMapping | None = None, budget_bytes: int | None = None) -> None:
        self.shadows: MutableMapping = WeakTensorKeyDictionary() if shadows is None else shadows
        self.budget_bytes = REAL_BUDGET_BYTES if budget_bytes is None else budget_bytes
        self.counts: Counter[tuple[str, str]] = Counter()  # (op, how) -> times; `how` a key of _HOW
        self.scratch_bytes = 0  # the last recovered operator's internal scratch, for the tracker to take
        self._checks = WeakTensorKeyDictionary()  # outputs of all/any: a bool read from them is a check

    # -- what happened ---------------------------------------------------------------------------
    @property
    def exact(self) -> bool:
        """True when every recovery computed real values (the estimate is as good as a plain trace)."""
        return all(how in EXACT for _, how in self.counts)

    def summary(self) -> tuple[str, ...]:
        """One line per operator and inexact way, as ``"`_grouped_mm`: a corrected fake rule (12x)"``."""
        return tuple(
            f"`{op}`: {_HOW[how]} ({n}x)" + (f"; {_NOTES[op, how]}" if (op, how) in _NOTES else "")
            for (op, how), n in sorted(self.counts.items())
            if how not in EXACT
        )

    def take_scratch(self) -> int:
        """The scratch bytes a rule declared for the operator just recovered (then zero)."""
        scratch, self.scratch_bytes = self.scratch_bytes, 0
        return scratch

    def observe(self, func: Any, out: Any) -> None:
        """Call after every operator: remembers the bools that ``all``/``any`` made."""
        if func.overloadpacket in _CHECK_OPS and isinstance(out, torch.Tensor):
            self._checks[out] = True

    def shadow_of(self, t: Any) -> torch.Tensor | None:
        return self.shadows.get(t) if isinstance(t, torch.Tensor) else None

    # -- recovery --------------------------------------------------------------------------------
    def recover(self, func: Any, args: tuple, kwargs: dict, exc: BaseException) -> Any:
        """The (fake) outputs of ``func``, or ``exc`` re-raised when none of the ways applies.

        Call with the ``FakeTensorMode`` active (outputs made with ``torch.empty`` are fake).
        """
        name = str(func.overloadpacket.__name__)
        self.scratch_bytes = 0
        rule = FAKE_RULES.get(func)
        if rule is not None:
            self.counts[(name, "rule")] += 1
            return rule(self, args, kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, FakeTensor)]
        exact = bool(tensors) and all(t in self.shadows for t in tensors)
        if func is _aten._local_scalar_dense.default:
            return self._scalar(name, args[0])
        if not exact and func in (_aten.nonzero.default, _aten.masked_select.default):
            self.counts[(name, "assumed")] += 1
            x = args[0]
            if func is _aten.nonzero.default:
                return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
            n = torch.broadcast_shapes(x.shape, args[1].shape).numel()
            return torch.empty((n,), dtype=x.dtype, device=x.device)
        need = sum(t.numel() * t.element_size() for t in tensors if t not in self.shadows)
        if not exact and need > self.budget_bytes:
            raise exc
        # `unique` on zeros returns its smallest size: its 1-D outputs are widened to the largest
        # input, the most it returns (other ops' sizes, such as `bincount`'s, stay as computed)
        widen = max(t.numel() for t in tensors) if name in _WIDENED and not exact else 0
        try:
            out = self._run_real(func, args, kwargs, tensors, exact, widen)
        except Exception:
            raise exc from None
        self.counts[(name, "shadow" if exact else "widened" if widen else "real")] += 1
        return out

    def _scalar(self, name: str, t: torch.Tensor) -> bool | int | float:
        shadow = self.shadow_of(t)
        if shadow is not None:
            self.counts[(name, "shadow")] += 1
            with _disable_current_modes():  # else the active FakeTensorMode fakes the real shadow
                return shadow.item()  # type: ignore[no-any-return]
        self.counts[(name, "assumed")] += 1
        if t.dtype == torch.bool:
            return t in self._checks
        return 0.0 if t.dtype.is_floating_point else 0

    def _run_real(
        self, func: Any, args: tuple, kwargs: dict, tensors: list, exact: bool, widen: int = 0
    ) -> Any:
        device = tensors[0].device if tensors else torch.device("cpu")
        mutable = func._schema.is_mutable

        def real(a: Any) -> Any:
            if not isinstance(a, FakeTensor):
                return a
            shadow = self.shadows.get(a)
            if shadow is not None:
                return shadow.clone() if mutable else shadow
            try:  # the fake's strides (kernels may depend on them), zeros as values
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).zero_()
            except RuntimeError:  # overlapping (expanded) strides
                return torch.zeros(a.shape, dtype=a.dtype)

        with _disable_current_modes():
            real_out = func(*tree_map(real, args), **tree_map(real, kwargs))

        def to_fake(r: Any) -> Any:
            if not isinstance(r, torch.Tensor):
                return r
            if widen and r.dim() == 1 and r.numel() < widen:
                return torch.empty((widen,), dtype=r.dtype, device=device)
            fake = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device)
            if exact and r.numel() <= SHADOW_MAX_NUMEL:
                self.shadows[fake] = r
            return fake

        return tree_map(to_fake, real_out)


def fake_mode() -> FakeTensorMode:
    """The ``FakeTensorMode`` a recovering trace runs in.

    ``allow_fallback_kernels=False``: an operator without a meta kernel raises, and :class:`Recovery`
    runs it within its byte budget, instead of FakeTensorMode's own fallback, which runs the real
    kernel on full-size zero tensors however large they are.
    """
    return FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)


@contextlib.contextmanager
def fake_numpy(recovery: Recovery) -> Iterator[None]:
    """``Tensor.numpy()`` of a fake tensor (so ``np.asarray``, scipy) gives its shadow, else zeros.

    ``.numpy()`` does not reach the dispatcher ("not supported for tensor subclasses"), so the method is
    replaced while the trace runs and restored after; real tensors are unaffected.
    """
    original = torch.Tensor.numpy

    def numpy(self: torch.Tensor, *, force: bool = False) -> Any:
        if not isinstance(self, FakeTensor):
            return original(self, force=force)
        with _disable_current_modes():
            shadow = recovery.shadow_of(self)
            if shadow is not None:
                return original(shadow.detach(), force=force)
            recovery.counts[("Tensor.numpy", "assumed")] += 1
            return original(torch.zeros(self.shape, dtype=self.dtype))

    torch.Tensor.numpy = numpy  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.numpy = original  # type: ignore[method-assign]
