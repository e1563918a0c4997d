"""``_component_`` instantiation: a mapping with a dotted path builds that callable.

    optimizer:
      _component_: torch.optim.AdamW
      betas: [0.9, 0.95]
      eps: 1.0e-6

Sibling keys become keyword arguments; nested ``_component_`` mappings (also inside lists) are
built first. Naming a callable is running code (``_component_: torch.utils.collect_env.run``
with ``command: ...`` runs a shell command, and torch re-exports ``os``), so a shared YAML file
is a program. A gate by package cannot hold: any library has functions that wrap ``subprocess``
or write files. So by default the gate is by *kind*: a ``_component_`` may name only an
optimizer or LR scheduler class (``KINDS``; ``train.optimizer`` an optimizer, ``train.scheduler``
a scheduler) defined in torch, torchao, posttune or an installed plugin's package, at any depth.
The dotted path's package is checked before anything is imported, then every module the path
passes through, then what it names. ``--trust-components`` (``POSTTUNE_TRUST_COMPONENTS=1``,
which also reaches torchrun's workers) lifts the gate. ``check_components`` imports every
component of a config and binds its keyword arguments at validate time, before any weight
loads; ``instantiate`` gates the whole tree again before it calls anything.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from posttune.errors import ConfigError

COMPONENT = "_component_"
TRUST_ENV = "POSTTUNE_TRUST_COMPONENTS"
#: packages whose classes a config may name without the opt-in (the installed plugins' are added)
TRUSTED_PACKAGES = ("torch", "torchao", "posttune")
OUTSIDE = "it is outside the packages a config may name"
OPT_IN = f"if you trust this config, pass --trust-components or set {TRUST_ENV}=1"


@dataclass(frozen=True)
class Kind:
    """A kind of class a config may name without the opt-in: building one runs no program.

    Constructing a torch optimizer or LR scheduler only stores its arguments (and, for a
    scheduler, sets the learning rates), whatever the config passes.
    """

    name: str  # as the refusal names it
    base: str  # the dotted base class
    example: str


OPTIMIZER = Kind("optimizer class", "torch.optim.Optimizer", "torch.optim.AdamW")
SCHEDULER = Kind("LR scheduler class", "torch.optim.lr_scheduler.LRScheduler", "torch.optim.lr_scheduler.StepLR")
#: what a field may name without the opt-in; any other field (nested values, method settings): either kind
KINDS: dict[str, tuple[Kind, ...]] = {"train.optimizer": (OPTIMIZER,), "train.scheduler": (SCHEDULER,)}
ANY_KIND = (OPTIMIZER, SCHEDULER)


@dataclass(frozen=True)
class Passed:
    """What posttune itself passes to the component at a field: leading positional arguments and keywords."""

    positional: int = 0
    keywords: tuple[str, ...] = ()
    #: arguments posttune sets from a field of its own, overriding the component's: (key, that field, how)
    from_fields: tuple[tuple[str, str, str], ...] = ()


#: the calls `posttune.training.optim` makes (``build_optimizer``, ``build_scheduler``)
PASSED: dict[str, Passed] = {
    # the parameter groups, each with its weight decay (none on biases and norms); train.lr
    "train.optimizer": Passed(1, ("lr",), from_fields=(("lr", "train.lr", "and its schedule"), (
        "weight_decay", "train.weight_decay", "for each parameter group, none on biases and norms"))),
    "train.scheduler": Passed(1),  # the optimizer
}


def component_name(value: str | Mapping[str, Any]) -> str:
    """A setting given by name or as a ``_component_`` mapping (``train.optimizer``, ``train.scheduler``): the name,
    or the component's dotted path."""
    return value if isinstance(value, str) else str(value.get(COMPONENT))


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


def allowed(field: str) -> str:
    """What ``field`` may name without the opt-in, in words (the end of every refusal)."""
    kinds = KINDS.get(field, ANY_KIND)
    bases = " or ".join(kind.base for kind in kinds)
    return (f"a _component_ runs code, so by default {field or 'a config'} may name only {_kind_words(kinds)} "
            f"(a subclass of {bases}, e.g. {kinds[0].example}) of torch, torchao, posttune or an installed plugin's "
            f"package; {OPT_IN}")


def _kind_words(kinds: tuple[Kind, ...]) -> str:
    """``an optimizer class``, ``an optimizer or LR scheduler class``."""
    return "an " + " or ".join(kind.name.removesuffix(" class") for kind in kinds) + " class"


def _refuse(path: str, where: str, why: str, *, via: str = "") -> ConfigError:
    via = f" (it resolves into '{via}')" if via else ""
    return ConfigError(where, f"refusing '{path}'{via}: {why}; {allowed(_field(where))}")


def check_path(path: str, where: str) -> None:
    """Before any import: the path's package must be trusted, and no part of it private (``_x``, ``__globals__``)."""
    if trusted():
        return
    parts = path.split(".")
    if parts[0] not in trusted_packages():
        raise _refuse(path, where, OUTSIDE)
    if any(part.startswith("_") for part in parts):
        raise _refuse(path, where, "it is private")


def check_module(path: str, where: str, module: types.ModuleType) -> None:
    """A module the attribute walk passes through (``torch.os`` is ``os``) must be in a trusted package.

    Its own name may be private (``torch.Generator`` lives in ``torch._C``): only the path as
    the config spells it must be public.
    """
    if not trusted() and module.__name__.split(".")[0] not in trusted_packages():
        raise _refuse(path, where, OUTSIDE, via=module.__name__)


def check_kind(path: str, where: str, obj: Any) -> None:
    """What the path names must be a class of a kind the field allows, defined in a trusted package."""
    if trusted():
        return
    kinds = KINDS.get(_field(where), ANY_KIND)
    if not isinstance(obj, type):
        raise _refuse(path, where, f"it is {_describe(obj)}, not {_kind_words(kinds)}")
    home = getattr(obj, "__module__", None)
    home = home if isinstance(home, str) else ""
    if home.split(".")[0] not in trusted_packages():
        raise _refuse(path, where, OUTSIDE, via=f"{home}.{obj.__qualname__}")
    if not any(issubclass(obj, _base(kind)) for kind in kinds):
        raise _refuse(path, where, f"it is a class, but not {_kind_words(kinds)}")


def _base(kind: Kind) -> type:
    """The base class itself, imported only once a path needs it (validating a config need not import torch)."""
    module, _, name = kind.base.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _describe(obj: Any) -> str:
    """What a refused callable is, for the message: ``a function``, ``a partial``."""
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.MethodWrapperType,
                        types.WrapperDescriptorType, types.MethodDescriptorType, types.ClassMethodDescriptorType)):
        return "a function"
    return f"a {type(obj).__name__}"


def _field(where: str) -> str:
    """The field a ``..._component_`` key belongs to: ``train.optimizer._component_`` -> ``train.optimizer``."""
    return where.removesuffix(COMPONENT).removesuffix(".")


def import_dotted(path: str, where: str) -> Callable[..., Any]:
    """The object named by ``package.module.attr``, trying the longest importable module first.

    Without the opt-in, the gate runs on the path before any import (``check_path``), on every
    module the attribute walk passes through (``check_module``: ``torch.os.system`` is
    ``os.system``) and on what the path names (``check_kind``).
    """
    if not isinstance(path, str) or not path or any(not part.isidentifier() for part in path.split(".")):
        raise ConfigError(where, f"expected a dotted path like 'torch.optim.AdamW', got {path!r}")
    parts = path.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # finding a top-level module runs none of its code
    except (ImportError, ValueError):
        spec = None
    if spec is None and importlib.machinery.PathFinder.find_spec(parts[0], [os.getcwd()]) is not None:
        sys.path.append(os.getcwd())  # a module beside the config, as `python -m` finds it (after installed ones)
        spec = importlib.util.find_spec(parts[0])
    if spec is None:
        raise ConfigError(where, f"cannot import '{path}': no module named '{parts[0]}' (installed, or in the working "
                                 "directory)")
    check_path(path, where)
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
                check_module(path, where, obj)
        if not callable(obj):
            raise ConfigError(where, f"'{path}' is a {type(obj).__name__}, not callable")
        check_kind(path, where, obj)
        return obj
    raise ConfigError(where, f"cannot import '{path}': no module named '{parts[0]}'")


def instantiate(node: Any, *args: Any, where: str = "", **kwargs: Any) -> Any:
    """Build ``node`` if it (or anything inside it) holds a ``_component_``; other values pass through.

    ``args`` and ``kwargs`` go to the top-level call only (e.g. the model's parameters for an
    optimizer); a key given both in the config and by the caller is an error. Every component
    of the tree passes the gate before any of them is called: nested ones are built first.
    """
    for inner, found in find_components(node, where):
        import_dotted(found[COMPONENT], _join(inner, COMPONENT))
    return _build(node, *args, where=where, **kwargs)


def _build(node: Any, *args: Any, where: str = "", **kwargs: Any) -> Any:
    """``instantiate`` once the gate passed: nested components first, then ``node`` with ``args``/``kwargs``."""
    if isinstance(node, dict):
        built = {k: _build(v, where=_join(where, k)) for k, v in node.items() if k != COMPONENT}
        if COMPONENT not in node:
            return built
        target = import_dotted(node[COMPONENT], _join(where, COMPONENT))
        _check_clash(built, kwargs, where)
        try:
            return target(*args, **built, **kwargs)
        except TypeError as exc:
            raise ConfigError(where, f"{node[COMPONENT]}: {exc}") from exc
    if isinstance(node, list):
        return [_build(v, where=f"{where}[{i}]") for i, v in enumerate(node)]
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
    for key, field_name, how in passed.from_fields if passed else ():
        if key in keys:  # posttune's value wins over the constructor's: this one would be ignored
            raise ConfigError(_join(where, key), f"posttune sets it from {field_name} ({how}); set that instead")
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
