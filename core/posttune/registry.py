"""What installed plugins registered, by kind and name, each with its provenance."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from posttune import descriptors as d
from posttune import first_party
from posttune.errors import PluginError, UnknownNameError, did_you_mean

T = TypeVar("T")


@dataclass(frozen=True)
class Kind:
    """One kind of registration: the hook that carries it and the descriptor type it takes."""

    key: str  # "model_family"
    hook: str  # "posttune_register_model_families"
    type: type
    label: str  # "model family", used in messages
    plural: str  # "families", used by `posttune ls`


KINDS: dict[str, Kind] = {
    k.key: k
    for k in (
        Kind("model_family", "posttune_register_model_families", d.ModelFamily, "model family", "families"),
        Kind("checkpoint_converter", "posttune_register_checkpoint_converters", d.CheckpointConverter,
             "checkpoint converter", "converters"),
        Kind("quantized_format", "posttune_register_quantized_formats", d.QuantizedFormat,
             "quantized checkpoint format", "quantized"),
        Kind("method", "posttune_register_methods", d.Method, "method", "methods"),
        Kind("parallel_plan", "posttune_register_parallel_plans", d.ParallelPlan, "parallel plan", "plans"),
        Kind("memory_technique", "posttune_register_memory_techniques", d.MemoryTechnique,
             "memory technique", "memory"),
        Kind("adapter_kind", "posttune_register_adapter_kinds", d.AdapterKind, "adapter kind", "adapters"),
        Kind("dataset_format", "posttune_register_datasets", d.DatasetFormat, "dataset format", "datasets"),
        Kind("reward_function", "posttune_register_reward_functions", d.RewardFunction,
             "reward function", "rewards"),
        Kind("generation_engine", "posttune_register_generation_engines", d.GenerationEngine,
             "generation engine", "engines"),
        Kind("metric_logger", "posttune_register_metric_loggers", d.MetricLogger, "metric logger", "loggers"),
        Kind("config", "posttune_register_configs", d.BundledConfig, "bundled config", "configs"),
        Kind("command", "posttune_register_commands", d.Command, "command", "commands"),
    )
}
HOOK_ARG = {kind.hook: ("cli" if kind.key == "command" else "register") for kind in KINDS.values()}


@dataclass(frozen=True)
class Provenance:
    """Where a registration came from: the plugin (entry point) and its distribution."""

    plugin: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}"


@dataclass(frozen=True)
class Registered(Generic[T]):
    descriptor: T
    provenance: Provenance


class DescriptorError(PluginError):
    """A descriptor a registration hook was given is unusable; the plugin and hook are named by the caller."""


#: a registered name: what a config, an override and `posttune ls` write (no spaces or shell characters)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def descriptor_problem(descriptor: Any) -> str | None:
    """What is wrong with a descriptor's fields, checked when it registers so that the plugin's author hears it
    there, not a user mid-run: a name that is no name, a string where a tuple of them goes (``("x")``, a missing
    comma), a callback that cannot be called, a config that is no dataclass or has a field no config can set."""
    from dataclasses import fields, is_dataclass

    from posttune.config.typed import unreadable_field

    for f in fields(descriptor):
        value, annotation = getattr(descriptor, f.name), str(f.type)
        if value is None and annotation.endswith("| None"):
            continue
        if f.name == "name" and not (isinstance(value, str) and NAME.fullmatch(value)):
            return f"name {value!r}: letters, digits, '_', '.' and '-' only"
        if f.name == "roles":
            if not callable(value) and (isinstance(value, str) or not isinstance(value, (tuple, list))):
                comma = " (a 1-tuple needs its comma: ('x',))" if isinstance(value, str) else ""
                return f"roles: expected a tuple of roles (or a function of the config), got {value!r}{comma}"
            continue
        if annotation == "tuple[str, ...]" and (isinstance(value, str) or not isinstance(value, (tuple, list))):
            return f"{f.name}: expected a tuple of strings, got {value!r} (a 1-tuple needs its comma: ('x',))"
        if f.name == "dataset_kind" and not (isinstance(value, str) or (
                isinstance(value, tuple) and value and all(isinstance(v, str) for v in value))):
            return f"dataset_kind: expected a kind's name or a tuple of them, got {value!r}"
        if annotation.startswith("Callable") and not callable(value):
            return f"{f.name}: expected a function, got {value!r}"
        choices = _literal_values(annotation)  # a stage, what a technique does to frozen roles, a split
        if choices and value not in choices:
            return f"{f.name}: expected one of {', '.join(map(repr, choices))}, got {value!r}"
        if annotation == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{f.name}: expected an integer, got {value!r}"
        if f.name == "config" and annotation.startswith("type"):
            if not (isinstance(value, type) and (is_dataclass(value) or issubclass(value, dict))):
                return f"config: expected a dataclass (the class itself), got {value!r}"
            problem = unreadable_field(value) if is_dataclass(value) else None
            if problem is not None:
                return f"config field {problem}"
    return None


def _literal_values(annotation: str) -> tuple[Any, ...]:
    """The values of the ``Literal`` a descriptor field's annotation names (``Stage``, ``FrozenModels``), else ()."""
    from posttune import descriptors

    alias = getattr(descriptors, annotation, None)
    return typing.get_args(alias) if typing.get_origin(alias) is typing.Literal else ()


class Register:
    """The typed object a registration hook receives: call it once per descriptor."""

    def __init__(self, kind: Kind, provenance: Provenance, sink: list[Registered]):
        self.kind = kind
        self.provenance = provenance
        self._sink = sink

    def __call__(self, descriptor: Any) -> None:
        if not isinstance(descriptor, self.kind.type):
            raise DescriptorError(f"given a {type(descriptor).__name__}; expected a {self.kind.type.__name__}")
        problem = descriptor_problem(descriptor)
        if problem is not None:
            raise DescriptorError(f"{type(descriptor).__name__} {getattr(descriptor, 'name', '?')!r}: {problem}")
        self._sink.append(Registered(descriptor, self.provenance))

    def __repr__(self) -> str:
        return f"<Register {self.kind.type.__name__} for {self.provenance.plugin}>"


@dataclass
class Registry:
    """Registered descriptors by kind and name. A duplicated name is kept as a conflict."""

    entries: dict[str, dict[str, Registered]] = field(default_factory=lambda: {k: {} for k in KINDS})
    #: (kind, name) -> every registration of a name more than one plugin registered (none is used)
    duplicates: dict[tuple[str, str], list[Registered]] = field(default_factory=dict)
    #: plugins that failed to load: plugin name -> (distribution, message)
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: installed distributions the environment's plugin selection left out
    left_out: set[str] = field(default_factory=set)

    def add(self, kind: str, item: Registered) -> None:
        name = item.descriptor.name
        existing = self.entries[kind].get(name)
        if existing is not None or (kind, name) in self.duplicates:
            holders = self.duplicates.setdefault((kind, name), [existing] if existing else [])
            holders.append(item)
            self.entries[kind].pop(name, None)
            return
        self.entries[kind][name] = item

    def names(self, kind: str) -> list[str]:
        return sorted(self._of(kind))

    def _of(self, kind: str) -> dict[str, Registered]:
        """The entries of ``kind``; an unknown kind (``posttune ls``'s plural, say) is one line naming the kinds."""
        if kind not in self.entries:
            plural = {k.plural: k.key for k in KINDS.values()}.get(kind)
            hint = f" (did you mean '{plural}'?)" if plural else did_you_mean(kind, KINDS)
            raise PluginError(f"no registry kind '{kind}'{hint}; the kinds: {', '.join(KINDS)}")
        return self.entries[kind]

    def items(self, kind: str) -> Iterator[Registered]:
        for name in self.names(kind):
            yield self.entries[kind][name]

    def get(self, kind: str, name: str) -> Any:
        """The descriptor registered as ``name``, or a one-line error saying what to do."""
        return self.lookup(kind, name).descriptor

    def lookup(self, kind: str, name: str) -> Registered:
        found = self._of(kind).get(name)
        if found is not None:
            return found
        raise self.unknown(kind, name)

    def unknown(self, kind: str, name: str) -> PosttuneErrorType:
        label = KINDS[kind].label
        holders = self.duplicates.get((kind, name))
        if holders:
            both = " and ".join(sorted(str(h.provenance) for h in holders))  # sorted: discovery order varies
            if len({str(h.provenance) for h in holders}) == 1:  # one plugin's hook registered it twice
                return PluginError(f"{label} '{name}' is registered twice by {holders[0].provenance}; its "
                                   "registration hook must register each name once")
            core = [h for h in holders if h.provenance.distribution == "posttune"]
            if kind == "command" and core:  # the CLI keeps the core's: the plugin's is the one to rename
                others = " and ".join(sorted(str(h.provenance) for h in holders if h not in core))
                return PluginError(f"command '{name}' is registered by both {both}; posttune's own is the one run: "
                                   f"{others} must name its command otherwise")
            return PluginError(
                f"{label} '{name}' is registered by both {both}; uninstall one, or pick one "
                f"with POSTTUNE_DISABLE_PLUGINS"
            )
        known = self.names(kind)
        distribution = first_party.NAMES.get(kind, {}).get(name)
        installed = ", ".join(known) if known else "none"
        message = f"no {label} '{name}' is installed (installed: {installed})"
        here = first_party.OTHER_NAMES.get(kind, {}).get(name)
        if here:
            return UnknownNameError(f"{message}; {name} is {here if ' ' in here else repr(here)} here")
        if distribution is None:
            suggestion = did_you_mean(name, known + list(first_party.NAMES.get(kind, {})))
            message += suggestion
            if suggestion and suggestion.split("'")[1] not in known:
                distribution = first_party.NAMES[kind][suggestion.split("'")[1]]
        if distribution in self.left_out:
            return UnknownNameError(f"{message}; {distribution} is installed but not loaded: POSTTUNE_LOAD_PLUGINS "
                                    "or POSTTUNE_DISABLE_PLUGINS leaves it out")
        message += self._failed_hint(distribution) + first_party.install_hint(distribution)
        return UnknownNameError(message)

    def _failed_hint(self, distribution: str | None) -> str:
        """Why the name may be missing: its (first-party) distribution, or any plugin, failed to load."""
        for _plugin, (dist, error) in self.failed.items():
            if distribution is not None and dist == distribution:
                return f"; {dist} is installed but failed to load: {error}"
        if distribution is None and self.failed:
            shown = "; ".join(f"{dist} ({error})" for dist, error in self.failed.values())
            return f"; installed plugins that failed to load, which may provide it: {shown}"
        return ""


PosttuneErrorType = PluginError | UnknownNameError


def duplicate_messages(registry: Registry, kinds: Iterable[str] | None = None) -> list[str]:
    """One line per name registered by more than one distribution (of ``kinds``, default all), naming both."""
    return [str(registry.unknown(kind, name)) for kind, name in sorted(registry.duplicates)
            if kinds is None or kind in kinds]
