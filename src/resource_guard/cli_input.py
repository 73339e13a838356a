"""What ``resource-guard`` reads from the command line: the ``TARGET`` factory, and bad input (exit 2).

``TARGET`` is ``path/to/file.py:factory`` or ``package.module:factory``; the factory returns
``(model, optimizer, batch)``, ``(model, optimizer, batch, loss_fn)`` or a mapping with those keys.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["BadInput", "import_factory", "load_target"]


class BadInput(Exception):
    """Bad input on the command line: printed as one paragraph, exit 2."""


def import_factory(target: str) -> Any:
    path, sep, attr = target.rpartition(":")
    if not sep or not path or not attr:
        raise BadInput(f"TARGET {target!r} must be `path/to/file.py:factory` or `package.module:factory`.")
    if path.endswith(".py") or "/" in path or "\\" in path:
        file = Path(path)
        if not file.is_file():
            raise BadInput(f"TARGET {target!r}: the file {str(file)!r} does not exist.")
        spec = importlib.util.spec_from_file_location(f"_resource_guard_target_{file.stem}", file)
        if spec is None or spec.loader is None:
            raise BadInput(f"TARGET {target!r}: {str(file)!r} cannot be imported as a Python module.")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(file.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise BadInput(
                f"TARGET {target!r}: importing {str(file)!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            raise BadInput(f"TARGET {target!r}: cannot import module {path!r} ({exc}).") from exc
        except Exception as exc:
            raise BadInput(
                f"TARGET {target!r}: importing {path!r} raised {type(exc).__name__}: {exc}"
            ) from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise BadInput(
            f"TARGET {target!r}: {path!r} has no callable {attr!r}; callables there: {', '.join(names)}."
        )
    return factory


def load_target(target: str, batch_size: int | None = None) -> tuple[Any, Any, Any, Any]:
    """Call the factory named by ``target`` and return ``(model, optimizer, batch, loss_fn)``.

    The factory returns ``(model, optimizer, batch)`` or ``(model, optimizer, batch, loss_fn)``, or a
    mapping with those keys. With ``batch_size`` it must accept a ``batch_size`` argument.
    """
    factory = import_factory(target)
    kwargs = {}
    if batch_size is not None:
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        accepts = "batch_size" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        if not accepts:
            raise BadInput(f"--batch-size was given but {target!r} takes no `batch_size` argument.")
        kwargs["batch_size"] = batch_size
    try:
        built = factory(**kwargs)
    except Exception as exc:
        raise BadInput(f"the factory {target!r} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(built, Mapping):
        try:
            return built["model"], built["optimizer"], built["batch"], built.get("loss_fn")
        except KeyError as exc:
            raise BadInput(f"the factory {target!r} returned a mapping without key {exc}.") from exc
    if isinstance(built, Sequence) and not isinstance(built, (str, bytes)) and len(built) in (3, 4):
        model, optimizer, batch = built[:3]
        return model, optimizer, batch, built[3] if len(built) == 4 else None
    raise BadInput(
        f"the factory {target!r} returned {type(built).__name__}; it must return (model, optimizer, batch) "
        "or (model, optimizer, batch, loss_fn)."
    )
