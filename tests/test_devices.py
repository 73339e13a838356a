"""Tests for resource_guard.devices: catalog, parsing, hardware matching, detection with fake drivers."""

from __future__ import annotations

import copy
import doctest
import fnmatch
import importlib.resources
import pickle
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from resource_guard import devices
from resource_guard.devices import (
    DEVICE_KINDS,
    Catalog,
    DeviceSpec,
    detect_local_devices,
    load_catalog,
    parse_bytes,
    resolve_device,
)
from resource_guard.errors import ConfigurationError

GiB = 1024**3
MiB = 1024**2
REPO = Path(__file__).resolve().parents[1]
REQUIRED = [
    "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "rtx-4090", "rtx-3090", "t4", "l4",
    "a10g", "v100-16gb", "v100-32gb", "mi300x", "m2-max", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


# --- bundled catalog ---------------------------------------------------------------------------


def test_bundled_catalog_has_every_required_device(catalog: Catalog) -> None:
    assert set(REQUIRED) <= set(catalog.names())
    assert len(catalog) == len(catalog.names()) == len(list(catalog))


@pytest.mark.parametrize("name", REQUIRED)
def test_bundled_entry_is_sane(catalog: Catalog, name: str) -> None:
    spec = catalog.get(name)
    assert spec.name == name and spec.source == "catalog"
    assert spec.kind in DEVICE_KINDS
    assert spec.memory_bytes > 0
    assert all(value > 0 for value in spec.peak_tflops.values())
    if spec.bf16:
        assert "bf16" in spec.peak_tflops
    if spec.is_gpu:
        assert "fp32" in spec.peak_tflops and spec.memory_bandwidth_gbps
        assert spec.peak_tflops.get("fp16", 0) >= spec.peak_tflops["fp32"]
    if spec.vendor == "nvidia":
        major, minor = (int(part) for part in spec.compute_capability.split("."))  # type: ignore[union-attr]
        assert (major, minor) >= (8, 0) or not spec.bf16
        if (major, minor) >= (8, 0):
            assert spec.bf16 and "tf32" in spec.peak_tflops
    else:
        assert spec.compute_capability is None
    assert spec.unified_memory == (spec.kind == "mps")


def test_catalog_memory_sizes_are_the_datasheet_classes(catalog: Catalog) -> None:
    assert catalog.get("a100-40gb").memory_bytes == 40 * GiB
    assert catalog.get("a100-80gb").memory_bytes == 80 * GiB
    assert catalog.get("mi300x").memory_bytes == 192 * GiB
    assert catalog.get("cpu").memory_bytes == psutil.virtual_memory().total  # memory: detect
    assert catalog.get("h100-sxm").peak_tflops["fp8"] > catalog.get("h100-sxm").peak_tflops["bf16"]


def test_bundled_yaml_is_package_data() -> None:
    resource = importlib.resources.files("resource_guard") / "data" / "devices.yaml"
    assert resource.is_file()
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["resource_guard"]
    assert any(fnmatch.fnmatch("data/devices.yaml", pattern) for pattern in patterns)


def test_module_docstring_examples_run() -> None:
    result = doctest.testmod(devices, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0


# --- lookup ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("a100-40gb", "a100-40gb"),
        ("A100_40GB", "a100-40gb"),
        ("  a100 40gb ", "a100-40gb"),
        ("a100", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("Tesla T4", "t4"),
        ("rtx4090", "rtx-4090"),
        ("GeForce RTX 3090", "rtx-3090"),
        ("H100", "h100-sxm"),
        ("M2_MAX", "m2-max"),
    ],
)
def test_lookup_ignores_case_spaces_underscores_and_knows_aliases(
    catalog: Catalog, query: str, expected: str
) -> None:
    assert catalog.get(query).name == expected
    assert query in catalog


def test_unknown_name_lists_close_matches_and_how_to_list_all(catalog: Catalog) -> None:
    with pytest.raises(ConfigurationError) as info:
        catalog.get("a100-40g")
    message = str(info.value)
    assert "'a100-40gb'" in message and "resource-guard devices" in message
    assert "a100-40g" not in catalog


def test_unknown_name_without_close_match_still_says_how_to_list(catalog: Catalog) -> None:
    with pytest.raises(ConfigurationError, match="resource-guard devices") as info:
        catalog.get("zzzzzzzz")
    assert "Did you mean" not in str(info.value)


def test_catalog_rejects_alias_used_twice() -> None:
    one = DeviceSpec("one", "cuda", GiB, aliases=("shared",))
    two = DeviceSpec("two", "cuda", GiB, aliases=("SHARED",))
    with pytest.raises(ConfigurationError, match="'SHARED'.*'two'.*'one'"):
        Catalog([one, two])


# --- DeviceSpec --------------------------------------------------------------------------------


def test_device_spec_is_frozen_hashable_and_with_memory_caps() -> None:
    spec = DeviceSpec("x", "cuda", 10 * GiB, peak_tflops={"bf16": 100.0}, free_bytes=8 * GiB, bf16=True)
    assert hash(spec) == hash(DeviceSpec("x", "cuda", 10 * GiB, peak_tflops={"bf16": 100.0},
                                         free_bytes=8 * GiB, bf16=True))  # fmt: skip
    assert spec.peak_tflops["bf16"] == 100.0 and spec.peak_tflops == {"bf16": 100.0}
    with pytest.raises(TypeError):
        spec.peak_tflops["bf16"] = 1.0  # type: ignore[index]
    assert pickle.loads(pickle.dumps(spec)) == spec == copy.deepcopy(spec)
    capped = spec.with_memory(6 * GiB)
    assert (capped.memory_bytes, capped.free_bytes, capped.peak_tflops) == (
        6 * GiB,
        6 * GiB,
        spec.peak_tflops,
    )
    assert spec.memory_bytes == 10 * GiB and spec.is_gpu and not DeviceSpec("cpu", "cpu", 1).is_gpu
    with pytest.raises(ConfigurationError, match="kind"):
        DeviceSpec("x", "tpu", GiB)
    with pytest.raises(ConfigurationError, match="memory_bytes"):
        DeviceSpec("x", "cuda", -1)


# --- parse_bytes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        ("1024", 1024),
        ("40GiB", 40 * GiB),
        ("24 GB", 24 * 10**9),
        ("512MiB", 512 * MiB),
        ("6g", 6 * GiB),
        ("1.5 KiB", 1536),
        ("1.5KB", 1500),
        ("2TiB", 2 * 1024**4),
        ("1_000", 1000),
        ("1e3", 1000),
        (" 7 b ", 7),
        (4.0e10, 40_000_000_000),
    ],
)
def test_parse_bytes_reads_ints_and_human_sizes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["-1GiB", -5, "", "GiB", "40 GiBs", "forty", "inf", "nan", True, None, 1.5])
def test_parse_bytes_rejects_bad_sizes(text: object) -> None:
    with pytest.raises(ConfigurationError):
        parse_bytes(text)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(["KiB", "MiB", "GiB", "KB", "MB", "GB"]))
def test_parse_bytes_unit_multipliers(number: int, unit: str) -> None:
    base = 1024 if "i" in unit else 1000
    power = "KMG".index(unit[0]) + 1
    assert parse_bytes(f"{number}{unit}") == number * base**power
    assert parse_bytes(f"{number} {unit.lower()}") == number * base**power


# --- user catalog files ------------------------------------------------------------------------


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "devices.yaml"
    path.write_text(text)
    return path


def test_user_file_is_merged_over_the_bundled_catalog(tmp_path: Path, catalog: Catalog) -> None:
    path = _write(
        tmp_path,
        """
devices:
  - name: A100_40GB          # override one field of a bundled entry
    price_per_hour_usd: 1.5
  - name: my-card
    kind: cuda
    memory: 12 GiB
    aliases: [a100]          # claims the alias from a100-40gb
    bf16: true
    peak_tflops: {bf16: 50}
""",
    )
    merged = load_catalog(path)
    assert len(merged) == len(catalog) + 1
    a100 = merged.get("a100-40gb")
    assert a100.price_per_hour_usd == 1.5 and a100.source == str(path)
    assert a100.memory_bytes == 40 * GiB and a100.peak_tflops == catalog.get("a100-40gb").peak_tflops
    mine = merged.get("MY_CARD")
    assert (mine.memory_bytes, mine.kind, mine.source, mine.bf16) == (12 * GiB, "cuda", str(path), True)
    assert merged.get("a100").name == "my-card" and "a100" not in merged.get("a100-40gb").aliases
    assert merged.get("t4") == catalog.get("t4")
    assert catalog.get("a100").name == "a100-40gb"  # the bundled catalog is untouched


def test_example_config_loads(catalog: Catalog) -> None:
    merged = load_catalog(REPO / "configs" / "devices.example.yaml")
    assert merged.get("a100-40gb").price_per_hour_usd != catalog.get("a100-40gb").price_per_hour_usd
    assert merged.get("rtx-a6000").memory_bytes == 48 * GiB
    assert merged.match_hardware_name("NVIDIA RTX A6000", 47 * GiB).name == "rtx-a6000"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        ("devices:\n  - name: x\n    kind: [unclosed\n", ["not valid YAML"]),
        ("devices:\n  - name: card\n    kind: cuda\n", ["entry 1 ('card')", "`memory`"]),
        ("devices:\n  - kind: cuda\n    memory: 1GiB\n", ["entry 1", "`name`"]),
        (
            "devices:\n  - name: card\n    kind: tpu\n    memory: 1GiB\n",
            ["'card'", "`kind`", "cuda, rocm, mps, cpu"],
        ),
        ("devices:\n  - name: card\n    kind: cuda\n    memory: -4GiB\n", ["'card'", "`memory`", "negative"]),
        ("devices:\n  - name: card\n    kind: cuda\n    memory: lots\n", ["`memory`", "'lots'"]),
        ("devices:\n  - name: card\n    kind: cuda\n    memory: 0\n", ["`memory`", "greater than zero"]),
        ("devices:\n  - name: card\n    kind: cuda\n    memory: 1GiB\n    bf16: 'yes'\n", ["`bf16`"]),
        (
            "devices:\n  - name: card\n    kind: cuda\n    memory: 1GiB\n    memroy: 2\n",
            ["`memroy`", "unknown"],
        ),
        (
            "devices:\n  - name: c\n    kind: cuda\n    memory: 1GiB\n    peak_tflops: {fp31: 1}\n",
            ["`peak_tflops`"],
        ),
        (
            "devices:\n  - name: c\n    kind: cuda\n    memory: 1GiB\n    compute_capability: eight\n",
            ["capability"],
        ),
        ("devices:\n  - name: c\n    kind: cuda\n    memory: detect\n", ["`memory`", "only allowed"]),
        ("devices:\n  - name: c\n    kind: cuda\n    memory: 1GiB\n    price_per_hour_usd: -1\n", ["price"]),
        (
            "devices:\n  - {name: c, kind: cuda, memory: 1}\n  - {name: c, kind: cuda, memory: 1}\n",
            ["entry 2", "twice"],
        ),
        ("devices:\n  - just a string\n", ["entry 1", "mapping"]),
        ("name: card\n", ["`devices:`"]),
        ("", ["`devices:`"]),
    ],
)
def test_bad_user_file_names_file_entry_and_field(tmp_path: Path, body: str, fragments: list[str]) -> None:
    path = _write(tmp_path, body)
    with pytest.raises(ConfigurationError) as info:
        load_catalog(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message.strip()
    for fragment in fragments:
        assert fragment in message


def test_missing_user_file_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="Cannot read device catalog"):
        load_catalog(tmp_path / "absent.yaml")


def test_compute_capability_may_be_written_unquoted(tmp_path: Path) -> None:
    path = _write(tmp_path, "devices:\n  - {name: c, kind: cuda, memory: 1GiB, compute_capability: 8.6}\n")
    assert load_catalog(path).get("c").compute_capability == "8.6"


# --- hardware names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hw_name", "memory", "expected"),
    [
        ("NVIDIA A100-SXM4-40GB", 40536 * MiB, "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", None, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 81920 * MiB, "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", 81251 * MiB, "a100-80gb"),
        ("A100-SXM4-40GB", None, "a100-40gb"),  # older drivers: no "NVIDIA " prefix
        ("NVIDIA A100-SXM4", 80 * GiB, "a100-80gb"),  # no size in the name: memory decides
        ("NVIDIA A100-SXM4", 40 * GiB, "a100-40gb"),
        ("NVIDIA A100-SXM4", None, "a100-40gb"),  # ambiguous, no memory: the family default
        ("NVIDIA H100 80GB HBM3", 81559 * MiB, "h100-sxm"),
        ("NVIDIA H100 PCIe", 81559 * MiB, "h100-pcie"),
        ("NVIDIA H200", 143771 * MiB, "h200"),
        ("NVIDIA GeForce RTX 4090", 24564 * MiB, "rtx-4090"),
        ("NVIDIA GeForce RTX 3090", 24576 * MiB, "rtx-3090"),
        ("Tesla T4", 15360 * MiB, "t4"),
        ("NVIDIA L4", 23034 * MiB, "l4"),
        ("NVIDIA A10G", 23028 * MiB, "a10g"),
        ("Tesla V100-SXM2-16GB", 16160 * MiB, "v100-16gb"),
        ("Tesla V100-PCIE-32GB", 32510 * MiB, "v100-32gb"),
        ("AMD Instinct MI300X", 192 * GiB, "mi300x"),
        ("Apple M2 Max", None, "m2-max"),
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 20 * GiB, None),  # a MIG slice is not an A100
        ("NVIDIA H100 NVL", 95830 * MiB, None),  # 94GB part: no entry
        ("NVIDIA L40S", 46068 * MiB, None),
        ("NVIDIA A10", 24 * GiB, None),
        ("Tesla V100S-PCIE-32GB", 32 * GiB, None),
        ("NVIDIA GeForce RTX 3060", 12 * GiB, None),
    ],
)
def test_match_hardware_name(
    catalog: Catalog, hw_name: str, memory: int | None, expected: str | None
) -> None:
    match = catalog.match_hardware_name(hw_name, memory_bytes=memory)
    assert (match.name if match else None) == expected


# --- detection ---------------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [
        ("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse avx512f avx512_bf16\n", True),
        ("flags\t\t: fpu sse amx_tile amx_bf16\n", True),
        ("Features\t: fp asimd bf16 i8mm\n", True),  # aarch64
        ("flags\t\t: fpu sse avx2 avx512f\n", False),
        (None, False),  # not Linux / unreadable
    ],
)
def test_cpu_bf16_comes_from_cpu_flags(cpuinfo: str | None, expected: bool) -> None:
    assert devices._cpu_spec(cpuinfo).bf16 is expected


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
    monkeypatch.setattr(devices, "_torch_cuda_built", lambda: True)
    monkeypatch.setattr(devices, "_mps_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def no_torch_fallback() -> list[devices._GpuInfo]:
        raise AssertionError("torch.cuda must not be touched while NVML works")

    monkeypatch.setattr(devices, "_torch_cuda_devices", no_torch_fallback)
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
    slice_ = devices._GpuInfo("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 20 * GiB, 19 * GiB, "cuda", "8.0")
    monkeypatch.setattr(devices, "_torch_cuda_devices", lambda: [slice_])
    (gpu,) = (d for d in detect_local_devices() if d.is_gpu)
    assert gpu.memory_bytes == 20 * GiB and gpu.aliases == () and gpu.bf16  # bf16 from cc 8.0


@pytest.mark.parametrize("step", ["init", "count", "memory"])
def test_nvml_errors_never_raise_and_fall_back_to_torch(
    fake_nvml: _FakeNvml, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    fake_nvml.fail = step
    fallback = devices._GpuInfo("Tesla T4", 15360 * MiB, 15000 * MiB, "cuda", "7.5")
    monkeypatch.setattr(devices, "_torch_cuda_devices", lambda: [fallback])
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
    monkeypatch.setattr(devices, "_torch_cuda_devices", lambda: [])
    assert [d.name for d in detect_local_devices()] == ["cpu"]


def test_cpu_only_torch_build_reports_no_gpu_even_if_nvml_sees_one(
    fake_nvml: _FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "_torch_cuda_built", lambda: False)
    assert [d.name for d in detect_local_devices()] == ["cpu"]
    assert fake_nvml.init_calls == 0


def test_torch_fallback_reads_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(name="NVIDIA L4", total_memory=23034 * MiB, major=8, minor=9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (20 * GiB, 23034 * MiB))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert devices._torch_cuda_devices() == [
        devices._GpuInfo("NVIDIA L4", 23034 * MiB, 20 * GiB, "cuda", "8.9")
    ]
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert devices._torch_cuda_devices()[0].kind == "rocm"


# --- resolve_device ----------------------------------------------------------------------------


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


def test_resolve_cpu_mps_catalog_and_unknown() -> None:
    cpu = resolve_device("cpu")
    assert cpu.source == "detected" and cpu.free_bytes is not None
    spec = DeviceSpec("custom", "cuda", GiB)
    assert resolve_device(spec) is spec
    assert resolve_device("a100").name == "a100-40gb" and resolve_device("a100").source == "catalog"
    if not devices._mps_available():
        with pytest.raises(ConfigurationError, match="no MPS device"):
            resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match="no CUDA device is visible"):
            resolve_device("cuda:0")
    with pytest.raises(ConfigurationError, match=r"'h100-sxm'.*resource-guard devices.*'cuda:N'"):
        resolve_device("h100-sx")
    with pytest.raises(ConfigurationError, match="must be a device name"):
        resolve_device(3)  # type: ignore[arg-type]


def test_resolve_uses_a_given_catalog(tmp_path: Path) -> None:
    path = _write(tmp_path, "devices:\n  - {name: lab-gpu, kind: cuda, memory: 11GiB}\n")
    assert resolve_device("lab_gpu", catalog=load_catalog(path)).memory_bytes == 11 * GiB
    with pytest.raises(ConfigurationError):
        resolve_device("lab-gpu")
