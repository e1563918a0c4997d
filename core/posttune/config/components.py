"""``_component_`` instantiation: a mapping with a dotted path builds that callable.

    optimizer:
      _component_: torch.optim.AdamW
      lr: 2e-5
      betas: [0.9, 0.95]

Sibling keys become keyword arguments; nested ``_component_`` mappings (also inside lists) are
built first. Importing a dotted path runs that module's code: configs are trusted input, as
Python scripts are.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from posttune.errors import ConfigError

COMPONENT = "_component_"


def import_dotted(path: str, where: str) -> Callable[..., Any]:
    """The object named by ``package.module.attr``, trying the longest importable module first."""
    if not isinstance(path, str) or not path or any(not part.isidentifier() for part in path.split(".")):
        raise ConfigError(where, f"expected a dotted path like 'torch.optim.AdamW', got {path!r}")
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and not module_name.startswith(exc.name) and not exc.name.startswith(module_name):
                raise ConfigError(where, f"importing '{module_name}' failed: {exc}") from exc
            continue
        except Exception as exc:  # noqa: BLE001 - an import-time failure, reported on one line
            raise ConfigError(where, f"importing '{module_name}' failed: {type(exc).__name__}: {exc}") from exc
        for depth, attr in enumerate(parts[split:], start=split):
            if not hasattr(obj, attr):
                owner = ".".join(parts[:depth])
                raise ConfigError(where, f"cannot import '{path}': '{owner}' has no attribute '{attr}'")
            obj = getattr(obj, attr)
        if not callable(obj):
            raise ConfigError(where, f"'{path}' is a {type(obj).__name__}, not callable")
        return obj
    raise ConfigError(where, f"cannot import '{path}': no module named '{parts[0]}'")


def instantiate(node: Any, *args: Any, where: str = "", **kwargs: Any) -> Any:
    """Build ``node`` if it (or anything inside it) holds a ``_component_``; other values pass through.

    ``args`` and ``kwargs`` go to the top-level call only (e.g. the model's parameters for an
    optimizer); a key given both in the config and by the caller is an error.
    """
    if isinstance(node, dict):
        built = {k: instantiate(v, where=_join(where, k)) for k, v in node.items() if k != COMPONENT}
        if COMPONENT not in node:
            return built
        target = import_dotted(node[COMPONENT], _join(where, COMPONENT))
        clash = sorted(set(built) & set(kwargs))
        if clash:
            raise ConfigError(_join(where, clash[0]), "is set by posttune itself; remove it from the config")
        try:
            return target(*args, **built, **kwargs)
        except TypeError as exc:
            raise ConfigError(where, f"{node[COMPONENT]}: {exc}") from exc
    if isinstance(node, list):
        return [instantiate(v, where=f"{where}[{i}]") for i, v in enumerate(node)]
    return node


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
