"""Load YAML configs safely and apply ``a.b.c=value`` / ``~a.b`` command-line overrides."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from posttune.errors import ConfigError, PosttuneError, first_line


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-5`` as a float (YAML 1.1 wants ``1.0e-5``; users write ``1e-5``)
    and refuses a key given twice in one mapping (PyYAML keeps the last, so the first vanishes)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Check a mapping's own keys before ``<<: *base`` merges prepend the base's keys to them
        (an explicit key overriding a merged one is the point of a merge, not a duplicate). The
        first call for a node sees its keys as written: a merge flattens its base in place."""
        if id(node) not in self._checked:
            self._checked.add(id(node))
            _refuse_duplicate_keys(self, node)
        super().flatten_mapping(node)


def _refuse_duplicate_keys(loader: _Loader, node: yaml.MappingNode) -> None:
    """Scalar keys are compared as constructed (``1`` and ``1.0`` are one dict key); others are
    left to PyYAML, which refuses unhashable keys itself."""
    first: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        key = _key(loader, key_node)
        try:
            seen = first.setdefault(key, key_node)
        except TypeError:
            continue
        if seen is not key_node:
            shown = "<<" if key_node.tag == _MERGE else key
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {shown!r} (first at line {seen.start_mark.line + 1})",
                key_node.start_mark)


_MERGE, _VALUE = "tag:yaml.org,2002:merge", "tag:yaml.org,2002:value"


def _key(loader: _Loader, key_node: yaml.ScalarNode) -> Any:
    """A key as the mapping will hold it; a merge (``<<``) and a plain ``=`` have no constructor
    of their own (flattening turns ``=`` into the string)."""
    if key_node.tag == _MERGE:
        return (_MERGE,)
    if key_node.tag == _VALUE:
        return key_node.value
    return loader.construct_object(key_node)


_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
#: YAML 1.2's integers: ``010`` is ten (YAML 1.1 read it as octal 8, ``1:30`` as 90), ``0o10`` octal, ``0x10`` hex
_INT = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7]+|0x[0-9a-fA-F]+)$")
_NUMBERS = ("tag:yaml.org,2002:float", "tag:yaml.org,2002:int")
_Loader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag not in _NUMBERS]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))


def _int(loader: _Loader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)


_Loader.add_constructor("tag:yaml.org,2002:int", _int)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
        _refuse_cycles(data, source)
        return data
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        if isinstance(exc, yaml.reader.ReaderError):  # a control character: binary data, not YAML text
            line = text[:exc.position].count("\n") + 1
            code = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "\0")
            raise PosttuneError(f"{source}:{line}: invalid YAML: control character {code:#04x} "
                                f"(is this a binary file?)") from None
        problem = getattr(exc, "problem", None) or first_line(str(exc))
        raise PosttuneError(f"{source}{where}: invalid YAML: {problem}") from exc
    except RecursionError:  # PyYAML composes nested collections recursively
        raise PosttuneError(f"{source}: invalid YAML: nested too deeply (no config nests more than a few "
                            "levels)") from None


#: values a config may expand to through YAML aliases (a "billion laughs" document is tiny on disk)
MAX_VALUES = 100_000
CHARS_PER_VALUE = 64


def _refuse_cycles(data: Any, source: str) -> None:
    """An anchor used inside itself (``&a [*a]``) loads as a list that contains itself, and nested
    aliases can expand a few lines into billions of values: every walk over the config
    (validation, ``_component_``, saving it with a checkpoint) would never end. Each shared node
    is sized once, so this check itself stays linear."""
    sizes: dict[int, int] = {}

    def size(node: Any, inside: frozenset[int]) -> int:
        if isinstance(node, str):  # a long string aliased many times expands too: one value per 64 characters
            return 1 + len(node) // CHARS_PER_VALUE
        if not isinstance(node, (dict, list)):
            return 1
        if id(node) in inside:
            raise PosttuneError(f"{source}: invalid YAML: an anchor is used inside itself (&a ... *a); "
                                "a config is a tree")
        if id(node) not in sizes:
            children = node.values() if isinstance(node, dict) else node
            sizes[id(node)] = 1 + sum(size(child, inside | {id(node)}) for child in children)
            if sizes[id(node)] > MAX_VALUES:
                raise PosttuneError(f"{source}: invalid YAML: its aliases (*name) expand to more than "
                                    f"{MAX_VALUES:,} values (a string counts one per {CHARS_PER_VALUE} characters)")
        return sizes[id(node)]

    size(data, frozenset())


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; empty files give an empty mapping."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PosttuneError(f"config file not found: {path}") from None
    except OSError as exc:
        raise PosttuneError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise PosttuneError(f"{path}:{line}: not UTF-8 text (a YAML config is text; save it as UTF-8)") from None
    data = parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PosttuneError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def parse_value(text: str) -> Any:
    """An override's value, typed as YAML types it: ``3``, ``1e-4``, ``true``, ``null``, ``[1,2]``."""
    if text == "":
        return ""
    try:
        return parse_yaml(text)
    except PosttuneError:
        return text  # not YAML (e.g. 'a: b: c'): keep the literal string


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` (set, creating mappings) and ``~key.path`` (delete) in order."""
    for override in overrides:
        if override.startswith("~"):
            _delete(config, _split(override[1:], override))
        elif "=" in override:
            key, _, value = override.partition("=")
            _set(config, _split(key, override), parse_value(value))
        else:
            raise ConfigError("", f"override '{override}': expected KEY=VALUE or ~KEY")
    return config


def _split(key: str, override: str) -> list[str]:
    parts = _INDEX.sub(r".\1", key.strip()).split(".")  # data.train[1].format, as errors write it: data.train.1
    if not all(parts):
        raise ConfigError("", f"override '{override}': empty key in '{key}'")
    return parts


def _walk(config: dict[str, Any], parts: list[str], *, create: bool) -> dict[str, Any] | list[Any]:
    """The mapping or list that holds ``parts[-1]``; a name's short form on the way is made the
    mapping it stands for (``method: x`` with ``method.k=v``: ``{name: x, k: v}``)."""
    node: dict[str, Any] | list[Any] = config
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            child = node[_index(node, part, where)]
        elif node.get(part) is None and create:
            child = node[part] = {}
        elif part not in node:
            raise ConfigError(where, "no such key")
        else:
            child = node[part] = _long_form(where, node[part], parts[depth + 1])
        if not isinstance(child, (dict, list)):
            raise ConfigError(where, f"is {type(child).__name__} {child!r}, not a mapping")
        node = child
    return node


#: sections whose string value is short for ``{field: value}`` (``method: dpo``, ``adapter: lora``): a dotted
#: key under one writes the long form, as it would under the mapping the string stands for
NAME_SHORT_FORMS = {"method": "name", "adapter": "kind"}
#: fields whose string value names a built-in and whose mapping is a ``_component_`` (one for example): a built-in
#: name stands for no mapping
COMPONENT_FIELDS = {"train.optimizer": "torch.optim.AdamW", "train.scheduler": "torch.optim.lr_scheduler.StepLR"}


def _long_form(where: str, given: Any, key: str) -> Any:
    """``given`` as the mapping it stands for where a string is a name's short form (``key`` goes under it);
    else as is."""
    if not isinstance(given, str):
        return given
    if where in NAME_SHORT_FORMS:
        return {NAME_SHORT_FORMS[where]: given}
    if where in COMPONENT_FIELDS:
        if key == "_component_":  # the built-in name gives way to a component
            return {}
        raise ConfigError(where, f"is the built-in {given!r}, which takes no {key}; a component's arguments follow "
                                 f"its {where}._component_=... override (e.g. {COMPONENT_FIELDS[where]})")
    return given


_INDEX = re.compile(r"\[(-?\d+)\]")


def _index(node: list[Any], part: str, where: str) -> int:
    try:
        index = int(part)
        node[index]
    except (ValueError, IndexError):
        raise ConfigError(where, f"no item '{part}' in a list of {len(node)}") from None
    return index


def _set(config: dict[str, Any], parts: list[str], value: Any) -> None:
    node = _walk(config, parts, create=True)
    if isinstance(node, list):
        node[_index(node, parts[-1], ".".join(parts))] = value
    else:
        node[parts[-1]] = value


def _delete(config: dict[str, Any], parts: list[str]) -> None:
    node = _walk(config, parts, create=False)
    if isinstance(node, list):
        del node[_index(node, parts[-1], ".".join(parts))]
    elif parts[-1] in node:
        del node[parts[-1]]
    else:
        raise ConfigError(".".join(parts), "no such key to delete")


def load_config(source: str | Path | Mapping[str, Any], overrides: list[str] | None = None) -> dict[str, Any]:
    """Raw config mapping from a file (or bundled config name, or a mapping built in Python) with overrides applied.

    A first-party role's old top-level section (``first_party.ROLE_SECTIONS``) is read as
    `models.<role>` in the file and in an override alike, so either spelling overrides either.
    """
    from posttune.config.bundled import resolve_config_path, resolve_package_paths
    from posttune.config.schema import role_sections

    if isinstance(source, Mapping):  # a copy: the caller's mapping is left as it was
        data = role_sections(copy.deepcopy(dict(source)))
    else:
        path = resolve_config_path(source)
        data = role_sections(load_yaml(path))
        if not data and not overrides:  # an empty file (or only comments): not a config missing its `model:`
            raise PosttuneError(f"{path}: the config file is empty (a config names a model, a method and data: "
                                "`posttune cp` copies a bundled one to start from)")
    if isinstance(data, dict):  # top-level x-* keys hold YAML anchors for the rest (docker compose's convention)
        data = {key: value for key, value in data.items() if not (isinstance(key, str) and key.startswith("x-"))}
    data = apply_overrides(data, [_new_spelling(o) for o in overrides or []])
    _refuse_interpolation(data, "")
    return resolve_package_paths(data)


#: a ``${...}`` variable (torchtune's and OmegaConf's ``${output_dir}``, ``${oc.env:HOME}``), and the keys of paths
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*")  # ${...}, and a shell's $NAME left unexpanded
_PATH_KEYS = ("path", "dir", "init_from", "resume")


def _refuse_interpolation(node: Any, where: str) -> None:
    """A path holding ``${...}`` or ``$NAME``: no variable is filled in here, and the path would be taken as written
    (a folder named ``${oc.env:OUT}``), so it is refused, pointing to the shell, which expands ``$OUT`` in an
    override."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        path = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
        if isinstance(value, str) and str(key).endswith(_PATH_KEYS) and (found := _VARIABLE.search(value)):
            raise ConfigError(path.lstrip("."), f"{found.group()} is not filled in (a config has no variables); "
                                                f"let the shell expand one: {path.lstrip('.')}=$OUT/run")
        _refuse_interpolation(value, path)


def _new_spelling(override: str) -> str:
    """``ROLE.path=x`` -> ``models.ROLE.path=x`` (and ``~ROLE`` -> ``~models.ROLE``) for an old role section."""
    from posttune import first_party

    prefix = "~" if override.startswith("~") else ""
    first = override[len(prefix):].split("=", 1)[0].split(".", 1)[0].strip()
    return f"{prefix}models.{override[len(prefix):].lstrip()}" if first in first_party.ROLE_SECTIONS else override
