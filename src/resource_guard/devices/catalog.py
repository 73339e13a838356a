"""Device catalog: capacity, bf16, peak TFLOP/s, bandwidth, price; byte sizes parsed and formatted.

The catalog ships as ``resource_guard/devices/catalog.yaml``; a user file with the same schema
(``configs/devices.example.yaml``) is merged over it. Nothing happens at import.

Example:
    >>> from resource_guard.devices.catalog import load_catalog, parse_bytes
    >>> a100 = load_catalog().get("A100_40GB")
    >>> a100.name, a100.memory_bytes == parse_bytes("40GiB"), a100.peak_tflops["bf16"]
    ('a100-40gb', True, 312.0)
    >>> load_catalog().match_hardware_name("NVIDIA A100-SXM4-80GB").name
    'a100-80gb'
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.resources
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psutil
import yaml

from resource_guard.errors import ConfigurationError

__all__ = [
    "DEVICE_KINDS",
    "PEAK_DTYPES",
    "Catalog",
    "DeviceSpec",
    "load_catalog",
    "format_bytes",
    "parse_bytes",
    "parse_memory_limit",
]

DEVICE_KINDS = ("cuda", "rocm", "mps", "cpu")
PEAK_DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8")
_SCHEMA = "see configs/devices.example.yaml"
_MATCH_MEMORY_TOLERANCE = 0.12  # drivers report up to ~7% below the datasheet size (ECC, reservations)


class _ReadOnlyMapping(Mapping[str, float]):
    """A read-only dict that, unlike ``MappingProxyType``, pickles and deep-copies (DDP, callbacks)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, float]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> float:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)


@dataclass(frozen=True)
class DeviceSpec:
    """One device: a catalog entry, or a device detected on this machine.

    Attributes:
        name: canonical catalog name (``"a100-40gb"``) or, detected, ``"cuda:0"``, ``"mps"``, ``"cpu"``.
        kind: one of :data:`DEVICE_KINDS`.
        memory_bytes: capacity (``"cpu"``: installed RAM; unified-memory GPUs: what the GPU may use).
        aliases: other names; for a detected GPU, the catalog entry it matched (empty if none).
        peak_tflops: dense peak TFLOP/s per dtype (keys from :data:`PEAK_DTYPES`); read-only.
        free_bytes: free memory when detected; ``None`` (unknown) for catalog entries.
        index: torch device index of a detected CUDA/ROCm GPU.
        source: ``"catalog"``, ``"detected"`` or the path of the user catalog file.
    """

    name: str
    kind: str
    memory_bytes: int
    display_name: str = ""
    vendor: str = ""
    aliases: tuple[str, ...] = ()
    bf16: bool = False
    compute_capability: str | None = None
    peak_tflops: Mapping[str, float] = field(default_factory=dict, hash=False)
    memory_bandwidth_gbps: float | None = None
    price_per_hour_usd: float | None = None
    unified_memory: bool = False
    free_bytes: int | None = None
    index: int | None = None
    source: str = "catalog"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationError(f"`DeviceSpec(name={self.name!r})` must be a non-empty string")
        if self.kind not in DEVICE_KINDS:
            raise ConfigurationError(f"`DeviceSpec(kind={self.kind!r})` must be one of {DEVICE_KINDS}")
        for attr in ("memory_bytes", "free_bytes"):
            value: Any = getattr(self, attr)
            if not (value is None and attr == "free_bytes") and not (_is_int(value) and value >= 0):
                raise ConfigurationError(f"`DeviceSpec({attr}={value!r})` must be an int >= 0")
        object.__setattr__(self, "aliases", tuple(self.aliases))
        object.__setattr__(self, "peak_tflops", _ReadOnlyMapping(self.peak_tflops))

    @property
    def is_gpu(self) -> bool:
        """True for CUDA, ROCm and MPS devices."""
        return self.kind in ("cuda", "rocm", "mps")

    def with_memory(self, memory_bytes: int) -> DeviceSpec:
        """A copy with capacity ``memory_bytes`` (a memory cap); ``free_bytes`` is clipped to it."""
        free = None if self.free_bytes is None else min(self.free_bytes, memory_bytes)
        return dataclasses.replace(self, memory_bytes=memory_bytes, free_bytes=free)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


_UNITS = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgtp", start=1):
    _UNITS.update({_prefix: 1024**_power, _prefix + "ib": 1024**_power, _prefix + "b": 1000**_power})
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(e[+-]?\d+)?\s*([a-z]*)")


def parse_bytes(text: str | int | float) -> int:
    """Read a size in bytes: an int, or a string such as ``"40GiB"``, ``"24 GB"``, ``"512MiB"``.

    ``KiB``/``MiB``/``GiB``/``TiB`` (and bare ``K``/``M``/``G``/``T``) are powers of 1024; ``KB``/``MB``/
    ``GB``/``TB`` are powers of 1000. Fractions are truncated to whole bytes.

    Raises:
        ConfigurationError: negative, non-numeric or with an unknown unit.

    Example:
        >>> parse_bytes("6GiB"), parse_bytes("24 GB"), parse_bytes(1024), parse_bytes("1.5k")
        (6442450944, 24000000000, 1024, 1536)
    """
    bad = ConfigurationError(
        f"cannot read {text!r} as a size in bytes: give an int of bytes or a size like '40GiB', "
        "'24 GB', '512MiB' (GiB = 2**30, GB = 10**9)"
    )
    if isinstance(text, float) and math.isfinite(text) and text.is_integer():
        text = int(text)
    if _is_int(text):
        if text < 0:  # type: ignore[operator]
            raise ConfigurationError(f"size {text!r} must not be negative")
        return int(text)
    if not isinstance(text, str):
        raise bad
    cleaned = text.strip().replace("_", "").lower()
    if cleaned.startswith("-"):
        raise ConfigurationError(f"size {text!r} must not be negative")
    match = _SIZE_RE.fullmatch(cleaned)
    if match is None or match[3] not in _UNITS:
        raise bad
    return int(Decimal(match[1] + (match[2] or "")) * _UNITS[match[3]])


def format_bytes(n: float | None) -> str:
    """Bytes as a short human string.

    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    """
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"


def parse_memory_limit(value: str | int | float, call: str) -> int:
    """A ``memory_limit`` argument of ``call`` (e.g. ``"plan"``) in bytes, > 0, or a ConfigurationError."""
    try:
        limit = parse_bytes(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"`{call}(memory_limit={value!r})`: {exc}") from None
    if limit <= 0:
        raise ConfigurationError(f"`{call}(memory_limit={value!r})` must be more than 0 bytes")
    return limit


def _key(name: str) -> str:
    """Lookup key: case, spaces, '-' and '_' ignored."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", name.lower())


class Catalog:
    """Immutable mapping of canonical name -> :class:`DeviceSpec`, with alias lookup.

    Iterating yields the canonical names in catalog order; :meth:`values` gives the specs.
    """

    def __init__(self, specs: Iterable[DeviceSpec]) -> None:
        self._specs: dict[str, DeviceSpec] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise ConfigurationError(f"device {spec.name!r} is listed twice")
            self._specs[spec.name] = spec
        self._lookup = {_key(name): name for name in self._specs}
        for spec in self._specs.values():
            for alias in spec.aliases:
                owner = self._lookup.setdefault(_key(alias), spec.name)
                if owner != spec.name:
                    raise ConfigurationError(
                        f"alias {alias!r} of device {spec.name!r} already names {owner!r}"
                    )

    def get(self, name: str) -> DeviceSpec:
        """The entry called ``name`` or one of its aliases (case, spaces, '-' and '_' ignored).

        Raises:
            ConfigurationError: unknown name; the message lists close matches.
        """
        canonical = self._lookup.get(_key(name)) if isinstance(name, str) else None
        if canonical is not None:
            return self._specs[canonical]
        labels = {alias.lower(): spec.name for spec in self._specs.values() for alias in spec.aliases}
        labels.update({spec_name: spec_name for spec_name in self._specs})
        close = difflib.get_close_matches(str(name).strip().lower(), list(labels), n=6, cutoff=0.6)
        suggestions = list(dict.fromkeys(labels[label] for label in close))[:3]
        hint = f"Did you mean {', '.join(map(repr, suggestions))}? " if suggestions else ""
        raise ConfigurationError(
            f"Unknown device {name!r}. {hint}Run `resource-guard devices` to list the {len(self)} known "
            f"devices, or describe yours in a catalog file ({_SCHEMA})."
        )

    def names(self) -> list[str]:
        return list(self._specs)

    def values(self) -> list[DeviceSpec]:
        return list(self._specs.values())

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _key(name) in self._lookup

    def match_hardware_name(self, hw_name: str, memory_bytes: int | None = None) -> DeviceSpec | None:
        """The entry for a driver's device name (``"NVIDIA A100-SXM4-40GB"``, ``"Tesla T4"``), or None.

        An entry matches when all words of its name, of an alias or of its family (the name without
        trailing size/form words: ``"a100"``) occur in ``hw_name``; the most specific match wins. With
        ``memory_bytes`` (what the driver reports), entries more than 12% away in capacity are ruled
        out: that tells a 40GB from an 80GB A100 and rejects unknown variants (MIG slices, H100 NVL).
        """
        hw_words = set(_words(hw_name))
        best: tuple[tuple[int, int, float], DeviceSpec] | None = None
        for spec in self._specs.values():
            gap = 0.0 if memory_bytes is None else abs(memory_bytes - spec.memory_bytes) / spec.memory_bytes
            if spec.kind == "cpu" or gap > _MATCH_MEMORY_TOLERANCE:
                continue
            family = _words(spec.name)
            while len(family) > 1 and re.fullmatch(r"\d+gb|sxm\d*|pcie", family[-1]):
                family.pop()
            labels = [(set(_words(label)), 1) for label in (spec.name, *spec.aliases)] + [(set(family), 0)]
            hits = [(len(words), explicit) for words, explicit in labels if words and words <= hw_words]
            if hits and (best is None or (*max(hits), -gap) > best[0]):
                best = ((*max(hits), -gap), spec)
        return None if best is None else best[1]


def _text_field(required: bool) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, str) and (bool(v.strip()) or not required)), "a string"


_OPTIONAL_NUMBER = (lambda v: v is None or (_is_number(v) and v >= 0), "a number >= 0 or null")
_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": _text_field(True),
    "display_name": _text_field(False),
    "vendor": _text_field(False),
    "kind": (lambda v: v in DEVICE_KINDS, f"one of {', '.join(DEVICE_KINDS)}"),
    "aliases": (
        lambda v: isinstance(v, list) and all(_text_field(True)[0](a) for a in v),
        "a list of strings",
    ),
    "memory": (lambda v: True, "a size"),  # checked by parse_bytes
    "bf16": (lambda v: isinstance(v, bool), "true or false"),
    "unified_memory": (lambda v: isinstance(v, bool), "true or false"),
    "compute_capability": (
        lambda v: (
            v is None or (isinstance(v, (str, float)) and re.fullmatch(r"\d+\.\d+", str(v)) is not None)
        ),
        'a string like "8.0" or null',
    ),
    "peak_tflops": (
        lambda v: (
            isinstance(v, dict) and all(k in PEAK_DTYPES and _is_number(x) and x > 0 for k, x in v.items())
        ),
        f"a mapping of dtypes ({', '.join(PEAK_DTYPES)}) to TFLOP/s > 0",
    ),
    "memory_bandwidth_gbps": _OPTIONAL_NUMBER,
    "price_per_hour_usd": _OPTIONAL_NUMBER,
}
_REQUIRED = ("name", "kind", "memory")


def _entry_kwargs(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Check one YAML entry's fields and turn them into DeviceSpec keyword arguments."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        check, expected = _FIELD_CHECKS.get(name, (None, ""))
        if check is None:
            allowed = ", ".join(_FIELD_CHECKS)
            raise ConfigurationError(
                f"{where}, field `{name}`: unknown field; allowed: {allowed} ({_SCHEMA})."
            )
        if not check(value):
            raise ConfigurationError(
                f"{where}, field `{name}`: must be {expected}, got {value!r} ({_SCHEMA})."
            )
        if name == "memory":
            try:
                value = value if value == "detect" else parse_bytes(value)
            except ConfigurationError as exc:
                raise ConfigurationError(f"{where}, field `memory`: {exc} ({_SCHEMA}).") from None
            if value == 0:
                raise ConfigurationError(f"{where}, field `memory`: must be greater than zero ({_SCHEMA}).")
            name = "memory_bytes"
        elif name in ("name", "display_name", "vendor"):
            value = value.strip()
        elif name == "aliases":
            value = tuple(alias.strip() for alias in value)
        elif name == "peak_tflops":
            value = {dtype: float(tflops) for dtype, tflops in value.items()}
        elif name == "compute_capability" and value is not None:
            value = str(value)
        elif name in ("memory_bandwidth_gbps", "price_per_hour_usd") and value is not None:
            value = float(value)
        out[name] = value
    return out


def _parse_catalog(text: str, origin: str, base: Mapping[str, DeviceSpec]) -> list[DeviceSpec]:
    """The entries of one catalog file; an entry named like one in ``base`` overrides only given fields."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigurationError(
            f"Device catalog {origin} is not valid YAML: {' '.join(str(exc).split())}"
        ) from None
    entries = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigurationError(
            f"Device catalog {origin} must be a mapping with a `devices:` list ({_SCHEMA})."
        )
    source = "catalog" if origin == "the bundled catalog" else origin
    specs: dict[str, DeviceSpec] = {}
    for number, raw in enumerate(entries, start=1):
        label = raw.get("name") if isinstance(raw, dict) else None
        where = f"Device catalog {origin}, entry {number}" + (f" ({label!r})" if label else "")
        if not isinstance(raw, dict):
            raise ConfigurationError(f"{where}: must be a mapping of fields, got {raw!r} ({_SCHEMA}).")
        kwargs = _entry_kwargs(raw, where)
        override = base.get(_key(kwargs.get("name", "")))
        if override is not None:
            inherited = {f.name: getattr(override, f.name) for f in dataclasses.fields(override)}
            kwargs = {**inherited, **kwargs, "name": override.name}
        for required in _REQUIRED:
            if required not in kwargs and f"{required}_bytes" not in kwargs:
                needed = ", ".join(_REQUIRED)
                raise ConfigurationError(
                    f"{where}: missing required field `{required}` ({needed}; {_SCHEMA})."
                )
        if kwargs["memory_bytes"] == "detect":
            if kwargs["kind"] != "cpu":
                raise ConfigurationError(f"{where}, field `memory`: 'detect' is only allowed for kind cpu.")
            kwargs["memory_bytes"] = int(psutil.virtual_memory().total)
        if kwargs["name"] in specs:
            raise ConfigurationError(f"{where}: the name {kwargs['name']!r} is used twice in this file.")
        specs[kwargs["name"]] = DeviceSpec(**{**kwargs, "source": source})
    return list(specs.values())


@functools.lru_cache(maxsize=1)
def _bundled_specs() -> tuple[DeviceSpec, ...]:
    text = importlib.resources.files("resource_guard.devices").joinpath("catalog.yaml").read_text("utf-8")
    return tuple(_parse_catalog(text, "the bundled catalog", {}))


def load_catalog(path: str | os.PathLike[str] | None = None) -> Catalog:
    """The bundled catalog, or the bundled one with the entries of a user YAML file merged over it.

    A user entry whose name is a bundled name replaces only the fields it gives; other entries are
    added. Names and aliases a user entry introduces are taken away from bundled entries.

    Raises:
        ConfigurationError: unreadable file, malformed YAML, missing or mistyped fields; the message
            names the file, the entry and the field.
    """
    bundled = {spec.name: spec for spec in _bundled_specs()}
    if path is None:
        return Catalog(bundled.values())
    origin = os.fspath(path)
    try:
        text = Path(origin).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"Cannot read device catalog {origin}: {exc}") from None
    user = _parse_catalog(text, origin, {_key(name): spec for name, spec in bundled.items()})
    owners: dict[str, str] = {}  # lookup key -> user entry that introduced it
    for spec in user:
        inherited = set(bundled[spec.name].aliases) if spec.name in bundled else set()
        owners.update(
            {_key(label): spec.name for label in (spec.name, *spec.aliases) if label not in inherited}
        )
    merged = {**bundled, **{spec.name: spec for spec in user}}
    for name, spec in merged.items():
        kept = tuple(alias for alias in spec.aliases if owners.get(_key(alias), name) == name)
        merged[name] = dataclasses.replace(spec, aliases=kept)
    try:
        return Catalog(merged.values())
    except ConfigurationError as exc:
        raise ConfigurationError(f"Device catalog {origin}: {exc}.") from None
