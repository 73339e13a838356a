"""What this CPU can run: the capability probes (each module call probed as the step makes it), how
the estimator uses them (a warning for a step this CPU cannot run, "unknown" where no probe takes the
step's path, no per-shape GEMM probes where oneDNN does not pack), and the probe against the real
module path on this CPU and under each ``ONEDNN_MAX_CPU_ISA`` cap (AVX2, AVX-512 core, AVX-512 with
bf16), which play the other x86-64 CPUs of this machine kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from resource_guard import estimate_memory
from resource_guard.devices import play_cpu
from resource_guard.devices.cpu import process_cpu_profile
from resource_guard.estimate.host import cpu_support, kernels
from resource_guard.estimate.host.cpu_support import (
    CpuKernelSupport,
    RecurrentCall,
    probe_recurrent,
    reduced_gemm_packs,
)

ROOT = Path(__file__).resolve().parents[2]
AVX2 = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: the caps CI runs the ``cpu_reference`` tests under (.ci/run); "" is this machine uncapped
CAPS = ("", "AVX2", "AVX512_CORE", "AVX512_CORE_BF16")


def _lstm() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, object]:
    torch.manual_seed(0)
    model = nn.LSTM(8, 16, batch_first=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 5, 8), _first_sum


def _first_sum(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b)[0].float().sum()


def _est(model: nn.Module, batch: object, precision: str = "32-true", loss_fn: object = _first_sum, **kw):
    return estimate_memory(model, torch.optim.SGD, batch, loss_fn, precision=precision, **kw)  # type: ignore[arg-type]


def test_fp32_recurrent_calls_run_and_fp32_gemms_do_not_pack() -> None:
    for mode in ("LSTM", "GRU", "RNN_TANH", "RNN_RELU"):
        answer = probe_recurrent(RecurrentCall(mode, torch.float32, torch.float32, None))
        assert answer.runs is True and answer.reason is None, answer
    assert reduced_gemm_packs(torch.float32) is False


def test_gemm_probe_agrees_with_torchs_own_onednn_check_and_the_cpu_profile() -> None:
    """On this CPU and under each cap CI runs (the whole suite under AVX2): the real probe, torch's own
    check and the profile's rule (what a played profile answers with) agree, in bf16 and fp16."""
    assert not process_cpu_profile().played
    for dtype, torch_says in (
        (torch.bfloat16, torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        (torch.float16, torch.ops.mkldnn._is_mkldnn_fp16_supported()),
    ):
        rule = process_cpu_profile().onednn_runs(dtype)
        assert reduced_gemm_packs(dtype) == torch_says, (dtype, process_cpu_profile().summary())
        assert rule is None or rule == torch_says, (dtype, process_cpu_profile().summary())


@pytest.mark.parametrize(
    ("isa", "bf16", "fp16"),
    [("avx2", False, False), ("avx512_core", True, False), ("avx512_core_amx", True, False),
     ("avx10_1_512", True, True)],
)  # fmt: skip
def test_a_played_cpu_answers_the_gemm_question_from_its_profile(isa: str, bf16: bool, fp16: bool) -> None:
    with play_cpu(isa):
        assert (reduced_gemm_packs(torch.bfloat16), reduced_gemm_packs(torch.float16)) == (bf16, fp16)
        assert reduced_gemm_packs(torch.float32) is False


def test_the_key_is_the_call_as_the_step_makes_it() -> None:
    """Autocast, grad and training mode, and the settings that change the path, are read at the call."""
    seen: list[RecurrentCall] = []
    lstm = nn.LSTM(4, 6, num_layers=2, bidirectional=True, proj_size=3)
    lstm.register_forward_pre_hook(lambda m, a, k: seen.append(RecurrentCall.of(m, a, k)), with_kwargs=True)
    x = torch.randn(5, 2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "LSTM with projections is not supported with oneDNN"
        lstm(x)
    lstm.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lstm(input=nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 3])))
    gru = nn.GRU(4, 6, bias=False).to(torch.float16)
    gru.register_forward_pre_hook(lambda m, a, k: seen.append(RecurrentCall.of(m, a, k)), with_kwargs=True)
    gru(x.half())
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    common = {"bidirectional": True, "stacked": True, "projected": True}
    assert seen == [
        RecurrentCall("LSTM", f32, f32, bf16, **common),
        RecurrentCall("LSTM", f32, f32, None, training=False, grad=False, packed=True, **common),
        RecurrentCall("GRU", f16, f16, None, bias=False),
    ]
    said = "nn.LSTM in fp32 under bf16 autocast, bidirectional, stacked, projected, training"
    assert seen[0].describe() == said
    assert seen[1].describe().endswith("packed input, eval, no grad")
    assert seen[0].kernel_dtype == bf16 and seen[2].kernel_dtype == f16


def test_the_probe_takes_no_random_numbers_and_runs_inside_a_trace() -> None:
    before = torch.random.get_rng_state()
    call = RecurrentCall("RNN_RELU", torch.float32, torch.float32, torch.bfloat16, bidirectional=True,
                         stacked=True, bias=False, packed=True)  # fmt: skip
    assert probe_recurrent(call).runs is True
    assert torch.equal(torch.random.get_rng_state(), before)
    est = _est(nn.GRU(3, 5), torch.randn(4, 2, 3), "bf16-mixed", device="cpu")  # probes inside the trace
    assert est.method == "traced" and est.cpu_unsupported == est.cpu_unknown == ()


class _ThreeLstms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstms = nn.ModuleList(nn.LSTM(8, 16 * (i + 1), batch_first=True) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(lstm(x)[0].float().sum() for lstm in self.lstms)  # type: ignore[return-value]


def test_calls_that_differ_only_in_shape_share_one_key(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[RecurrentCall] = []
    monkeypatch.setattr(cpu_support, "_run_tiny", runs.append)
    monkeypatch.setattr(cpu_support, "probe_recurrent", cpu_support.probe_recurrent.__wrapped__)  # no cache
    _est(_ThreeLstms(), torch.randn(2, 5, 8), "bf16-mixed", lambda m, b: m(b), device="cpu")
    assert runs == [RecurrentCall("LSTM", torch.float32, torch.float32, torch.bfloat16)] * 3


def test_estimate_says_when_this_cpu_cannot_run_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_bf16(call: RecurrentCall) -> CpuKernelSupport:
        runs = call.kernel_dtype != torch.bfloat16
        return CpuKernelSupport(call.describe(), runs, None if runs else "needs AVX-512 (simulated)")

    monkeypatch.setattr(cpu_support, "probe_recurrent", no_bf16)
    model, opt, batch, loss_fn = _lstm()
    est = estimate_memory(model, opt, batch, loss_fn, precision="bf16-mixed", device="cpu")
    assert est.method == "traced"
    said = "nn.LSTM in fp32 under bf16 autocast, training (needs AVX-512 (simulated))"
    assert est.cpu_unsupported == (said,) and est.cpu_unknown == ()
    assert f"this CPU cannot run the step: {said}" in est.warnings
    assert est.to_dict()["cpu_unsupported"] == list(est.cpu_unsupported)
    fp32 = estimate_memory(model, opt, batch, loss_fn, device="cpu")
    cuda = estimate_memory(model, opt, batch, loss_fn, precision="bf16-mixed", device="cuda")
    assert fp32.cpu_unsupported == cuda.cpu_unsupported == ()  # fp32 runs; a GPU target is not this CPU


class _DirectLstm(nn.Module):
    """Calls the LSTM operator itself, past ``nn.LSTM``'s module call: no probe takes that path."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = (x.new_zeros(1, x.shape[1], 16), x.new_zeros(1, x.shape[1], 16))
        return torch.lstm(x, state, self.lstm._flat_weights, True, 1, 0.0, True, False, False)[0]


def test_an_operator_outside_every_probed_call_is_unknown_not_runs() -> None:
    est = _est(_DirectLstm(), torch.randn(5, 2, 8), device="cpu")
    assert est.method == "traced" and est.cpu_unsupported == ()
    (unknown,) = est.cpu_unknown
    assert unknown.startswith("aten.mkldnn_rnn_layer in fp32 (called outside nn.LSTM, and no probe takes")
    assert f"this CPU may not run the step (unknown): {unknown}" in est.warnings
    assert est.to_dict()["cpu_unknown"] == [unknown]
    assert _est(_DirectLstm(), torch.randn(5, 2, 8), device="cuda").cpu_unknown == ()


def test_a_probe_that_cannot_run_is_unknown_and_the_trace_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(call: RecurrentCall) -> CpuKernelSupport:
        raise ValueError("boom")

    monkeypatch.setattr(cpu_support, "probe_recurrent", broken)
    est = _est(nn.GRU(3, 5), torch.randn(4, 2, 3), "bf16-mixed", device="cpu")
    assert est.method == "traced" and est.cpu_unsupported == ()
    assert est.cpu_unknown == ("nn.GRU (its probe could not be run (ValueError: boom))",)


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = kernels._probe

    def counting(func, args, kwargs, size_of):  # type: ignore[no-untyped-def]
        seen.append(str(func))
        return real(func, args, kwargs, size_of)

    monkeypatch.setattr(kernels, "_probe", counting)
    monkeypatch.setattr(kernels, "_CACHE", {})
    return seen


@pytest.mark.parametrize(("isa", "packs"), [("avx512_core", True), ("avx2", False)])
def test_reduced_gemms_are_probed_only_where_onednn_packs_them(
    monkeypatch: pytest.MonkeyPatch, isa: str, packs: bool
) -> None:
    seen = _count_probes(monkeypatch)
    monkeypatch.setattr(cpu_support, "_reduced_gemm_packs", lambda dtype: True)  # probes may run here
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    with play_cpu(isa):  # the decision reads the CPU profile
        estimate_memory(model, torch.optim.SGD, torch.randn(32, 64), lambda m, b: m(b).float().sum(),
                        precision="bf16-mixed", device="cpu")  # fmt: skip
    gemms = [f for f in seen if f.split(".")[1] in ("mm", "addmm")]
    assert bool(gemms) is packs


@pytest.mark.parametrize("process_packs", [True, False])
def test_a_played_cpu_that_packs_gets_the_packing_allowance(
    monkeypatch: pytest.MonkeyPatch, process_packs: bool
) -> None:
    """A played AVX-512 CPU packs bf16 GEMMs: where this process's oneDNN packs too, the GEMM is probed;
    where it does not (an AVX2 machine), the rule of thumb stands in (a probe would measure ATen's loop)."""
    monkeypatch.setattr(cpu_support, "_reduced_gemm_packs", lambda dtype: process_packs)
    seen = _count_probes(monkeypatch)
    monkeypatch.setattr(kernels, "_probe", lambda *a: seen.append("probe") or kernels.KernelExtra(123))
    with torch.device("meta"):
        a, b = torch.empty(64, 128, dtype=torch.bfloat16), torch.empty(128, 32, dtype=torch.bfloat16)
        out = a @ b
    with play_cpu("avx512_core"):
        extra = kernels.kernel_extra(torch.ops.aten.mm.default, (a, b), {}, out, lambda t: None)
    assert extra is not None
    if process_packs:
        assert (extra.scratch_bytes, seen) == (123, ["probe"])
    else:
        assert (extra.scratch_bytes, seen) == (int(64 * 128 * 2 * 1.5), [])
    with play_cpu("avx2"):
        assert kernels.kernel_extra(torch.ops.aten.mm.default, (a, b), {}, out, lambda t: None) is None


def test_large_flash_attention_probe_is_cut_and_extrapolated_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    b, h, t, d = 2, 12, 512, 64
    with torch.device("meta"):
        q = torch.empty(b, h, t, d, dtype=torch.bfloat16)
        args = (q, q, q, q, q, torch.empty(b, h, t), 0.0, True)
    assert b * h * 12 * t * t * d > kernels.PROBE_BUDGET_FLOPS  # the full probe is over budget
    full = kernels._probe(op, args, {}, lambda _: None)
    seen = _count_probes(monkeypatch)
    cut = kernels._reduced_probe(op, args, {}, lambda _: None)
    assert len(seen) == 2  # at one head per thread and at two
    assert cut.scratch_bytes == full.scratch_bytes > 0


# -- the probe against the real module path, on this CPU and under each cap ------------------------
_AGREEMENT = textwrap.dedent(
    """
    import json
    import torch
    from torch import nn
    from resource_guard import estimate_memory
    from resource_guard.estimate.host.cpu_support import reduced_gemm_packs
    from resource_guard.step.precision import parse_precision
    from resource_guard.step.training import training_step

    class Net(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.rnn, self.head = kind(3, 4, batch_first=True), nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    def loss(m, b):
        return m(b).float().square().mean()

    rows = []
    for kind in (nn.LSTM, nn.GRU):
        for precision in ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"):
            spec = parse_precision(precision)
            torch.manual_seed(0)
            model = Net(kind).to(spec.param_dtype)
            batch = torch.randn(2, 5, 3, dtype=spec.param_dtype)
            est = estimate_memory(model, torch.optim.SGD, batch, loss, precision=precision, device="cpu")
            try:  # the library's own real step, as guard runs it
                scale = 2.0**16 if spec.loss_scaling else None
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                training_step(model, opt, batch, loss, spec, "cpu", loss_scale=scale)
                error = None
            except RuntimeError as exc:
                error = str(exc).strip().splitlines()[0][:200]
            rows.append({"kind": kind.__name__, "precision": precision, "method": est.method,
                         "unsupported": est.cpu_unsupported, "unknown": est.cpu_unknown, "error": error})
    print(json.dumps({"rows": rows, "bf16_gemm_packs": reduced_gemm_packs(torch.bfloat16)}))
    """
)


@pytest.mark.slow
def test_the_probe_and_the_real_module_path_agree_on_this_cpu_and_under_each_cap() -> None:
    """LSTM and GRU in fp32, bf16 and fp16 (mixed and true): the estimate says this CPU cannot run the
    step exactly where the real step raises, here and under each cap (one process per cap: oneDNN
    reads the cap once per process)."""
    env = {cap: {**os.environ, "ONEDNN_MAX_CPU_ISA": cap} for cap in CAPS if cap}
    env[""] = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    runs = {
        cap: subprocess.Popen(
            [sys.executable, "-c", _AGREEMENT],
            env=env[cap],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for cap in CAPS
    }
    results = {}
    for cap, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (cap, err[-3000:])
        results[cap] = json.loads(out.strip().splitlines()[-1])
    for cap, result in results.items():
        assert len(result["rows"]) == 10
        for row in result["rows"]:
            where = f"{row['kind']} {row['precision']} under ONEDNN_MAX_CPU_ISA={cap or '(none)'}"
            assert row["method"] == "traced", where
            assert row["unknown"] == [], (where, row)  # every call went through a probed module
            if row["error"] is None:
                assert row["unsupported"] == [], f"{where}: the real step runs, the probe says not: {row}"
            else:
                assert row["unsupported"], f"{where}: the real step raised, the probe says it runs: {row}"
                assert row["error"].split(". ")[0][:60] in row["unsupported"][0]  # the kernel's own words
    # the AVX2 cap plays an AVX2-only CPU whatever the hardware: no bf16 LSTM kernel, no bf16 GEMM packing
    avx2 = {(r["kind"], r["precision"]): r for r in results["AVX2"]["rows"]}
    (why,) = avx2["LSTM", "bf16-mixed"]["unsupported"]
    assert why.startswith("nn.LSTM in fp32 under bf16 autocast, training (oneDNN's bf16 LSTM needs AVX-512")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in why
    assert results["AVX2"]["bf16_gemm_packs"] is False


@pytest.mark.slow
def test_real_step_comparisons_skip_with_the_reason_on_an_avx2_cpu() -> None:
    """The README's test command on an AVX2-only CPU: the bf16 LSTM comparison skips, naming why; the
    other bf16 comparisons still run against the real step (and pass: no packing scratch there)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/estimate/test_estimate.py::test_estimate_matches_real_cpu_step", "-k", "bf16"],
        cwd=ROOT, env=AVX2, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:]
    assert "2 passed, 1 skipped" in out, out[-3000:]
    assert "this CPU cannot run the reference step: nn.LSTM in fp32 under bf16 autocast" in out
    assert "needs AVX-512" in out


def test_gpu_target_low_precision_convolutions_are_not_probed_on_this_cpu(monkeypatch) -> None:
    """A CPU kernel in fp16 says nothing of cuDNN's workspace and is very slow here: the rule stands."""
    from resource_guard.estimate.host import kernels

    probed: list[object] = []
    monkeypatch.setattr(
        kernels, "_reduced_probe", lambda func, *a, **k: probed.append(func) or kernels.KernelExtra(0)
    )
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten())
    batch = torch.randn(4, 3, 16, 16)
    for precision in ("16-mixed", "bf16-mixed"):
        est = estimate_memory(
            model, torch.optim.SGD, batch, lambda m, b: m(b).float().mean(), precision=precision, device="t4"
        )
        assert est.traced
    assert probed == []
    estimate_memory(model, torch.optim.SGD, batch, lambda m, b: m(b).mean(), precision="32-true", device="t4")
    assert probed  # fp32 kernels are still probed (their scratch is the same kind on the target)
