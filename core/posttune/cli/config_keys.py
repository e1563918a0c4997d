"""`posttune config keys` and `posttune config show`: every config key, its type, default and meaning.

The listing is generated from the dataclasses themselves (the run schema in
``posttune.config.schema`` and the ``config`` dataclass of every installed method, parallel
plan, memory technique, reward function and metric logger), so it cannot drift from what ``validate``
accepts. A field's meaning is the ``metadata={"help": ...}`` of the field if it has one, else
the comment on its line (``x: int = 1  # meaning``), else the comment lines directly above it.
docs/config.md's "Reference" section is this listing as Markdown; regenerate it with
``python -m posttune.cli.config_keys`` (a test fails when it is out of date).

This module must not import torch: `config keys` reads only dataclasses and source comments.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from posttune.config.typed import plain
from posttune.errors import ConfigError, did_you_mean

#: marks around the generated part of docs/config.md
START, END = "<!-- keys:start -->", "<!-- keys:end -->"
REGENERATE = "python -m posttune.cli.config_keys docs/config.md"
#: descriptor kinds whose ``config`` dataclass is listed: kind -> (section, how a key is titled)
PLUGIN_KINDS = {
    "method": ("method", "method ({name})"),
    "parallel_plan": ("parallel", "parallel.options.{name}"),
    "memory_technique": ("memory_options", "memory_options.{name}"),
    "reward_function": ("rewards", "rewards ({name})"),
    "metric_logger": ("logging_options", "logging_options.{name}"),
}
#: what a group of plugin keys is, shown above it
PLUGIN_NOTES = {
    "method": "settings of method '{name}', beside `name` under `method:`",
    "parallel_plan": "settings of parallel plan '{name}' (when it is in `parallel.plans`)",
    "memory_technique": "settings of memory technique '{name}' (when it is in `memory`)",
    "reward_function": "options of reward '{name}': `options:` of its entry in a method's `rewards` "
                       "(grpo: `method.rewards: [{{name: {name}, options: {{...}}}}]`)",
    "metric_logger": "settings of tracker '{name}' (when it is in `logging`; docs/trackers.md)",
}
#: keys that exist in YAML but are no dataclass field: `method` is a name or a mapping
EXTRA_KEYS = {"method": ("method.name", "str", "required",
                         "the method to run (`posttune ls methods`); its settings sit beside it "
                         "(see the `method (NAME)` keys)")}


@dataclass(frozen=True)
class Key:
    """One config key: its dotted path, type, default (as YAML) and meaning."""

    key: str
    type: str
    default: str
    meaning: str
    allowed: str = ""  # the range `validate` enforces, where one is known


@dataclass(frozen=True)
class Group:
    """Keys listed together: the core schema's, or one plugin's config dataclass."""

    section: str  # what `config keys SECTION` matches
    title: str  # "" for the core schema; e.g. "method (sft)" for a plugin
    provider: str  # "" for the core schema; e.g. "posttune-sft 0.1.0"
    distribution: str  # the provider's distribution, "posttune" for the core
    note: str
    keys: tuple[Key, ...]
    known_as: tuple[tuple[str, str], ...] = ()  # (a transformers or TRL key, where it is here): ``KNOWN_AS``


# ---- meanings: field metadata or source comments ---------------------------------------------

def field_meanings(cls: type) -> dict[str, str]:
    """Field name -> one-line meaning, for every field of dataclass ``cls`` that has one."""
    meanings: dict[str, str] = {}
    for base in reversed(cls.__mro__):  # a subclass's comment wins over its base's
        if dataclasses.is_dataclass(base):
            meanings.update(_source_comments(base))
    for f in dataclasses.fields(cls):
        help_text = f.metadata.get("help") if f.metadata else None
        if help_text:
            meanings[f.name] = " ".join(str(help_text).split())
    return meanings


@functools.cache
def _source_comments(cls: type) -> dict[str, str]:
    """The comments of ``cls``'s own annotated fields: trailing on the field's last line, or the
    block of comment lines right above it. A class without source (made at run time) has none."""
    try:
        source = textwrap.dedent("".join(inspect.getsourcelines(cls)[0]))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return {}
    comments = _comments_by_line(source)
    body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef)), [])
    found = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = _trailing(comments, node) or _above(comments, node.lineno)
            if text:
                found[node.target.id] = text
    return found


def _comments_by_line(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text without ``#``/``#:``, whether the comment is alone on its line)."""
    lines = source.splitlines()
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            text = tok.string.lstrip("#").removeprefix(":").strip()
            comments[row] = (text, not lines[row - 1][:col].strip())
    return comments


def _trailing(comments: dict[int, tuple[str, bool]], node: ast.AnnAssign) -> str:
    text, alone = comments.get(node.end_lineno or node.lineno, ("", True))
    return "" if alone else text


def _above(comments: dict[int, tuple[str, bool]], line: int) -> str:
    block = []
    while (line - 1) in comments and comments[line - 1][1]:
        line -= 1
        block.insert(0, comments[line][0])
    return " ".join(part for part in block if part)


# ---- types and defaults -------------------------------------------------------------------------

def type_name(tp: Any) -> str:
    """An annotation as a user reads it: ``int | null``, ``fp32 | bf16 | fp16``, ``list[str]``."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return "any"
    if tp is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(names + (["null"] if type(None) in args else []))
    if origin is Literal:
        return " | ".join(str(a) if isinstance(a, str) else _yaml(a) for a in args)
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if origin in (list, tuple, dict, Mapping, typing.Mapping):
        name = "dict" if origin in (dict, Mapping, typing.Mapping) else origin.__name__
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    return getattr(tp, "__name__", str(tp))


def _yaml(value: Any) -> str:
    """``value`` as one line of YAML flow text (what a user would write in a config)."""
    import yaml

    text = yaml.safe_dump(plain(value), default_flow_style=True, allow_unicode=True, sort_keys=False,
                          width=1_000_000)
    return text.removesuffix("...\n").strip()


def default_text(f: dataclasses.Field) -> str:
    """The field's default as YAML; ``required`` when it has none, ``{}`` for a section of defaults."""
    if f.default is not dataclasses.MISSING:
        return _yaml(f.default)
    if f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default_factory()
    return "{}" if dataclasses.is_dataclass(value) else _yaml(value)


def _section_type(tp: Any) -> tuple[type | None, str]:
    """The dataclass a field's keys continue in (direct, optional, a list's items or a mapping's
    values) and the suffix its keys take (``[]`` for list items, ``.<name>`` for a mapping's
    entries); (None, "") for a leaf."""
    options = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) in (Union, types.UnionType) \
        else [tp]
    if len(options) == 1 and dataclasses.is_dataclass(options[0]):
        return options[0], ""
    if len(options) == 1 and get_origin(options[0]) in (list, tuple) and get_args(options[0]) \
            and dataclasses.is_dataclass(get_args(options[0])[0]):
        return get_args(options[0])[0], "[]"
    if len(options) == 1 and get_origin(options[0]) in (dict, Mapping) and len(get_args(options[0])) == 2 \
            and dataclasses.is_dataclass(get_args(options[0])[1]):
        return get_args(options[0])[1], ".<name>"
    return None, ""


def _allowed(dotted: str, tp: Any) -> str:
    """The range ``validate`` enforces for a core key (config/ranges.py), or its choice of names."""
    from posttune.config.ranges import RANGES
    from posttune.config.schema import OPTIMIZER_NAMES, SCHEDULE_NAMES

    names = {"train.optimizer": OPTIMIZER_NAMES, "train.scheduler": SCHEDULE_NAMES}.get(dotted)
    if names:
        return f"{' | '.join(names)}, or a mapping with `_component_`"
    if dotted == "parallel.dims":
        return "each degree an integer >= 1, or -1 for the rest of the processes"
    allowed = RANGES.get(dotted) or RANGES.get(re.sub(r"^data\.(train|validation)\.", "dataset.", dotted))
    if allowed is None:
        return ""
    integer = "int" in type_name(tp).split(" | ")
    off = f"; null: {allowed.off}" if allowed.off else ""
    return f"{allowed.describe(integer)}{off}"


def dataclass_keys(cls: type, prefix: str, *, ranges: bool = False) -> Iterator[Key]:
    """A key for every field of ``cls`` under ``prefix``, recursing into nested dataclasses."""
    try:
        hints = get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation a plugin cannot resolve: show it as written
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
    meanings = field_meanings(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints.get(f.name, f.type)
        shown = tp if isinstance(tp, str) else type_name(tp)
        allowed = _allowed(dotted, tp) if ranges and not isinstance(tp, str) else ""
        yield Key(dotted, shown, default_text(f), meanings.get(f.name, ""), allowed)
        if dotted in EXTRA_KEYS:
            yield Key(*EXTRA_KEYS[dotted])
        inner, suffix = (None, "") if isinstance(tp, str) else _section_type(tp)
        if inner is not None:
            yield from dataclass_keys(inner, dotted + suffix, ranges=ranges)


# ---- groups: the core schema and the installed plugins -----------------------------------------

def core_groups() -> list[Group]:
    """One group per top-level section of the run config."""
    from posttune.config.schema import RunConfig

    groups: dict[str, list[Key]] = {}
    for key in dataclass_keys(RunConfig, "", ranges=True):
        groups.setdefault(key.key.split(".")[0], []).append(key)
    hints = get_type_hints(RunConfig)
    known = {section: tuple(getattr(_section_type(hints[section])[0], "KNOWN_AS", {}).items()) for section in groups
             if section in hints}
    return [Group(section, "", "", "posttune", "", tuple(keys), known.get(section, ())) for section, keys in
            groups.items()]


def plugin_groups(registry: Any) -> list[Group]:
    """A group for each registered method, plan, memory technique and reward with a config dataclass."""
    groups = []
    for kind, (section, title) in PLUGIN_KINDS.items():
        for item in registry.items(kind):
            config = getattr(item.descriptor, "config", None)
            if not (isinstance(config, type) and dataclasses.is_dataclass(config)):
                continue
            name = item.descriptor.name
            groups.append(Group(section, title.format(name=name), str(item.provenance),
                                item.provenance.distribution, PLUGIN_NOTES[kind].format(name=name),
                                tuple(dataclass_keys(config, title.format(name=name))),
                                tuple(getattr(config, "KNOWN_AS", {}).items())))
    return groups


def all_groups(registry: Any = None) -> list[Group]:
    if registry is None:
        from posttune.plugins import get_registry

        registry = get_registry()
    return core_groups() + plugin_groups(registry)


def sections(groups: list[Group]) -> list[str]:
    return list(dict.fromkeys(group.section for group in groups))


def select(groups: list[Group], section: str | None) -> list[Group]:
    """The groups of ``section`` (all for None); an unknown section is a one-line ConfigError."""
    if section is None:
        return groups
    known = sections(groups)
    if section not in known:
        hint = did_you_mean(section, known) or f" (sections: {', '.join(known)})"
        raise ConfigError(section, "unknown section" + hint)
    return [group for group in groups if group.section == section]


# ---- output --------------------------------------------------------------------------------------

def text_lines(groups: list[Group]) -> list[str]:
    """Aligned lines: KEY  TYPE  DEFAULT  MEANING [allowed]; a header above each plugin's keys."""
    keys = [key for group in groups for key in group.keys]
    widths = [min(max((len(getattr(k, col)) for k in keys), default=0), cap)
              for col, cap in (("key", 48), ("type", 28), ("default", 24))]
    lines = []
    for group in groups:
        if group.title:
            lines += ["", f"{group.title}  [{group.provider}]: {group.note}"]
        for k in group.keys:
            allowed = f" [{k.allowed}]" if k.allowed else ""
            cells = [k.key.ljust(widths[0]), k.type.ljust(widths[1]), k.default.ljust(widths[2])]
            lines.append(f"{'  '.join(cells)}  {k.meaning}{allowed}".rstrip())
    return lines


def documented(groups: list[Group]) -> list[Group]:
    """The core's and the first-party plugins' groups: what docs/config.md documents, the same
    wherever it is generated (a third-party or example plugin installed here is left out)."""
    from posttune import first_party

    names = {"posttune", *(dist for kind in first_party.NAMES.values() for dist in kind.values())}
    return [group for group in groups if group.distribution in names]


def markdown(groups: list[Group]) -> str:
    """The "Reference" section of docs/config.md: a table for the core schema and each plugin."""
    out = [START, f"<!-- generated by `{REGENERATE}` from the schema and plugin dataclasses; "
                  "do not edit by hand -->", ""]
    core = [key for group in groups if not group.title for key in group.keys]
    out += ["### The run config", "", *_table(core)]
    for group in (g for g in groups if g.title):
        out += ["", f"### `{group.title}` ({group.distribution})", "", _cell(group.note) + ".", "",
                *_table(list(group.keys))]
    return "\n".join([*out, "", *_known_as_table(groups), "", END])


def _known_as_table(groups: list[Group]) -> list[str]:
    """Keys of transformers', TRL's, PEFT's and axolotl's configs and where each is here (what `validate` says when
    one is written in the section its row names): a recipe brought from there, translated at a glance."""
    rows: dict[tuple[str, str], list[str]] = {}
    for group in groups:
        for theirs, here in group.known_as:
            rows.setdefault((theirs, here), []).append(f"`{group.title or group.section}`")
    return ["### Keys as transformers, TRL, PEFT, axolotl and torchtune name them", "",
            "Written in a section the last column names, each is refused with its place here.", "",
            "| theirs | here | written in |", "|---|---|---|",
            *(f"| `{theirs}` | {_cell(here)} | {', '.join(where)} |" for (theirs, here), where in rows.items())]


def _table(keys: list[Key]) -> list[str]:
    """A Markdown table; the ``allowed`` column only where some key has a known range."""
    ranged = any(k.allowed for k in keys)
    rows = ["| key | type | default | meaning |" + (" allowed |" if ranged else ""),
            "|---|---|---|---|" + ("---|" if ranged else "")]
    for k in keys:
        default = "required" if k.default == "required" else f"`{_cell(k.default)}`"
        allowed = f" {_cell(k.allowed)} |" if ranged else ""
        rows.append(f"| `{_cell(k.key)}` | `{_cell(k.type)}` | {default} | {_cell(k.meaning)} |{allowed}")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def replace_reference(document: str, generated: str) -> str:
    """``document`` with the text between the markers (markers included) replaced."""
    start, end = document.find(START), document.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the document lacks the markers {START} ... {END}")
    return document[:start] + generated + document[end + len(END):]


# ---- posttune config keys / show -----------------------------------------------------------------

def configure(parser: argparse.ArgumentParser, show_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    """``config keys [SECTION] [--markdown]`` and ``config show CONFIG [overrides]`` (whose
    arguments are ``validate``'s, so it resolves exactly what ``train`` would)."""
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    keys = actions.add_parser("keys", help="every config key with its type, default and meaning",
                              description="every config key with its type, default and meaning, "
                                          "including the installed plugins' settings", **_examples("keys"))
    keys.add_argument("section", nargs="?", help="only this top-level section (e.g. train, method, memory_options)")
    keys.add_argument("--markdown", action="store_true",
                      help="print docs/config.md's Reference section (the core and first-party plugins)")
    show = actions.add_parser("show", help="print a config fully resolved, every default filled in (YAML)",
                              description="load, override and validate a config as `posttune train` does, "
                                          "then print it with every default filled in, as YAML", **_examples("show"))
    show_arguments(show)


#: two command lines per action, shown under "examples:" in its --help, as every command's are
EXAMPLES = {
    "keys": ("posttune config keys train", "posttune config keys --markdown"),
    "show": ("posttune config show llama-demo-reverse", "posttune config show my-run.yaml train.lr=1e-3 ~adapter"),
}


def _examples(action: str) -> dict[str, Any]:
    """The epilog (and the formatter that keeps its lines) the top-level parser gives each command's --help."""
    lines = "\n".join(f"  {line}" for line in EXAMPLES[action])
    return {"epilog": f"examples:\n{lines}", "formatter_class": argparse.RawDescriptionHelpFormatter}


def run(args: argparse.Namespace, resolve: Callable[[argparse.Namespace], Any]) -> int:
    if args.config_action == "show":
        import yaml

        print(yaml.safe_dump(resolved_config(resolve(args)), sort_keys=False, allow_unicode=True), end="")
        return 0
    groups = select(all_groups(), args.section)
    print(markdown(documented(groups)) if args.markdown else "\n".join(text_lines(groups)))
    return 0


def resolved_config(plan: Any) -> dict[str, Any]:
    """The run config of a resolved plan as plain data, with the defaults of the method's settings
    and of the active plans' and memory techniques' options filled in: it validates back to the same run."""
    data = plain(plan.config)
    data["method"] = {"name": plan.method.descriptor.name, **plain(plan.method_config)}
    data["parallel"]["options"] = plain(plan.parallel_options)
    data["memory_options"] = plain(plan.memory_options)
    data["logging_options"] = plain(plan.logging_options)
    return data


def main(argv: list[str] | None = None) -> int:
    """``python -m posttune.cli.config_keys [DOC]``: rewrite DOC's Reference (default: print it)."""
    argv = sys.argv[1:] if argv is None else argv
    generated = markdown(documented(all_groups()))
    if not argv:
        print(generated)
        return 0
    path = Path(argv[0])
    path.write_text(replace_reference(path.read_text(), generated))
    print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
