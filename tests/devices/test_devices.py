"""Tests for resource_guard.devices.catalog: catalog, parsing, hardware matching, resolve_device by name."""

from __future__ import annotations

import copy
import doctest
import fnmatch
import importlib.resources
import pickle
from pathlib import Path

import psutil
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import resource_guard.devices as devices
from resource_guard.devices import (
    DEVICE_KINDS,
    Catalog,
    DeviceSpec,
    detect,
    load_catalog,
    parse_bytes,
    resolve_device,
)
from resource_guard.errors import ConfigurationError

GiB = 1024**3
MiB = 1024**2
REPO = Path(__file__).resolve().parents[2]
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
    resource = importlib.resources.files("resource_guard.devices") / "catalog.yaml"
    assert resource.is_file()
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["resource_guard.devices"]
    assert any(fnmatch.fnmatch("catalog.yaml", pattern) for pattern in patterns)


def test_module_docstring_examples_run() -> None:
    result = doctest.testmod(devices.catalog, optionflags=doctest.ELLIPSIS)
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


# --- resolve_device ----------------------------------------------------------------------------


def test_resolve_cpu_mps_catalog_and_unknown() -> None:
    cpu = resolve_device("cpu")
    assert cpu.source == "detected" and cpu.free_bytes is not None
    # torch's indexed spelling, the Trainer's `args.device` on each rank of a CPU job
    assert resolve_device("cpu:0").name == resolve_device("CPU:1").name == cpu.name
    with pytest.raises(ConfigurationError, match="Unknown device"):
        resolve_device("cpu:x")
    spec = DeviceSpec("custom", "cuda", GiB)
    assert resolve_device(spec) is spec
    assert resolve_device("a100").name == "a100-40gb" and resolve_device("a100").source == "catalog"
    if not detect._mps_available():
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
