"""Validate plain YAML data into (nested) dataclasses, naming the field path on every error."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from posttune.config.dtypes import TORCH_NAMES, short_name
from posttune.errors import ConfigError, did_you_mean

T = TypeVar("T")

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


#: run-config keys by name -> their place (``section.key``), filled by ``posttune.config.schema``: a key written in
#: another section, at the top or in a plugin's config (``method.learning_rate``) is named where it belongs
ELSEWHERE: dict[str, str] = {}


def _known_as(cls: type, key: str, nested: bool) -> str:
    """Where a key of transformers', TRL's, PEFT's or axolotl's configs is here, from the dataclass's ``KNOWN_AS``
    mapping (a ``ClassVar``: their name -> ours), for users bringing a recipe from there, or where a key of this
    dataclass went (``MOVED``), or where a run-config key written in the wrong place belongs (``ELSEWHERE``: in the
    core's sections at any depth, ``data.train[0].lr``, and in a plugin's own config, ``method.learning_rate``; not
    in an entry a plugin's config nests, ``method.rewards[0].timeout_s``, whose keys are that entry's own);
    "" for other keys."""
    moved = getattr(cls, "MOVED", {}).get(key)
    if moved:  # a key that was here once (``MOVED``: old name -> where it is now)
        return f"; moved: set {moved}"
    misplaced = not nested or cls.__module__.partition(".")[0] == "posttune"  # the core's own dataclasses
    here = getattr(cls, "KNOWN_AS", {}).get(key) or (ELSEWHERE.get(key) if misplaced else None)
    if here and here.startswith("not here"):  # a setting with no counterpart: what stands in its place
        return f"; {key} has no counterpart here{here.removeprefix('not here')}"
    return f"; {key} is {here} here" if here else ""


def from_dict(cls: type[T], data: Any, path: str = "", *, nested: bool = False) -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys, missing keys and bad types raise ConfigError, and so
    does a value the dataclass's own ``__post_init__`` refuses, its field named under ``path``. ``nested``: ``cls``
    is a field's type (or a list's items) inside another dataclass being built."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping of keys, got {_show(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [str(key) for key in data if key not in fields]
    if unknown:  # all of them at once: a recipe brought from elsewhere has several
        hints = [_known_as(cls, key, nested) or did_you_mean(key, fields) for key in unknown]
        others = "; ".join(f"{key}{hint.removeprefix(f'; {key}')}" for key, hint in zip(unknown[1:], hints[1:]))
        more = f" (and {len(unknown) - 1} more unknown here: {others})" if others else ""
        raise ConfigError(_join(path, unknown[0]), "unknown key" + (hints[0] or f" (keys: {', '.join(fields)})")
                          + more)
    values = {}
    for name, f in fields.items():
        where = _join(path, name)
        if name in data:
            if data[name] is None and f.default_factory is not dataclasses.MISSING and not _nullable(hints[name]):
                continue  # null for a list or mapping that cannot hold it: its default (empty), as ~key gives
            try:
                values[name] = convert(hints[name], data[name], where)
            except ConfigError as exc:  # TRL's value for the setting (``KNOWN_VALUES``: field -> their value -> ours)
                known = getattr(cls, "KNOWN_VALUES", {}).get(name, {}).get(str(data[name]))
                if not known or exc.path != where:
                    raise
                raise ConfigError(where, f"{exc.problem}; {data[name]} is {known} here") from None
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(where, "required")
    try:
        return cls(**values)
    except ConfigError as exc:  # raised by the dataclass itself, naming its field ("power"): under path
        if not path or exc.path == path or exc.path.startswith((f"{path}.", f"{path}[")):
            raise
        raise ConfigError(_join(path, exc.path) if exc.path else path, exc.problem) from None


def check_plugin_options(given: Mapping[str, Any], active: Mapping[str, Any], section: str, listed_in: str,
                         label: str) -> None:
    """``<section>.<name>`` settings (``given``) only for a plugin listed in ``listed_in`` (``active``: name ->
    its registration) whose descriptor takes a ``config`` dataclass."""
    for name in given:
        if name not in active:
            raise ConfigError(f"{section}.{name}", f"'{name}' is not in {listed_in} (listed: "
                                                   f"{', '.join(active) or 'none'}){did_you_mean(name, active)}")
        if active[name].descriptor.config is None:
            raise ConfigError(f"{section}.{name}", f"{label} '{name}' ({active[name].provenance}) takes no options")


def plugin_configs(active: Mapping[str, Any], values: Mapping[str, Any], section: str) -> dict[str, Any]:
    """Each active plugin's ``config`` dataclass built from ``values[name]`` (defaults if absent)."""
    return {name: from_dict(item.descriptor.config, values.get(name, {}), f"{section}.{name}")
            for name, item in active.items() if item.descriptor.config is not None}


def _nullable(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


def convert(annotation: Any, value: Any, path: str) -> Any:
    """``value`` checked (and where lossless, converted) against the type annotation."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        return _union(args, value, path)
    if origin is Literal:
        if value in args:
            return value
        dtype = set(args) <= set(TORCH_NAMES)
        if dtype and short_name(value) in args:  # a dtype: bfloat16 == bf16
            return short_name(value)
        choices = ", ".join(repr(a) for a in args) + (" (or torch's names: 'bfloat16', ...)" if dtype else "")
        hint = did_you_mean(str(value), _spellings(args))
        raise ConfigError(path, f"expected one of {choices}, got {_show(value)}{hint}")
    if dataclasses.is_dataclass(annotation):
        shorthand = getattr(annotation, "FROM_STRING", None)  # a ClassVar: the field a lone string fills
        if shorthand is not None and isinstance(value, str):
            value = {shorthand: value}
        return from_dict(annotation, value, path, nested=True)
    if origin in (list, tuple) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {_show(value)}")
        fixed = origin is tuple and args and args[-1] is not Ellipsis  # tuple[int, int]: one type per place
        if fixed and len(value) != len(args):
            raise ConfigError(path, f"expected a list of {len(args)}, got {len(value)}")
        kinds = args if fixed else [args[0] if args else Any] * len(value)
        items = [convert(item, v, f"{path}[{i}]") for i, (item, v) in enumerate(zip(kinds, value, strict=True))]
        return tuple(items) if (origin or annotation) is tuple else items
    if origin in (dict, Mapping, typing.Mapping) or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping, got {_show(value)}")
        key_t, val_t = args if args else (Any, Any)
        return {convert(key_t, k, path): convert(val_t, v, _join(path, str(k))) for k, v in value.items()}
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(float(value), path)
        raise ConfigError(path, f"expected a number, got {_show(value)}{_text_number(value)}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(path, f"expected an integer, got {_show(value)}")
    if annotation in (bool, str):
        if isinstance(value, annotation):
            return value
        raise ConfigError(path, f"expected {_TYPE_NAMES[annotation]}, got {_show(value)}")
    if annotation is type(None):
        if value is None:
            return None
        raise ConfigError(path, f"expected null, got {_show(value)}")
    raise TypeError(f"posttune.config: unsupported annotation {annotation!r} at {path}")


def unreadable_field(cls: type) -> str | None:
    """``field: annotation`` of the first field of dataclass ``cls`` (nested dataclasses too) whose type ``convert``
    cannot read from YAML (a ``Path``, an ``Enum``, ``bytes``), or whose annotation does not resolve; None when
    every one can. Checked when a plugin registers, so that the error names the plugin, not a user's key."""
    try:
        hints = get_type_hints(cls)
    except Exception as exc:  # noqa: BLE001 - a forward reference that does not resolve, whatever it raises
        return f"{cls.__name__}: its annotations do not resolve ({type(exc).__name__}: {exc})"
    for f in dataclasses.fields(cls):
        if f.init and (problem := _unreadable(hints[f.name])) is not None:
            return f"{f.name}: {problem}"
    return None


def _unreadable(annotation: Any) -> str | None:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is Any or annotation in _TYPE_NAMES or annotation in (type(None), list, tuple, dict):
        return None
    if origin is Literal:
        return None
    if dataclasses.is_dataclass(annotation):
        return unreadable_field(annotation)
    if origin in (Union, types.UnionType, list, tuple, dict, Mapping, typing.Mapping):
        return next((problem for arg in args if arg is not Ellipsis and (problem := _unreadable(arg))), None)
    return (f"{annotation!r} cannot be read from a config (use str, int, float, bool, Literal, list, dict or a "
            "dataclass)")


def _finite(value: float, path: str) -> float:
    """Infinity and NaN are never a setting: `.inf`/`.nan` in YAML is a slip, not a request."""
    if not math.isfinite(value):
        raise NonFinite(path, f"expected a finite number, got {value!r}")
    return value


class NonFinite(ConfigError):
    """A float field given ``.inf`` or ``.nan``: reported as such, not as "expected a number or null"."""


def _union(args: tuple[Any, ...], value: Any, path: str) -> Any:
    if value is None and type(None) in args:
        return None
    for option in (a for a in args if a is not type(None)):
        try:
            return convert(option, value, path)
        except ConfigError as exc:
            if exc.path != path or isinstance(exc, NonFinite):  # a problem deeper inside names its own field
                raise
    expected = " or ".join(_describe(a) for a in args)
    literal = next((get_args(a) for a in args if get_origin(a) is Literal), ())
    hint = did_you_mean(str(value), _spellings(literal)) if isinstance(value, str) and literal else ""
    raise ConfigError(path, f"expected {expected}, got {_show(value)}{hint}")


def _spellings(choices: tuple[Any, ...]) -> list[str]:
    """What a hint may suggest for a ``Literal``: its values, and for a dtype torch's full names too."""
    names = [str(a) for a in choices]
    return names + [TORCH_NAMES[a] for a in choices] if set(choices) <= set(TORCH_NAMES) else names


def _text_number(value: Any) -> str:
    """A hint for ``'1e-3'`` in a mapping from PyYAML (YAML 1.1 reads a number without a dot as text; posttune's
    loader, YAML 1.2, reads it as a number): the mapping's author did not quote it."""
    if not (isinstance(value, str) and re.fullmatch(r"[-+]?\d+[eE][-+]?\d+", value)):  # YAML 1.1's blind spot
        return ""
    return " (text: PyYAML's safe_load reads 1e-3 so; write 1.0e-3, or give the file's path)"


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp in _TYPE_NAMES:
        return _TYPE_NAMES[tp]
    origin = get_origin(tp) or tp
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin in (dict, Mapping) or dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    return f"a {'mapping' if isinstance(value, Mapping) else type(value).__name__}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def plain(value: Any) -> Any:
    """YAML-safe data: dataclasses by their init fields (what the loader accepts back), tuples as lists.

    A dataset mixture (``DatasetConfig.sources``, filled from a YAML list) is written back as that list.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if getattr(value, "sources", None):
            return [plain(source) for source in value.sources]
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value
