"""Tests for resource_guard.devices.cpu: the CPU profile every host-dependent decision reads, on the CPUs
of this machine kind (flags as ``/proc/cpuinfo`` shows them) under each ``ONEDNN_MAX_CPU_ISA`` cap, the
``play_cpu`` seam, and every consumer honouring a real cap through the one profile (a subprocess per
cap: the profile, like oneDNN, reads its cap once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from resource_guard.devices import CpuProfile, cpu_profile, play_cpu
from resource_guard.devices import cpu as cpu_module
from resource_guard.devices.cpu import ISA_LEVELS, process_cpu_profile, read_cpu_profile

_AVX2 = "sse4_1 avx avx2 fma"
_AVX512 = f"{_AVX2} avx512f avx512bw avx512vl avx512dq"
_BF16 = f"{_AVX512} avx512_vnni avx512_bf16"
#: the CPUs met so far, as their ``/proc/cpuinfo`` flags (trimmed to what decides a level)
CPUS = {
    "AMD EPYC (Zen 3, AVX2)": f"model name : AMD EPYC 7B13\nflags : fpu {_AVX2}\n",
    "Intel Xeon (Skylake, AVX-512)": f"model name : Xeon 8173M\nflags : fpu {_AVX512}\n",
    "AMD EPYC (Zen 4, AVX-512 bf16)": f"model name : AMD EPYC 9B14\nflags : {_BF16}\n",
    "Intel Xeon (Sapphire Rapids, AMX)": (
        f"model name : Xeon 8481C\nflags : {_BF16} avx512_fp16 amx_tile amx_int8 amx_bf16\n"
    ),
}
#: per CPU: the level and native bf16 uncapped and under each cap CI plays
EXPECTED = {
    "AMD EPYC (Zen 3, AVX2)": {None: ("avx2", False), "AVX2": ("avx2", False), "AVX512_CORE": ("avx2", False),
                               "AVX512_CORE_BF16": ("avx2", False), "AVX512_CORE_AMX": ("avx2", False)},
    "Intel Xeon (Skylake, AVX-512)": {None: ("avx512_core", False), "AVX2": ("avx2", False),
                                      "AVX512_CORE": ("avx512_core", False),
                                      "AVX512_CORE_BF16": ("avx512_core", False),
                                      "AVX512_CORE_AMX": ("avx512_core", False)},
    "AMD EPYC (Zen 4, AVX-512 bf16)": {None: ("avx512_core_bf16", True), "AVX2": ("avx2", False),
                                       "AVX512_CORE": ("avx512_core", False),
                                       "AVX512_CORE_BF16": ("avx512_core_bf16", True),
                                       "AVX512_CORE_AMX": ("avx512_core_bf16", True)},
    "Intel Xeon (Sapphire Rapids, AMX)": {None: ("avx10_1_512_amx", True), "AVX2": ("avx2", False),
                                          "AVX512_CORE": ("avx512_core", False),
                                          "AVX512_CORE_BF16": ("avx512_core_bf16", True),
                                          "AVX512_CORE_AMX": ("avx512_core_amx", True)},
}  # fmt: skip


@pytest.mark.parametrize("cpu", list(CPUS))
@pytest.mark.parametrize("cap", [None, "AVX2", "AVX512_CORE", "AVX512_CORE_BF16", "AVX512_CORE_AMX"])
def test_a_cap_plays_a_lower_cpu_and_changes_nothing_above_the_hardware(cpu: str, cap: str | None) -> None:
    environ = {"ONEDNN_MAX_CPU_ISA": cap} if cap else {}
    profile = read_cpu_profile(CPUS[cpu], environ)
    uncapped = read_cpu_profile(CPUS[cpu], {})
    assert (profile.isa, profile.native_bf16) == EXPECTED[cpu][cap]
    assert profile.hardware_isa == uncapped.isa and profile.flags <= uncapped.flags
    assert profile.onednn_runs(torch.bfloat16) is (profile.isa != "avx2")  # AVX-512 core and up
    assert profile.amx is (profile.isa is not None and "amx" in profile.isa)
    if cap is None:
        assert profile.cap is profile.cap_source is None and profile.describe_cap() == ""
    elif profile.isa == uncapped.isa:  # at or above the hardware: the same CPU
        assert profile.flags == uncapped.flags and "no effect" in profile.describe_cap()
    else:
        assert profile.describe_cap() == f"ONEDNN_MAX_CPU_ISA={cap} (plays {profile.isa} on {uncapped.isa})"


def test_the_old_variable_name_is_honoured_and_the_new_one_wins() -> None:
    zen4 = CPUS["AMD EPYC (Zen 4, AVX-512 bf16)"]
    old = read_cpu_profile(zen4, {"DNNL_MAX_CPU_ISA": "AVX512_CORE"})
    assert (old.isa, old.native_bf16, old.cap_source) == ("avx512_core", False, "DNNL_MAX_CPU_ISA")
    both = read_cpu_profile(zen4, {"ONEDNN_MAX_CPU_ISA": "avx2", "DNNL_MAX_CPU_ISA": "AVX512_CORE"})
    assert (both.isa, both.cap, both.cap_source) == ("avx2", "avx2", "ONEDNN_MAX_CPU_ISA")  # any case


def test_a_cap_onednn_does_not_know_is_ignored_and_said() -> None:
    amx = CPUS["Intel Xeon (Sapphire Rapids, AMX)"]
    for cap, ignored in (("AVX9000", True), ("ALL", False), ("AVX10_2_512", False)):
        profile = read_cpu_profile(amx, {"ONEDNN_MAX_CPU_ISA": cap})
        assert profile.flags == read_cpu_profile(amx, {}).flags and profile.cap_ignored is ignored
    assert "not a oneDNN ISA: ignored" in read_cpu_profile(amx, {"ONEDNN_MAX_CPU_ISA": "AVX9000"}).summary()


def test_arm_and_unreadable_cpus() -> None:
    graviton3 = read_cpu_profile(
        "Features\t: fp asimd asimdhp bf16 i8mm sve\n", {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    )
    assert (graviton3.isa, graviton3.native_bf16, graviton3.native_fp16) == (None, True, True)
    assert graviton3.onednn_runs(torch.bfloat16) is None  # unknown: the probe answers
    nothing = read_cpu_profile(None, {})
    assert (nothing.isa, nothing.native_bf16, nothing.flags) == (None, False, frozenset())


def test_the_reason_text_names_the_cpu_its_isa_and_the_cap() -> None:
    amx = read_cpu_profile(CPUS["Intel Xeon (Sapphire Rapids, AMX)"], {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert amx.native_bf16_reason() == (
        "the CPU (Xeon 8481C; ISA avx2; ONEDNN_MAX_CPU_ISA=AVX2 (plays avx2 on avx10_1_512_amx)) has no "
        "native bf16 (avx512_bf16/amx_bf16): fp32"
    )
    zen4 = read_cpu_profile(CPUS["AMD EPYC (Zen 4, AVX-512 bf16)"], {})
    assert (
        zen4.native_bf16_reason()
        == "the CPU (AMD EPYC 9B14; ISA avx512_core_bf16) has native bf16 (avx512_bf16/amx_bf16)"
    )


def test_the_profile_is_read_once_per_process_and_frozen() -> None:
    assert cpu_profile() is cpu_profile() and process_cpu_profile() is process_cpu_profile()
    assert cpu_profile() is process_cpu_profile() or cpu_profile().played  # (pytest --play-cpu)
    with pytest.raises(AttributeError):
        cpu_profile().native_bf16 = True  # type: ignore[misc]


def test_play_cpu_plays_a_level_nests_and_puts_the_profile_back() -> None:
    own, before = process_cpu_profile(), cpu_profile()
    with play_cpu("AVX512_CORE_BF16") as bf16:
        assert cpu_profile() is bf16 and bf16.played and bf16.native_bf16 and bf16.isa == "avx512_core_bf16"
        assert bf16.flags == ISA_LEVELS["avx512_core_bf16"] and bf16.hardware_isa == own.isa
        with play_cpu("avx2") as avx2:
            assert cpu_profile() is avx2 and not avx2.native_bf16
        assert cpu_profile() is bf16
        assert process_cpu_profile() is own and not own.played  # the kernels' CPU is still this one
    assert cpu_profile() is before
    stack = list(cpu_module._played)
    with pytest.raises(ValueError, match=r"`play_cpu\('avx3'\)`: not a oneDNN ISA level; one of sse41, avx"):
        with play_cpu("avx3"):
            pass
    assert cpu_module._played == stack


def test_every_level_is_a_profile_of_its_own_level() -> None:
    for isa in ISA_LEVELS:
        with play_cpu(isa) as played:
            assert played.isa == isa, isa
    assert isinstance(played, CpuProfile)


# -- every consumer, through the one profile, under a real cap --------------------------------------
_CONSUMERS = textwrap.dedent(
    """
    import json
    import torch
    from torch import nn
    from resource_guard import plan
    from resource_guard.devices import cpu_profile, cpu_summary, resolve_device
    from resource_guard.estimate.analytic import _cpu_im2col
    from resource_guard.estimate.host.cpu_support import reduced_gemm_packs
    from resource_guard.step.precision import parse_precision

    made = plan(nn.Linear(8, 1), torch.optim.SGD, torch.randn(4, 8), lambda m, b: m(b).sum(), device="cpu")
    print(json.dumps({
        "isa": cpu_profile().isa, "native_bf16": cpu_profile().native_bf16,
        "precision": made.precision, "reasons": made.reasons,
        "device_bf16": resolve_device("cpu").bf16,
        "bf16_gemm_packs": reduced_gemm_packs(torch.bfloat16),
        "rule_bf16_gemm_packs": cpu_profile().onednn_runs(torch.bfloat16),
        "torch_onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        "im2col": _cpu_im2col(parse_precision("bf16-mixed"), "cpu"),
        "summary": cpu_summary(),
    }))
    """
)


def _consumers(cap: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    env.update({"ONEDNN_MAX_CPU_ISA": cap} if cap else {})
    done = subprocess.run(
        [sys.executable, "-c", _CONSUMERS], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_consumer_honours_the_avx2_cap_through_the_one_profile() -> None:
    """Under ``ONEDNN_MAX_CPU_ISA=AVX2`` whatever the hardware: the planner's fp32 plan and its reason,
    the ``cpu`` device's bf16, the GEMM allowance (its probe, its rule and torch's own oneDNN check
    agree), the analytic im2col allowance and the summary all say AVX2."""
    seen = _consumers("AVX2")
    assert (seen["isa"], seen["native_bf16"], seen["device_bf16"]) == ("avx2", False, False)
    assert seen["precision"] == "32-true"
    (why,) = [r for r in seen["reasons"] if r.startswith("precision")]
    assert "has no native bf16 (avx512_bf16/amx_bf16): fp32" in why and "ONEDNN_MAX_CPU_ISA=AVX2" in why
    assert seen["bf16_gemm_packs"] is seen["rule_bf16_gemm_packs"] is seen["torch_onednn_bf16"] is False
    assert seen["im2col"].startswith("this CPU's oneDNN (ISA avx2) has no bf16 kernels")
    assert "ISA avx2 " in seen["summary"] and "ONEDNN_MAX_CPU_ISA=AVX2" in seen["summary"]


def test_uncapped_on_a_bf16_host_the_plan_is_bf16_mixed() -> None:
    """The same consumers with no cap: bf16-mixed where this CPU has native bf16 (the played version of
    this test, which runs everywhere, is in tests/planning/test_plan.py)."""
    own = read_cpu_profile(cpu_module._read_cpuinfo(), {})  # the hardware: the subprocess runs uncapped
    if not own.native_bf16:
        pytest.skip(f"needs a CPU with native bf16; this CPU: {own.summary()}")
    seen = _consumers(None)
    assert (seen["precision"], seen["native_bf16"], seen["device_bf16"]) == ("bf16-mixed", True, True)
    assert seen["bf16_gemm_packs"] is seen["rule_bf16_gemm_packs"] is seen["torch_onednn_bf16"] is True
    assert seen["im2col"] is None
