"""The world an estimate traces in: fake copies of the model, optimizer and batch (:class:`FakeStep`),
the forward pass as the target runs it (:func:`target_forward`), and the training step's global
state, isolated from the caller's (:func:`isolated_global_state`). Used by
:func:`~resource_guard.estimate.estimator.estimate_memory`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from resource_guard.errors import ConfigurationError
from resource_guard.estimate.emulate.attention import attention_for
from resource_guard.estimate.emulate.autocast_regions import AutocastState, applied, routed
from resource_guard.estimate.emulate.cuda_autocast import CudaAutocast
from resource_guard.estimate.emulate.target import Target
from resource_guard.estimate.trace.attached import attached_tensors
from resource_guard.estimate.trace.tracer import StorageTracker
from resource_guard.step.precision import PrecisionSpec
from resource_guard.step.training import LossFn, default_loss_fn, map_tensors

if TYPE_CHECKING:
    from resource_guard.step.training import OptimizerArg

__all__ = [
    "fake_copy",
    "FOREACH",
    "FOR_LOOP",
    "AS_SET",
    "FakeModel",
    "FakeStep",
    "fake_like",
    "fake_scalar",
    "TargetForward",
    "target_forward",
    "isolated_global_state",
]

FOREACH, FOR_LOOP, AS_SET = "foreach", "for-loop", "as-set"  # the optimizer code paths traced


def fake_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device="cpu")


def fake_copy(model: nn.Module, batch: Any) -> tuple[nn.Module, Any]:
    """A copy of ``model`` whose parameters and buffers are fake, and ``batch`` on fake tensors.

    Call inside a ``FakeTensorMode``; the model and batch are untouched (for counting FLOPs).
    """
    fake = FakeModel(model, lambda t: t.dtype)
    return fake.model, map_tensors(lambda t: fake_like(t, t.dtype), batch)


class FakeModel:
    """A deep copy of ``model`` over fake tensors: its parameters (their attributes, e.g. a quantized
    weight's ``quant_state``, copied onto the fakes), buffers, and the tensors it holds outside them
    (:func:`~resource_guard.estimate.trace.attached.attached_tensors`). ``dtype_of`` gives each parameter's
    and buffer's dtype; attached tensors keep theirs. Build inside a ``FakeTensorMode``.
    """

    def __init__(self, model: nn.Module, dtype_of: Callable[[torch.Tensor], torch.dtype]) -> None:
        memo: dict[int, Any] = {}
        self.attached: list[tuple[torch.Tensor, str]] = []
        aliases: list[tuple[torch.Tensor, torch.Tensor]] = []
        for a in attached_tensors(model):
            if a.alias_of is not None and a.tensor.dtype == dtype_of(a.alias_of):
                aliases.append((a.tensor, a.alias_of))
            else:
                memo[id(a.tensor)] = fake = fake_like(a.tensor, a.tensor.dtype)
                self.attached.append((fake, a.owner))
        self.params: list[nn.Parameter] = []
        attributed: list[tuple[nn.Parameter, nn.Parameter]] = []
        for p in model.parameters():
            fp = nn.Parameter(fake_like(p, dtype_of(p)), requires_grad=p.requires_grad)
            if vars(p):  # a fake tensor cannot be of a parameter subclass: it gets the attributes
                attributed.append((p, fp))
            memo[id(p)] = fp
            self.params.append(fp)
        self.buffers: list[torch.Tensor] = []
        for b in model.buffers():
            memo[id(b)] = fb = fake_like(b, dtype_of(b))
            self.buffers.append(fb)
        for t, base in aliases:  # the same bytes as a fake parameter or buffer: a view of it
            memo[id(t)] = memo[id(base)].detach().as_strided(t.shape, t.stride(), t.storage_offset())
        self.model: nn.Module = copy.deepcopy(model, memo)
        for p, fp in attributed:  # after the model: an attribute naming its module finds the copy
            with contextlib.suppress(Exception):  # one that cannot be copied is left off, as before
                fp.__dict__.update(copy.deepcopy(vars(p), memo))
        self.memo = memo


def fake_scalar(t: torch.Tensor) -> torch.Tensor:
    """A fake scalar that keeps its value (an optimizer's ``step`` is read with ``.item()``)."""
    with _disable_current_modes():  # a real value: the active FakeTensorMode must not fake it first
        value = 1 if t.is_meta else t.item()
    return torch.tensor(value, dtype=t.dtype).reshape(t.shape)


class FakeStep:
    """The fake model, optimizer(s) and batch of one estimate, and the step run over them.

    ``optimizer`` is an optimizer, a factory, or a list of optimizers over the model's parameters (a
    user step's: :mod:`~resource_guard.estimate.user_step`); ``optimizers`` holds every copy and
    ``optimizer`` the first.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerArg | Sequence[torch.optim.Optimizer],
        batch: Any,
        spec: PrecisionSpec,
        tracker: StorageTracker,
    ) -> None:
        cast = spec.param_dtype if spec.param_dtype != torch.float32 else None

        def dtype_of(t: torch.Tensor) -> torch.dtype:
            return cast if cast is not None and t.is_floating_point() else t.dtype

        fake = FakeModel(model, dtype_of)
        self.params, self.buffers, self.model = fake.params, fake.buffers, fake.model
        self.model.train()

        memo = fake.memo  # the optimizer's parameters are the fake model's
        # several optimizers (a user step: a GAN's generator and discriminator) share the fake parameters
        given: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        self.optimizers = [self._copy_optimizer(o, memo) for o in given]
        self.optimizer = self.optimizers[0]

        def fake_input(t: torch.Tensor) -> torch.Tensor:
            dtype = dtype_of(t)
            fake = fake_like(t, dtype)
            if dtype == t.dtype:
                tracker.shadow(fake, t)
            return fake

        self.batch = map_tensors(fake_input, batch)
        for p in self.params:
            tracker.track(p, "parameters")
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: tracker.track(q.grad, "gradients"))
        for b in self.buffers:
            tracker.track(b, "other")
        for t, owner in fake.attached:  # a quantized weight's scales count with the weight
            tracker.track(t, "parameters" if owner == "parameter" else "other")

    def _copy_optimizer(self, optimizer: Any, memo: dict[int, Any]) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            for st in optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        memo[id(v)] = fake_like(v, v.dtype) if v.numel() != 1 else fake_scalar(v)
            copied = copy.deepcopy(optimizer, memo)
            copied.__dict__.pop("step", None)  # an LR scheduler's wrapper of the original's step
            return copied
        made = optimizer([p for p in self.params if p.requires_grad])
        if not isinstance(made, torch.optim.Optimizer):
            raise ConfigurationError(
                f"the optimizer factory returned {type(made).__name__}, not a torch.optim.Optimizer."
            )
        return made

    def optimizer_variants(self) -> dict[str, bool | None]:
        groups = self.optimizer.param_groups
        if all("foreach" in g and g.get("foreach") is None and not g.get("fused") for g in groups):
            return {FOR_LOOP: False, FOREACH: True}
        return {AS_SET: None}

    def warm_up_optimizer(self) -> None:
        """Create the state a steady-state step starts with, in every optimizer."""
        for opt in self.optimizers:
            trainable = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
            if trainable and all(p in opt.state and opt.state[p] for p in trainable):
                continue
            sparse = _sparse_gradient_params(self.model)
            for p in trainable:  # a sparse layer's gradient is sparse (SparseAdam takes no other)
                p.grad = _empty_sparse_like(p) if id(p) in sparse else torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)


def _sparse_gradient_params(model: nn.Module) -> set[int]:
    """``id`` of the parameters whose gradient is sparse: ``Embedding``/``EmbeddingBag(sparse=True)``."""
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }


def _empty_sparse_like(p: torch.Tensor) -> torch.Tensor:
    """A sparse COO gradient of ``p`` with no rows (the optimizer's state is made, nothing updated)."""
    indices = torch.empty((1, 0), dtype=torch.int64)
    values = torch.empty((0, *p.shape[1:]), dtype=p.dtype)
    return torch.sparse_coo_tensor(indices, values, p.shape)


@dataclass
class TargetForward:
    """How the forward pass is traced as on the target: the policy and the attention kernels used."""

    target: Target
    autocast: str  # "cuda" (emulated), "cpu" (torch.autocast("cpu")) or "none"
    attention: Counter[str] = field(default_factory=Counter)
    casts: Counter[str] = field(default_factory=Counter)
    recompute_mode: CudaAutocast | None = None
    in_forward: bool = False
    _saved: tuple[Any, Any] | None = None
    _regions: contextlib.ExitStack | None = None

    def __enter__(self) -> TargetForward:
        """Within: activation checkpointing recomputes under the target's policy (see ``recompute``),
        and autocast regions the model opens (also in backward: ``custom_bwd``) address the emulated
        CUDA autocast (:mod:`~resource_guard.estimate.emulate.autocast_regions`); all undone on exit."""
        if self.recompute_mode is not None:
            with contextlib.ExitStack() as stack:
                stack.enter_context(applied(AutocastState.now()))  # whatever a leaked region leaves
                stack.enter_context(routed())
                ckpt = torch.utils.checkpoint
                self._saved = (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction)
                ckpt._checkpoint_without_reentrant_generator = _recomputing(self, self._saved[0])
                ckpt.CheckpointFunction = _ReentrantRecompute.of(self, self._saved[1])  # type: ignore[misc,assignment]
                self._regions = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            ckpt = torch.utils.checkpoint
            ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = self._saved  # type: ignore[misc]
            self._saved = None
        if self._regions is not None:
            regions, self._regions = self._regions, None
            regions.close()

    def describe(self, precision: str) -> str:
        """``"as on cuda sm80 (a100-40gb), 16-mixed, autocast policy: cuda, attention: flash×24"``."""
        text = f"as on {self.target.describe()}, {precision}, autocast policy: {self.autocast}"
        if self.attention:
            text += ", attention: " + ", ".join(f"{k}×{n}" for k, n in sorted(self.attention.items()))
        return text

    def recompute(self, fn: Any) -> Any:
        """``fn`` as a checkpointed block runs it: as is in forward; when recomputed, under the target's
        policy in the autocast state of its forward (also inside a region the model opened), as
        ``torch.utils.checkpoint`` restores it on CUDA."""
        mode = self.recompute_mode
        state = AutocastState.now()  # called as the checkpoint starts, in forward

        def run(*args: Any, **kwargs: Any) -> Any:
            if self.in_forward or mode is None:
                return fn(*args, **kwargs)
            with mode, applied(state):  # a function mode does not reach into autograd's backward
                return fn(*args, **kwargs)

        return run


# ``torch.utils.checkpoint`` re-runs a block in backward under the autocast state of its forward, which
# here is CUDA's only through the emulation, and function modes do not reach into backward. So, while a
# CUDA-like trace runs, the two private entry points through which every checkpoint call (also a
# ``functools.partial`` bound before the trace, as transformers keeps) hands over its function are
# wrapped. tests/estimate/test_target.py fails loudly if they move.
def _recomputing(record: TargetForward, generator: Any) -> Any:
    def wrapped(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return generator(record.recompute(fn), *args, **kwargs)

    return wrapped


class _ReentrantRecompute:
    record: TargetForward
    original: Any

    @classmethod
    def of(cls, record: TargetForward, original: Any) -> type[_ReentrantRecompute]:
        return type("CheckpointFunction", (cls,), {"record": record, "original": original})

    @classmethod
    def apply(cls, function: Any, *args: Any) -> Any:
        return cls.original.apply(cls.record.recompute(function), *args)


def target_forward(
    target: Target, spec: PrecisionSpec, loss_fn: LossFn | None
) -> tuple[PrecisionSpec, LossFn | None, TargetForward]:
    """The precision and loss function to hand ``training_step`` so its forward runs as on ``target``.

    On a CUDA-like target the forward runs under
    :class:`~resource_guard.estimate.emulate.cuda_autocast.CudaAutocast`
    (CUDA's op lists, emulated; the CPU autocast of ``training_step`` is switched off by handing it the
    precision without autocast) and ``scaled_dot_product_attention`` runs the kernel the target would
    pick (:mod:`resource_guard.estimate.emulate.attention`); in backward, only what activation checkpointing
    recomputes, while the record is entered as a context. Autocast regions the model opens inside are
    honoured as on the GPU (:mod:`resource_guard.estimate.emulate.autocast_regions`). The optimizer step and
    loss scaling are unchanged. Other targets trace as they are.
    """
    if not target.cuda_like:
        return spec, loss_fn, TargetForward(target, "cpu" if spec.autocast_dtype else "none")
    record = TargetForward(target, "cuda" if spec.autocast_dtype else "none")
    mode = CudaAutocast(spec.autocast_dtype, attention_for(target, record.attention))
    record.casts = mode.calls
    record.recompute_mode = CudaAutocast(spec.autocast_dtype, attention_for(target, Counter()), cache=False)
    inner = loss_fn or default_loss_fn

    def forward(model: nn.Module, batch: Any) -> Any:
        record.in_forward = True
        try:
            with mode:
                return inner(model, batch)
        finally:
            record.in_forward = False

    return dataclasses.replace(spec, autocast_dtype=None), forward, record


@contextlib.contextmanager
def isolated_global_state() -> Iterator[None]:
    """Trace in a training step's global state and give the caller back exactly the state it had.

    A step needs autograd and sets its own autocast (``precision``), so the caller's ``no_grad``,
    ``inference_mode``, CPU autocast and anomaly detection are switched off inside. The CPU RNG
    (never the CUDA one: that would initialise CUDA), Python's and numpy's RNG, the default dtype,
    the deterministic-algorithms and anomaly flags and the thread count are restored afterwards, also
    when the user's code changed them or raised halfway. Called inside the caller's own autocast
    region, the step's autocast is a nested region, whose cache of low-precision weight copies PyTorch
    only frees when the outermost region ends: the estimate then keeps those copies to the end of the
    step (conservative).
    """
    numpy = sys.modules.get("numpy")
    # autocast off by flag, not by a nested `torch.autocast(enabled=False)`: that would make the step's
    # own autocast an inner region, whose weight-cast cache lives on until the outer region ends
    cpu_autocast = torch.is_autocast_enabled("cpu")
    saved = (
        torch.get_default_dtype(),
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_anomaly_enabled(),
        torch.is_anomaly_check_nan_enabled(),
        random.getstate(),
        numpy.random.get_state() if numpy is not None else None,
    )
    try:
        torch.set_autocast_enabled("cpu", False)
        torch.set_anomaly_enabled(False)  # its NaN checks read values of fake tensors; no memory effect
        with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        torch.set_autocast_enabled("cpu", cpu_autocast)
        dtype, threads, deterministic, warn_only, anomaly, check_nan, py_rng, np_rng = saved
        torch.set_default_dtype(dtype)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_anomaly_enabled(anomaly, check_nan)
        random.setstate(py_rng)
        if numpy is not None:
            numpy.random.set_state(np_rng)
