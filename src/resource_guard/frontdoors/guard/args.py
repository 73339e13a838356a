"""Checks of ``guard(...)``'s arguments, made in the constructor without probing hardware."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import torch

from resource_guard.errors import ConfigurationError
from resource_guard.frontdoors.vocabulary import check_log_dir

if TYPE_CHECKING:
    from resource_guard.devices import DeviceSpec

__all__ = ["check_device_and_catalog", "check_log_dir", "torch_device_of"]


def torch_device_of(spec: DeviceSpec) -> torch.device:
    """The torch device a (detected) :class:`DeviceSpec` names.

    Raises:
        ConfigurationError: ``spec`` is a catalog device that is not on this machine.

    Example:
        >>> from resource_guard.devices import resolve_device
        >>> torch_device_of(resolve_device("cpu"))
        device(type='cpu')
    """
    if spec.kind == "cpu":
        return torch.device("cpu")
    if spec.kind == "mps":
        return torch.device("mps")
    if spec.source == "detected" and spec.index is not None:
        return torch.device("cuda", spec.index)
    raise ConfigurationError(
        f"device {spec.name!r} is a catalog entry, not a device on this machine: training needs a real "
        "device. Use device='auto' (or 'cuda:N' / 'cpu'), with `memory_limit=` to plan under a cap; use "
        "`plan(..., device=...)` or `resource-guard preflight --device` for what-if questions."
    )


def check_device_and_catalog(device: Any, catalog: Any) -> Any:
    """Refuse a device name that is neither local-looking nor in the catalog, without probing hardware.

    Returns the catalog loaded from a path (or as given). Whether a local device exists is checked at
    enter, where probing the hardware belongs.
    """
    from resource_guard.devices import Catalog, DeviceSpec, load_catalog

    if catalog is not None and not isinstance(catalog, Catalog):
        if not isinstance(catalog, (str, os.PathLike)):
            raise ConfigurationError(
                f"`guard(catalog={catalog!r})` must be a path to a YAML device catalog or a Catalog."
            )
        catalog = load_catalog(catalog)  # a missing or malformed file fails here, with the reason
    if isinstance(device, DeviceSpec):
        return catalog
    if not isinstance(device, str):
        raise ConfigurationError(f"`guard(device={device!r})` must be a device name or a DeviceSpec.")
    name = device.strip().lower()
    if name in ("auto", "cpu", "mps") or re.fullmatch(r"cuda(:\d+)?", name):
        return catalog
    known = catalog if catalog is not None else load_catalog()
    try:
        known.get(device)
    except ConfigurationError as error:
        raise ConfigurationError(
            f"`guard(device={device!r})`: {error} Local devices: 'auto', 'cpu', 'cuda', 'cuda:N', 'mps'."
        ) from None
    return catalog
