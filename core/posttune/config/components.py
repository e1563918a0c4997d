"""``_component_`` instantiation: a mapping with a dotted path builds that callable.

    optimizer:
      _component_: torch.optim.AdamW
      lr: 2e-5
      betas: [0.9, 0.95]

Sibling keys become keyword arguments; nested ``_component_`` mappings (also inside lists) are
built first. Naming a callable is running code (``_component_: os.system`` with
``command: ...``), so a shared YAML file is a program. By default only callables of torch,
torchao, posttune and the installed plugins' packages may be named, checked on the dotted path
before anything is imported; ``--trust-components`` (``POSTTUNE_TRUST_COMPONENTS=1``, which
also reaches torchrun's workers) lifts the gate. ``check_components`` imports every component
of a config and binds its keyword arguments at validate time, before any weight loads.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from posttune.errors import ConfigError

COMPONENT = "_component_"
TRUST_ENV = "POSTTUNE_TRUST_COMPONENTS"
#: packages whose callables a config may name without the opt-in (the installed plugins' are added)
TRUSTED_PACKAGES = ("torch", "torchao", "posttune")
#: inside the trusted packages, what starts programs, loads native or pickled code, or runs commands
UNSAFE = ("torch.hub", "torch.load", "torch.serialization", "torch.package", "torch.distributed.run",
          "torch.distributed.launch", "torch.distributed.elastic", "torch.utils.cpp_extension", "torch.ops",
          "torch.classes", "posttune.cli")
OPT_IN = f"if you trust this config, pass --trust-components or set {TRUST_ENV}=1"


@dataclass(frozen=True)
class Passed:
    """What posttune itself passes to the component at a field: leading positional arguments and keywords."""

    positional: int = 0
    keywords: tuple[str, ...] = ()


#: the calls `posttune.training.optim` makes (``build_optimizer``, ``build_scheduler``)
PASSED: dict[str, Passed] = {
    "train.optimizer": Passed(1, ("lr",)),  # the parameter groups; train.lr
    "train.scheduler": Passed(1),  # the optimizer
}


def trusted() -> bool:
    """Whether the user opted in to any ``_component_`` (``--trust-components`` sets the variable)."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def trusted_packages() -> list[str]:
    """torch, torchao, posttune and the top-level package of every loaded plugin."""
    from posttune.plugins import get_plugins

    plugins, names = get_plugins(), set(TRUSTED_PACKAGES)
    for name, info in plugins.plugins.items():
        plugin = None if info.error else plugins.pm.get_plugin(name)
        if plugin is not None:
            module = plugin.__name__ if isinstance(plugin, types.ModuleType) else type(plugin).__module__
            names.add(module.split(".")[0])
    return sorted(names)


def _refused(name: str, packages: list[str], *, written: bool) -> str | None:
    """Why the dotted name ``name`` is outside the gate, or None.

    ``written``: the path as the config spells it, where a private part (``_x``, ``__globals__``)
    is refused too; a resolved module may well be private (``torch.Generator`` lives in ``torch._C``).
    """
    parts = name.split(".")
    if parts[0] not in packages:
        return "it is outside the packages a config may name"
    if written and any(part.startswith("_") for part in parts):
        return "it is private"
    if any(name == unsafe or name.startswith(unsafe + ".") for unsafe in UNSAFE):
        return "it starts programs or loads code"
    return None


def check_allowed(path: str, where: str, *, resolved: str | None = None) -> None:
    """Refuse ``path`` (or the module the resolved callable lives in) unless trusted."""
    if trusted():
        return
    packages = trusted_packages()
    name = path if resolved is None else resolved
    why = _refused(name, packages, written=resolved is None)
    if why is not None:
        via = "" if resolved is None else f" (it resolves into '{resolved}')"
        raise ConfigError(where, f"refusing '{path}'{via}: {why}; a _component_ runs code, so by default a "
                                 f"config may name only callables of torch, torchao, posttune and the installed "
                                 f"plugins' packages; {OPT_IN}")


def import_dotted(path: str, where: str) -> Callable[..., Any]:
    """The object named by ``package.module.attr``, trying the longest importable module first.

    The gate runs on the path before any import, then on every module the attribute walk passes
    through (``torch.os.system`` is ``os.system``) and on the callable's own module.
    """
    if not isinstance(path, str) or not path or any(not part.isidentifier() for part in path.split(".")):
        raise ConfigError(where, f"expected a dotted path like 'torch.optim.AdamW', got {path!r}")
    parts = path.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # finding a top-level module runs none of its code
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ConfigError(where, f"cannot import '{path}': no module named '{parts[0]}'")
    check_allowed(path, where)
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
            if isinstance(obj, types.ModuleType):
                check_allowed(path, where, resolved=obj.__name__)
        if not callable(obj):
            raise ConfigError(where, f"'{path}' is a {type(obj).__name__}, not callable")
        home = getattr(obj, "__module__", None)
        if isinstance(home, str) and not isinstance(obj, types.ModuleType):
            check_allowed(path, where, resolved=f"{home}.{getattr(obj, '__qualname__', parts[-1])}")
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
        _check_clash(built, kwargs, where)
        try:
            return target(*args, **built, **kwargs)
        except TypeError as exc:
            raise ConfigError(where, f"{node[COMPONENT]}: {exc}") from exc
    if isinstance(node, list):
        return [instantiate(v, where=f"{where}[{i}]") for i, v in enumerate(node)]
    return node


def check_components(config: Any) -> list[tuple[str, str]]:
    """Import every ``_component_`` of ``config`` (gated) and bind its arguments; ``(field, target)`` pairs.

    Binding checks the keys against the callable's signature with what posttune passes itself at
    that field (``PASSED``): all required arguments must be there. Elsewhere the caller is
    unknown, so only the config's keys are bound (``bind_partial``). Nothing is called.
    """
    found = []
    for where, node in find_components(config):
        target = import_dotted(node[COMPONENT], _join(where, COMPONENT))
        _bind(target, node, where, PASSED.get(where))
        found.append((where, node[COMPONENT]))
    return found


def find_components(node: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every mapping with a ``_component_`` inside ``node`` (dataclasses, mappings, lists), nested ones first."""
    if is_dataclass(node) and not isinstance(node, type):
        for f in fields(node):
            yield from find_components(getattr(node, f.name), _join(where, f.name))
    elif isinstance(node, dict):
        for key, value in node.items():
            if key != COMPONENT:
                yield from find_components(value, _join(where, str(key)))
        if COMPONENT in node:
            yield where, node
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from find_components(value, f"{where}[{index}]")


def _bind(target: Callable[..., Any], node: dict[str, Any], where: str, passed: Passed | None) -> None:
    keys = {k: None for k in node if k != COMPONENT}
    _check_clash(keys, dict.fromkeys(passed.keywords) if passed else {}, where)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: checked when called
        return
    try:
        if passed is None:
            signature.bind_partial(**keys)
        else:
            signature.bind(*[None] * passed.positional, **keys, **dict.fromkeys(passed.keywords))
    except TypeError as exc:
        raise ConfigError(where, f"{node[COMPONENT]}: {exc}") from None


def _check_clash(built: dict[str, Any], kwargs: dict[str, Any], where: str) -> None:
    clash = sorted(set(built) & set(kwargs))
    if clash:
        raise ConfigError(_join(where, clash[0]), "is set by posttune itself; remove it from the config")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
