"""The plugin manager: discovers plugins through entry points and builds the registry.

Loading rules (docs/plugins.md): entry points of group ``posttune`` load once per process; a
plugin that fails to import (whatever it raises, ``sys.exit`` included), uses an unknown hook,
targets another plugin API version or raises in a registration hook is reported and skipped,
never breaking unrelated commands; ``POSTTUNE_LOAD_PLUGINS`` and ``POSTTUNE_DISABLE_PLUGINS``
choose which distributions load.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import pluggy

from posttune import hookspecs
from posttune.errors import did_you_mean, first_line, one_line
from posttune.version import __version__
from posttune.registry import (HOOK_ARG, KINDS, DescriptorError, Provenance, Register, Registered, Registry,
                               duplicate_messages)

T = TypeVar("T")

#: The plugin API this core speaks. A plugin declares ``POSTTUNE_PLUGIN_API = 2``. API 2 (this
#: release): methods build their own data and declare model roles; plans and techniques receive
#: the model they act on (``apply(session, target)``); plugins share state through typed session
#: fields (docs/plugins.md lists what changed from API 1).
PLUGIN_API = 2
SUPPORTED_PLUGIN_APIS = frozenset({2})
ENTRY_POINT_GROUP = "posttune"

#: Generic pieces of the core, registered through the same hooks as any plugin.
BUILTIN_PLUGINS = (
    "posttune.builtin.datasets",
    "posttune.cli.commands",
)

hookimpl = pluggy.HookimplMarker(hookspecs.PROJECT)


@dataclass
class PluginInfo:
    """One plugin as `posttune plugins` shows it."""

    name: str
    provenance: Provenance
    module: str
    hooks: list[str] = field(default_factory=list)
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    other_core: str | None = None  # the posttune it requires, when this one is not (`other_core`)


@dataclass
class PluginSet:
    """A plugin manager with what its plugins registered."""

    pm: pluggy.PluginManager
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    #: installed distributions POSTTUNE_LOAD_PLUGINS / POSTTUNE_DISABLE_PLUGINS left out (named when missed)
    left_out: set[str] = field(default_factory=set)
    _registry: Registry | None = None

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = build_registry(self)
        return self._registry

    def register(self, plugin: Any, *, name: str | None = None, distribution: str | None = None,
                 version: str = "0") -> PluginInfo:
        """Register a plugin object (a module or any object with hookimpls). Whatever the plugin
        raises on the way (a property, pluggy's checks) becomes its recorded error."""
        name = name or _name_of(plugin)
        if name in self.plugins:
            raise ValueError(f"a plugin named {name!r} is already registered")
        provenance = Provenance(name, distribution or name, version)
        info = PluginInfo(name, provenance, _name_of(plugin))
        refused, crash = isolated(_add, self.pm, plugin, info)
        info.error = describe(crash, " in registration") if crash is not None else refused
        if info.error is not None and self.pm.get_plugin(name) is plugin:
            self.pm.unregister(name=name)  # half-registered: no hook of it may run
        self.plugins[name] = info
        self._registry = None
        return info

    def unregister(self, name: str) -> None:
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)
        self.plugins.pop(name, None)
        self._registry = None

    def failed(self, name: str, provenance: Provenance, module: str, error: str) -> None:
        self.plugins[name] = PluginInfo(name, provenance, module, error=error)
        self._registry = None


def _add(pm: pluggy.PluginManager, plugin: Any, info: PluginInfo) -> str | None:
    """Register ``plugin`` and record its hooks; return why it was refused, or None."""
    api = getattr(plugin, "POSTTUNE_PLUGIN_API", None)
    if api not in SUPPORTED_PLUGIN_APIS:
        speaks = " and ".join(map(str, sorted(SUPPORTED_PLUGIN_APIS)))
        if api is None:
            return f"declares no POSTTUNE_PLUGIN_API; this posttune speaks plugin API {speaks}"
        return f"built for plugin API {api!r}; this posttune speaks {speaks}"
    try:
        pm.register(plugin, name=info.name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        return _explain_validation(exc)
    info.hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or ())
    info.warnings = unmarked_hooks(plugin)
    return None


def isolated(call: Callable[..., T], *args: Any) -> tuple[T | None, BaseException | None]:
    """Run plugin code, ``call(*args)``, so that it cannot stop the CLI: ``(result, None)``, or
    ``(None, what it raised)``.

    SystemExit, GeneratorExit and any other BaseException are caught too: a plugin calling
    ``sys.exit`` at import must not end `posttune --help`. KeyboardInterrupt alone passes: Ctrl-C
    is how a user stops a plugin that hangs at import, and it must stop the command, not skip the
    plugin and carry on. What the plugin prints goes to stderr, so `--json` output stays JSON.
    """
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return call(*args), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - see the docstring
        return None, exc


def describe(exc: BaseException, where: str = "") -> str:
    """``Type[where]: first line of the message``, one line whatever the plugin raised."""
    message, _ = isolated(lambda: first_line(str(exc)))  # a __str__ may raise too
    name = type(exc).__name__ + where
    return one_line(f"{name}: {message}" if message else name)


def _name_of(plugin: Any) -> str:
    name, _ = isolated(getattr, plugin, "__name__", None)
    return name if isinstance(name, str) else type(plugin).__name__


def _explain_validation(exc: pluggy.PluginValidationError) -> str:
    """pluggy's own message in one line: an unknown hook (with a suggestion) or a signature mismatch."""
    lines = str(exc).splitlines()
    unknown = re.match(r"unknown hook '([^']+)'", lines[0])
    if unknown:
        word = unknown.group(1)
        return f"unknown hook '{word}'{did_you_mean(word, hook_names())}"
    hook = re.search(r"for hook '([^']+)'", lines[0])
    detail = lines[-1] if len(lines) > 1 else lines[0]
    return f"hook '{hook.group(1)}': {detail}" if hook else detail


def hook_names() -> list[str]:
    return [h for h in vars(hookspecs) if h.startswith("posttune_")]


def unmarked_hooks(plugin: Any) -> list[str]:
    """Functions named like a hook but missing ``@hookimpl``: pluggy would silently ignore them."""
    marker = f"{hookspecs.PROJECT}_impl"
    found = []
    for attr in dir(plugin):
        value = getattr(plugin, attr, None)
        if attr.startswith("posttune_") and callable(value) and not hasattr(value, marker):
            known = " (a hook of this name exists)" if attr in hook_names() else did_you_mean(attr, hook_names())
            found.append(f"'{attr}' is named like a hook but lacks @hookimpl, so it is never called{known}")
    return found


def new_plugin_set(*, builtins: bool = True) -> PluginSet:
    """A plugin manager with the hook specs and (by default) the core's built-in plugins."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    plugins = PluginSet(pm)
    if builtins:
        from posttune.version import __version__

        for module_name in BUILTIN_PLUGINS:
            module = importlib.import_module(module_name)
            plugins.register(module, name=module_name, distribution="posttune", version=__version__)
    return plugins


def _selected(distribution: str, entry_name: str) -> bool:
    """Apply POSTTUNE_LOAD_PLUGINS / POSTTUNE_DISABLE_PLUGINS (comma-separated names)."""
    def names(var: str) -> set[str] | None:
        raw = os.environ.get(var)
        if raw is None:
            return None
        return {_normalise(n) for n in raw.split(",") if n.strip()}

    ours = {_normalise(distribution), _normalise(entry_name)}
    load, disable = names("POSTTUNE_LOAD_PLUGINS"), names("POSTTUNE_DISABLE_PLUGINS")
    if load is not None and not ours & load:
        return False
    return not (disable and ours & disable)


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def entry_points() -> list[metadata.EntryPoint]:
    """Installed entry points of group ``posttune``, one per (distribution, name)."""
    seen: dict[tuple[str, str], metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else "?"
        seen.setdefault((dist, ep.name), ep)
    return list(seen.values())


def load_entry_points(plugins: PluginSet, eps: list[metadata.EntryPoint] | None = None) -> None:
    """Import and register every selected entry-point plugin; failures are recorded, not raised."""
    for ep in entry_points() if eps is None else eps:
        dist = ep.dist.name if ep.dist else ep.name
        provenance = Provenance(ep.name, dist, ep.dist.version if ep.dist else "?")
        if not _selected(dist, ep.name):
            plugins.left_out.add(dist)
            continue
        taken = plugins.plugins.get(ep.name)
        if taken is not None:  # two distributions, one entry-point name: only one can load
            if taken.provenance.distribution != dist:
                plugins.failed(f"{ep.name} ({dist})", provenance, ep.value,
                               f"entry point name '{ep.name}' is already taken by {taken.provenance}; "
                               f"uninstall one, or pick one with POSTTUNE_DISABLE_PLUGINS")
            continue
        plugin, crash = isolated(ep.load)
        if crash is not None:
            plugins.failed(ep.name, provenance, ep.value, describe(crash))
            continue
        info = plugins.register(plugin, name=ep.name, distribution=dist, version=provenance.version)
        info.module = ep.value
        info.other_core = other_core(ep.dist)


def other_core(dist: metadata.Distribution | None) -> str | None:
    """A warning when ``dist`` requires another posttune than this one: pip refuses to install it so, but
    ``--no-deps`` does, and so does upgrading the core under installed plugins."""
    from packaging.requirements import InvalidRequirement, Requirement

    for text in (dist.requires or []) if dist is not None else []:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        applies = requirement.marker is None or requirement.marker.evaluate({"extra": ""})
        if requirement.name == "posttune" and applies and not requirement.specifier.contains(__version__,
                                                                                            prereleases=True):
            return str(requirement.specifier)
    return None


def build_registry(plugins: PluginSet) -> Registry:
    """Call each plugin's registration hooks on its own, recording who registered what."""
    registry = Registry(left_out=set(plugins.left_out))
    for info in plugins.plugins.values():
        if not info.error:
            staged, crash = isolated(_registrations, plugins.pm, plugins.pm.get_plugin(info.name), info.provenance)
            if crash is None:
                for kind_key, item in staged:
                    registry.add(kind_key, item)
                continue
            info.error = str(crash) if isinstance(crash, HookFailed) else describe(crash, " in registration")
        registry.failed[info.name] = (info.provenance.distribution, info.error)
    return registry


def failure(info: PluginInfo) -> str:
    """One line naming a plugin that failed to load: entry point, distribution, version and why."""
    return f"plugin {info.provenance.plugin} from {info.provenance} failed to load: {info.error}"


def problems(plugins: PluginSet, kinds: Iterable[str] | None = None) -> list[str]:
    """Every plugin that failed to load or requires another posttune, then every name two plugins registered (of
    ``kinds``, default all), one line each: `posttune plugins` reports them, `ls` and `--help` warn about them."""
    registry = plugins.registry  # first: building it records the registration failures
    return ([failure(info) for info in plugins.plugins.values() if info.error]
            + [f"plugin {info.provenance.plugin} from {info.provenance} requires posttune{info.other_core}, but "
               f"posttune {__version__} is installed: it may fail; install a version of "
               f"{info.provenance.distribution} that matches" for info in plugins.plugins.values()
               if info.other_core and not info.error]
            + duplicate_messages(registry, kinds))


def _registrations(pm: pluggy.PluginManager, plugin: Any, provenance: Provenance) -> list[tuple[str, Registered]]:
    """Everything ``plugin``'s own registration hooks register, staged: added only if none raises."""
    staged: list[tuple[str, Registered]] = []
    for kind in KINDS.values():
        _call_own_hook(pm, plugin, kind.hook, kind.key, provenance, staged)
    return staged


def _call_own_hook(pm: pluggy.PluginManager, plugin: Any, hook: str, kind_key: str,
                   provenance: Provenance, staged: list[tuple[str, Registered]]) -> None:
    caller = getattr(pm.hook, hook)
    for impl in caller.get_hookimpls():
        if impl.plugin is not plugin:
            continue
        sink: list[Registered] = []
        register = Register(KINDS[kind_key], provenance, sink)
        try:
            impl.function(**{arg: register for arg in impl.argnames if arg == HOOK_ARG[hook]})
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a plugin's hook; named with the hook by build_registry
            raise HookFailed(hook, exc) from exc
        staged.extend((kind_key, item) for item in sink)


class HookFailed(Exception):
    """A registration hook raised: which hook, and what (its message is the plugin's load error)."""

    def __init__(self, hook: str, error: BaseException):
        told, _ = isolated(lambda: first_line(str(error)))
        own = isinstance(error, DescriptorError)  # our check of what it registered: no exception type to show
        super().__init__(one_line(f"{hook}: {told}" if own else f"{type(error).__name__} in {hook}"
                                  + (f": {told}" if told else "")))


_current: PluginSet | None = None


def get_plugins() -> PluginSet:
    """The process's plugin set: built-ins plus installed entry points, loaded once."""
    global _current
    if _current is None:
        plugins = new_plugin_set()
        load_entry_points(plugins)
        _current = plugins
    return _current


def set_plugins(plugins: PluginSet | None) -> PluginSet | None:
    """Swap the process's plugin set (tests use this through ``posttune.testing``)."""
    global _current
    previous, _current = _current, plugins
    return previous


def get_registry() -> Registry:
    return get_plugins().registry


def module_plugin(name: str, **hooks: Any) -> types.ModuleType:
    """A throwaway plugin module built from hook functions, for tests and quick experiments."""
    module = types.ModuleType(name)
    module.POSTTUNE_PLUGIN_API = PLUGIN_API
    for hook_name, fn in hooks.items():
        setattr(module, hook_name, hookimpl(fn))
    return module
