"""The DataLoader settings the report's advice depends on, read wherever the loader is reachable
(``g.iterate(loader)``, a loader the zero-change observation saw iterated, Lightning's train loader):
``num_workers``, ``pin_memory``, ``prefetch_factor`` and ``persistent_workers``. Where no loader is
reachable the result is empty, and the report advises none of them (it cannot know them).

Example:
    >>> from torch.utils.data import DataLoader
    >>> loader_settings(DataLoader(list(range(8)), batch_size=4, num_workers=0))
    {'num_workers': 0, 'pin_memory': False, 'persistent_workers': False, 'prefetch_factor': None}
    >>> loader_settings([1, 2, 3])
    {}
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

__all__ = ["LOADER_KEYS", "loader_settings"]

LOADER_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


def loader_settings(loader: Any) -> dict[str, Any]:
    """The settings of ``loader`` when it is (or wraps, as ``.loader``/``.dataloader``/``._loader``) a
    ``torch.utils.data.DataLoader``; ``{}`` for anything else (a list, a generator, a custom iterable)."""
    for _ in range(4):  # a few wrappers deep (a re-batching loader, an accelerate/Lightning wrapper)
        if isinstance(loader, DataLoader):
            return {k: getattr(loader, k, None) for k in LOADER_KEYS}
        inner = next(
            (getattr(loader, a) for a in ("loader", "dataloader", "_loader") if hasattr(loader, a)), None
        )
        if inner is None or inner is loader:
            return {}
        loader = inner
    return {}
