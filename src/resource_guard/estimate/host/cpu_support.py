"""What this machine's CPU can run of a training step, probed on the path the step itself takes.

oneDNN chooses its CPU kernels by instruction set, so whether a step runs differs between x86-64 CPUs
of the same kind (an AVX2 EPYC, an AVX-512 EPYC, an AMX Xeon). oneDNN's LSTM is the case met so far:
under bf16 autocast it has no kernel without AVX-512, under fp16 autocast none on most CPUs, and a
real step raises "could not create a primitive descriptor for the LSTM forward propagation
primitive". Which operators a module call reaches, and in which dtype, depends on autocast, grad mode
and the module's settings, so an internal operator probed with hand-written arguments can say "runs"
where the step fails (it did, on an AMX Xeon). Hence the rule here:

- **A module call is probed as the step makes it.** :class:`CpuStepCheck` watches the traced step's
  recurrent modules (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``); at each call it reduces the call to what
  chooses the kernel (:class:`RecurrentCall`: the family, dtypes, CPU autocast, training and grad
  mode, and the settings that change the path) and :func:`probe_recurrent` runs that same call on
  a tiny real module (2 features, 3 steps, batch 2) under the same autocast, forward and backward,
  once per process and key.
- **No probe means "unknown", not "runs".** An operator whose CPU kernel may be missing
  (:data:`MAY_LACK_KERNEL`), reached outside every probed module call (a direct ``torch.lstm`` or
  ``_VF`` call), is answered ``runs=None``.

:func:`reduced_gemm_packs` tells whether reduced-precision GEMMs go through oneDNN, which packs
operands into scratch, or through ATen's own loop, which allocates nothing (and is too slow to probe
per shape).

**One CPU profile.** These answers are host-dependent decisions, so they read the one CPU profile
(:func:`~resource_guard.devices.cpu.cpu_profile`), which honours ``ONEDNN_MAX_CPU_ISA`` as
oneDNN does. On the process's own profile every answer comes from a tiny real kernel (oneDNN applies the
cap to the kernels too, so a cap plays a lower CPU here as well), and a test checks that the profile's
rule (:meth:`~resource_guard.devices.cpu.CpuProfile.onednn_runs`) agrees with it on every CPU
and cap CI meets. Under a played profile (:func:`~resource_guard.devices.cpu.play_cpu`) no real
kernel can run another CPU, so :func:`reduced_gemm_packs` answers from that rule, while
:func:`probe_recurrent`, which asks whether a kernel runs, answers for the process's own CPU and names it.

Example:
    >>> import torch
    >>> call = RecurrentCall("LSTM", torch.float32, torch.float32, autocast_dtype=None)
    >>> probe_recurrent(call).runs
    True
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from resource_guard.devices.cpu import cpu_profile, process_cpu_profile
from resource_guard.estimate.host.measure import allocation_deltas
from resource_guard.estimate.host.quiet import quiet_profile

__all__ = [
    "MAY_LACK_KERNEL",
    "CpuKernelSupport",
    "CpuStepCheck",
    "RecurrentCall",
    "probe_recurrent",
    "reduced_gemm_packs",
]

_REDUCED = (torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
_FAMILIES = {"LSTM": "nn.LSTM", "GRU": "nn.GRU", "RNN_TANH": "nn.RNN(tanh)", "RNN_RELU": "nn.RNN(relu)"}

#: operators whose CPU kernel may not exist, with the module calls whose probe covers them (their
#: backward is not listed: it runs only after its forward)
MAY_LACK_KERNEL = {"aten.mkldnn_rnn_layer": "nn.LSTM"}

#: what an error of a probe most likely means, by family and the dtype the kernel runs in
_HINTS = {("LSTM", torch.bfloat16): "oneDNN's bf16 LSTM needs AVX-512"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class CpuKernelSupport:
    """Whether this CPU runs ``call``: ``runs`` is ``True``, ``False`` (``reason``: the kernel's error)
    or ``None``, unknown (no probe takes that path; ``reason`` says what was seen)."""

    call: str
    runs: bool | None
    reason: str | None = None

    def describe(self) -> str:
        """``"nn.LSTM in fp32 under bf16 autocast, training (oneDNN's bf16 LSTM needs AVX-512; …)"``."""
        return self.call if self.runs else f"{self.call} ({self.reason})"


@dataclass(frozen=True)
class RecurrentCall:
    """One recurrent module call of a step, reduced to what chooses its CPU kernel: a probe's key.

    Attributes:
        mode: ``nn.RNNBase.mode``: ``"LSTM"``, ``"GRU"``, ``"RNN_TANH"`` or ``"RNN_RELU"``.
        dtype / input_dtype: the parameters' and the input's dtype (``*-true`` precisions: reduced).
        autocast_dtype: CPU autocast's dtype at the call (``*-mixed``), ``None`` where autocast is off.
        training: ``module.training`` (oneDNN builds a training or an inference primitive).
        grad: backward runs through the call (grad mode on, something requiring grad); ATen's LSTM
            takes oneDNN in fp16 only without grad.
        bias / bidirectional / stacked (``num_layers > 1``) / projected (``proj_size > 0``, which takes
            LSTM off oneDNN) / packed (a ``PackedSequence`` input): the settings that change the path.
    """

    mode: str
    dtype: torch.dtype
    input_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    training: bool = True
    grad: bool = True
    bias: bool = True
    bidirectional: bool = False
    stacked: bool = False
    projected: bool = False
    packed: bool = False

    @classmethod
    def of(cls, module: nn.RNNBase, args: tuple, kwargs: dict) -> RecurrentCall:
        """The call ``module(*args, **kwargs)`` as the step makes it now (autocast, grad mode)."""
        x = args[0] if args else kwargs.get("input")
        packed = isinstance(x, PackedSequence)
        data = x.data if isinstance(x, PackedSequence) else x
        params = list(module.parameters(recurse=False))
        if not isinstance(data, torch.Tensor) or not params:
            raise TypeError(f"{type(module).__name__} called without a tensor input or parameters")
        autocast = torch.is_autocast_enabled("cpu")
        return cls(
            mode=module.mode,
            dtype=params[0].dtype,
            input_dtype=data.dtype,
            autocast_dtype=torch.get_autocast_dtype("cpu") if autocast else None,
            training=module.training,
            grad=torch.is_grad_enabled() and (data.requires_grad or any(p.requires_grad for p in params)),
            bias=module.bias,
            bidirectional=module.bidirectional,
            stacked=module.num_layers > 1,
            projected=getattr(module, "proj_size", 0) > 0,
            packed=packed,
        )

    @property
    def kernel_dtype(self) -> torch.dtype:
        """The dtype the kernel runs in: autocast's where it is on, else the parameters'."""
        return self.autocast_dtype or self.dtype

    def describe(self) -> str:
        """``"nn.LSTM in fp32 under bf16 autocast, training"``, with the settings that are not the default."""
        text = f"{_FAMILIES.get(self.mode, self.mode)} in {_dtype_name(self.dtype)}"
        if self.input_dtype != self.dtype:
            text += f" (input {_dtype_name(self.input_dtype)})"
        if self.autocast_dtype is not None:
            text += f" under {_dtype_name(self.autocast_dtype)} autocast"
        settings = [
            name
            for name, on in (
                ("bidirectional", self.bidirectional),
                ("stacked", self.stacked),
                ("projected", self.projected),
                ("packed input", self.packed),
                ("no bias", not self.bias),
            )
            if on
        ]
        settings.append(("training" if self.training else "eval") + ("" if self.grad else ", no grad"))
        return f"{text}, {', '.join(settings)}"


def _tiny_module(call: RecurrentCall) -> nn.RNNBase:
    """A module of ``call``'s family and settings, 2 features wide, weights set without the RNG."""
    kwargs: dict[str, Any] = {
        "num_layers": 2 if call.stacked else 1,
        "bias": call.bias,
        "bidirectional": call.bidirectional,
        "device": "meta",
        "dtype": call.dtype,
    }
    module: nn.RNNBase
    if call.mode == "LSTM":
        module = nn.LSTM(2, 2, proj_size=1 if call.projected else 0, **kwargs)
    elif call.mode == "GRU":
        module = nn.GRU(2, 2, **kwargs)
    else:
        module = nn.RNN(2, 2, nonlinearity="relu" if call.mode == "RNN_RELU" else "tanh", **kwargs)
    module = module.to_empty(device="cpu")
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(0.125)
    module.train(call.training)
    module.requires_grad_(call.grad)
    return module


def _run_tiny(call: RecurrentCall) -> None:
    """``call`` on a tiny real module: forward, and backward where the step runs one."""
    module = _tiny_module(call)
    steps = torch.full((3, 2, 2), 0.5, dtype=call.input_dtype)
    x = pack_padded_sequence(steps, torch.tensor([3, 2])) if call.packed else steps
    on = call.autocast_dtype is not None
    autocast = torch.autocast("cpu", dtype=call.autocast_dtype or torch.bfloat16, enabled=on)
    with torch.set_grad_enabled(call.grad), autocast:
        out = module(x)[0]
        data = out.data if isinstance(out, PackedSequence) else out
        loss = data.float().sum()
    if call.grad:
        loss.backward()


@functools.cache
def probe_recurrent(call: RecurrentCall) -> CpuKernelSupport:
    """Whether this CPU runs ``call``, by running it on a tiny real module; cached per process.

    Safe inside a fake-tensor trace: the probe runs on real tensors with every dispatch mode off, and
    touches no RNG. The answer is ``False`` when the kernel raises, with its first line as the reason.
    """
    try:
        with _disable_current_modes(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run_tiny(call)
    except (RuntimeError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:160]
        hint = _HINTS.get((call.mode, call.kernel_dtype))
        cpu = process_cpu_profile().summary()  # the CPU the kernel ran on, even under a played profile
        why = f"{hint}; this CPU: {cpu}" if hint else f"this CPU: {cpu}"
        return CpuKernelSupport(call.describe(), False, f"{why}; the kernel says: {first}")
    return CpuKernelSupport(call.describe(), True)


class CpuStepCheck:
    """What this CPU can run of one traced step: every recurrent module call probed as it is made.

    :meth:`watch` hooks the (fake) model's recurrent modules for the trace; :meth:`saw_op` is told each
    operator the trace runs, so an operator of :data:`MAY_LACK_KERNEL` outside a probed call is answered
    "unknown". :attr:`unsupported` and :attr:`unknown` hold the answers that are not "runs".
    """

    def __init__(self) -> None:
        self._answers: list[CpuKernelSupport] = []
        self._inside = 0

    def watch(self, model: nn.Module) -> list[RemovableHandle]:
        """Hook ``model``'s recurrent modules (the trace's own copy); the caller removes the handles."""
        handles = []
        for module in model.modules():
            if isinstance(module, nn.RNNBase) and module.mode in _FAMILIES:
                handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
                handles.append(module.register_forward_hook(self._leave, always_call=True))
        return handles

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._inside += 1
        try:
            answer = probe_recurrent(RecurrentCall.of(module, args, kwargs))  # type: ignore[arg-type]
        except Exception as exc:  # the check must never break the trace: say it is unknown
            reason = f"its probe could not be run ({type(exc).__name__}: {str(exc)[:160]})"
            answer = CpuKernelSupport(f"nn.{type(module).__name__}", None, reason)
        self._add(answer)

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._inside -= 1

    def saw_op(self, func: Any, args: tuple) -> None:
        """Note an operator of the step: one that may lack a kernel, outside a probed call, is unknown."""
        name = str(func).rsplit(".", 1)[0]  # aten.mkldnn_rnn_layer.default -> aten.mkldnn_rnn_layer
        covered_by = MAY_LACK_KERNEL.get(name)
        if covered_by is None or self._inside:
            return
        dtype = next((t.dtype for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), None)
        call = f"{name} in {_dtype_name(dtype)}" if dtype is not None else name
        cpu = cpu_profile().summary()
        reason = f"called outside {covered_by}, and no probe takes that path; this CPU: {cpu}"
        self._add(CpuKernelSupport(call, None, reason))

    def _add(self, answer: CpuKernelSupport) -> None:
        if answer.runs is not True and answer not in self._answers:
            self._answers.append(answer)

    @property
    def unsupported(self) -> tuple[CpuKernelSupport, ...]:
        """The calls this CPU was seen to fail, in the order the step made them."""
        return tuple(a for a in self._answers if a.runs is False)

    @property
    def unknown(self) -> tuple[CpuKernelSupport, ...]:
        """The calls no probe could answer."""
        return tuple(a for a in self._answers if a.runs is None)

    def notes(self) -> list[str]:
        """The estimate's warning lines: each call this CPU cannot run, then each no probe could answer."""
        return [f"this CPU cannot run the step: {u.describe()}" for u in self.unsupported] + [
            f"this CPU may not run the step (unknown): {u.describe()}" for u in self.unknown
        ]


def reduced_gemm_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's ``dtype`` (bf16/fp16) matmuls go through oneDNN, which allocates packing scratch.

    Probed once with a 64×64×64 matmul under the profiler: any allocation besides the output is
    scratch. ``False`` means ATen's own loop, which allocates nothing (an AVX2 CPU in bf16, most CPUs
    in fp16). If the probe cannot run (another profiler is active), ``True``: the per-shape probes,
    or their rule of thumb, stand — and the next call probes again. Under a played CPU profile
    (:func:`~resource_guard.devices.cpu.play_cpu`), the profile's rule answers
    (:meth:`~resource_guard.devices.cpu.CpuProfile.onednn_runs`; ``True`` where it is unknown).
    """
    if dtype not in _REDUCED:
        return False
    profile = cpu_profile()
    if profile.played:  # this process's oneDNN cannot run another CPU's kernels
        return profile.onednn_runs(dtype) is not False
    try:
        return _reduced_gemm_packs(dtype)
    except RuntimeError:
        return True


@functools.cache
def _reduced_gemm_packs(dtype: torch.dtype) -> bool:
    with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
        a = torch.zeros(64, 64, dtype=dtype)
        with quiet_profile() as prof:
            torch.mm(a, a)
        allocated = [size for _, size in allocation_deltas(prof) if size > 0]
    return len(allocated) > 1  # the output, and scratch
