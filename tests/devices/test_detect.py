"""Tests for resource_guard.devices.detect: local devices with fake pynvml, torch.cuda, MPS and cpuinfo."""

from __future__ import annotations

import doctest
import subprocess
import sys
import types
from types import SimpleNamespace

import psutil
import pytest
import torch

import resource_guard.devices as devices
from resource_guard.devices import cpu_profile, detect, detect_local_devices, play_cpu, resolve_device
from resource_guard.errors import ConfigurationError

GiB = 1024**3
MiB = 1024**2


def test_module_docstring_example_runs() -> None:
    result = doctest.testmod(detect, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0


def test_devices_re_exports_detection_in_either_import_order() -> None:
    assert devices.detect_local_devices is detect.detect_local_devices
    assert devices.resolve_device is detect.resolve_device
    assert devices.cpu_summary is detect.cpu_summary
    assert "detect_local_devices" in devices.__all__ and detect.__all__ == [
        "cpu_summary",
        "detect_local_devices",
        "resolve_device",
    ]
    with pytest.raises(AttributeError, match="no_such_name"):
        devices.no_such_name  # noqa: B018
    code = (
        "import sys\n"
        "import resource_guard.devices.detect as a\n"  # detect first
        "from resource_guard.devices import detect_local_devices\n"
        "assert detect_local_devices is a.detect_local_devices\n"
        "for name in [n for n in sys.modules if n.startswith('resource_guard')]:\n"
        "    del sys.modules[name]\n"
        "from resource_guard.devices import detect_local_devices, resolve_device\n"  # devices first
        "import resource_guard.devices.detect as b\n"
        "assert detect_local_devices is b.detect_local_devices and resolve_device('cpu').name == 'cpu'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_detection_on_this_machine_finds_the_cpu_and_no_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this test describes the GPU-less CI machine")
    found = detect_local_devices()
    cpus = [d for d in found if d.kind == "cpu"]
    assert len(cpus) == 1 and found[-1] is cpus[0]
    cpu = cpus[0]
    assert (cpu.name, cpu.source, cpu.index) == ("cpu", "detected", None)
    assert cpu.memory_bytes == psutil.virtual_memory().total
    assert cpu.free_bytes is not None and 0 < cpu.free_bytes <= cpu.memory_bytes
    assert not [d for d in found if d.kind in ("cuda", "rocm")]
    assert resolve_device("auto").name in ("cpu", "mps")


def test_the_cpu_device_takes_bf16_and_its_name_from_the_cpu_profile() -> None:
    """bf16 of the ``cpu`` device is the profile's native bf16 (flags, cap: tests/devices/test_cpu.py)."""
    for isa in ("avx2", "avx512_core", "avx512_core_bf16", "avx512_core_amx"):
        with play_cpu(isa) as played:
            cpu = resolve_device("cpu")
            assert cpu.bf16 is played.native_bf16 is (isa in ("avx512_core_bf16", "avx512_core_amx"))
            assert cpu.display_name == f"played {isa}" == detect_local_devices()[-1].display_name


class _FakeNvml:
    """A stand-in for the pynvml module: two GPUs, with call counting."""

    def __init__(self, gpus: list[tuple[str, str, int, int]], fail: str | None = None) -> None:
        self.gpus, self.fail = gpus, fail
        self.init_calls = self.shutdown_calls = 0
        module = types.ModuleType("pynvml")

        class NVMLError(Exception):
            pass

        def check(step: str) -> None:
            if self.fail == step:
                raise NVMLError(step)

        def init() -> None:
            self.init_calls += 1
            check("init")

        def shutdown() -> None:
            self.shutdown_calls += 1

        def memory(handle: int) -> SimpleNamespace:
            check("memory")
            _, _, total, free = self.gpus[handle]
            return SimpleNamespace(total=total, free=free, used=total - free)

        def count() -> int:
            check("count")
            return len(self.gpus)

        module.__dict__.update(
            NVMLError=NVMLError, nvmlInit=init, nvmlShutdown=shutdown, nvmlDeviceGetCount=count,
            nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: self.gpus[h][0].encode(),
            nvmlDeviceGetUUID=lambda h: self.gpus[h][1], nvmlDeviceGetMemoryInfo=memory,
            nvmlDeviceGetCudaComputeCapability=lambda h: (8, 0),
        )  # fmt: skip
        self.module = module


TWO_GPUS = [
    ("NVIDIA A100-SXM4-40GB", "GPU-aaaa1111-0000", 40536 * MiB, 10 * GiB),
    ("NVIDIA A100-SXM4-80GB", "GPU-bbbb2222-0000", 81920 * MiB, 70 * GiB),
]


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> _FakeNvml:
    fake = _FakeNvml(list(TWO_GPUS))
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)
    monkeypatch.setattr(detect, "_torch_cuda_built", lambda: True)
    monkeypatch.setattr(detect, "_mps_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def no_torch_fallback() -> list[detect._GpuInfo]:
        raise AssertionError("torch.cuda must not be touched while NVML works")

    monkeypatch.setattr(detect, "_torch_cuda_devices", no_torch_fallback)
    return fake


def test_fake_nvml_two_gpus_are_detected_with_catalog_facts(fake_nvml: _FakeNvml) -> None:
    found = detect_local_devices()
    assert [d.name for d in found] == ["cuda:0", "cuda:1", "cpu"]
    first, second = found[0], found[1]
    assert (first.display_name, first.memory_bytes, first.free_bytes, first.index) == (
        "NVIDIA A100-SXM4-40GB",
        40536 * MiB,
        10 * GiB,
        0,
    )
    assert first.aliases == ("a100-40gb",) and second.aliases == ("a100-80gb",)
    assert first.bf16 and first.compute_capability == "8.0" and first.peak_tflops["bf16"] == 312
    assert first.source == "detected" and first.kind == "cuda"
    assert fake_nvml.init_calls == fake_nvml.shutdown_calls == 1


@pytest.mark.parametrize(
    ("visible", "expected_physical"),
    [
        ("1", [1]),
        ("1,0", [1, 0]),
        (" 0 , 1 ", [0, 1]),
        ("GPU-bbbb", [1]),  # a unique UUID prefix
        ("GPU-aaaa1111-0000,1", [0, 1]),
        ("GPU-", []),  # ambiguous prefix ends the list
        ("0,7,1", [0]),  # CUDA stops at the first invalid entry
        ("1,1", [1]),
        ("", []),
        ("-1", []),
    ],
)
def test_cuda_visible_devices_maps_torch_indices_to_physical_gpus(
    fake_nvml: _FakeNvml, monkeypatch: pytest.MonkeyPatch, visible: str, expected_physical: list[int]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpus = [d for d in detect_local_devices() if d.kind == "cuda"]
    assert [d.index for d in gpus] == list(range(len(expected_physical)))
    assert [d.name for d in gpus] == [f"cuda:{i}" for i in range(len(expected_physical))]
    assert [d.display_name for d in gpus] == [TWO_GPUS[i][0] for i in expected_physical]
    assert [d.memory_bytes for d in gpus] == [TWO_GPUS[i][2] for i in expected_physical]


def test_mig_visible_devices_fall_back_to_torch(
    fake_nvml: _FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")
    slice_ = detect._GpuInfo("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 20 * GiB, 19 * GiB, "cuda", "8.0")
    monkeypatch.setattr(detect, "_torch_cuda_devices", lambda: [slice_])
    (gpu,) = (d for d in detect_local_devices() if d.is_gpu)
    assert gpu.memory_bytes == 20 * GiB and gpu.aliases == () and gpu.bf16  # bf16 from cc 8.0


@pytest.mark.parametrize("step", ["init", "count", "memory"])
def test_nvml_errors_never_raise_and_fall_back_to_torch(
    fake_nvml: _FakeNvml, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    fake_nvml.fail = step
    fallback = detect._GpuInfo("Tesla T4", 15360 * MiB, 15000 * MiB, "cuda", "7.5")
    monkeypatch.setattr(detect, "_torch_cuda_devices", lambda: [fallback])
    found = detect_local_devices()
    gpus = [d for d in found if d.is_gpu]
    assert found[-1].name == "cpu"
    if step == "memory":  # NVML works but has no dedicated memory to report: a unified-memory GPU
        assert [d.unified_memory for d in gpus] == [True, True]
        assert gpus[0].memory_bytes == psutil.virtual_memory().total
    else:
        assert [(d.name, d.aliases, d.bf16) for d in gpus] == [("cuda:0", ("t4",), False)]
    assert fake_nvml.shutdown_calls == (0 if step == "init" else 1)


def test_missing_pynvml_falls_back_to_torch(fake_nvml: _FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    monkeypatch.setattr(detect, "_torch_cuda_devices", lambda: [])
    assert [d.name for d in detect_local_devices()] == ["cpu"]


def test_cpu_only_torch_build_reports_no_gpu_even_if_nvml_sees_one(
    fake_nvml: _FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(detect, "_torch_cuda_built", lambda: False)
    assert [d.name for d in detect_local_devices()] == ["cpu"]
    assert fake_nvml.init_calls == 0


def test_torch_fallback_reads_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(name="NVIDIA L4", total_memory=23034 * MiB, major=8, minor=9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (20 * GiB, 23034 * MiB))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert detect._torch_cuda_devices() == [
        detect._GpuInfo("NVIDIA L4", 23034 * MiB, 20 * GiB, "cuda", "8.9")
    ]
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert detect._torch_cuda_devices()[0].kind == "rocm"


# --- resolve_device over detected devices ------------------------------------------------------


def test_auto_picks_the_gpu_with_most_free_memory(fake_nvml: _FakeNvml) -> None:
    chosen = resolve_device("auto")
    assert (chosen.name, chosen.free_bytes, chosen.aliases) == ("cuda:1", 70 * GiB, ("a100-80gb",))
    fake_nvml.gpus[0] = ("NVIDIA A100-SXM4-40GB", "GPU-aaaa1111-0000", 40536 * MiB, 39 * GiB)
    fake_nvml.gpus[1] = ("NVIDIA A100-SXM4-80GB", "GPU-bbbb2222-0000", 81920 * MiB, 1 * GiB)
    assert resolve_device(None).name == "cuda:0"


def test_resolve_explicit_cuda_devices(fake_nvml: _FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cuda").name == "cuda:0"
    assert resolve_device("CUDA:1").memory_bytes == 81920 * MiB
    with pytest.raises(ConfigurationError, match=r"cuda:5 does not exist, visible: cuda:0, cuda:1"):
        resolve_device("cuda:5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigurationError, match="no CUDA device is visible"):
        resolve_device("cuda")


def test_cpu_summary_names_the_model_the_isa_and_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    info = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_1 avx avx2 fma\n"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    line = detect.cpu_summary(info)
    assert line.startswith("AMD EPYC 7B13; ISA avx2 (avx2 -avx512f -avx512_bf16 -avx512_fp16 -amx_bf16);")
    assert "native bf16 no, fp16 no, AMX no; torch CPU capability" in line
    assert line.endswith("ONEDNN_MAX_CPU_ISA=AVX2 (at or above this CPU: no effect)")
    assert detect.cpu_summary() == cpu_profile().summary()  # by default: the profile decisions read
