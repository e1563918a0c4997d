"""posttune's pytest plugin (entry point ``pytest11``): fixtures for plugin authors and for us.

    def test_my_family(register_plugin, posttune_cli):
        register_plugin(my_plugin_module)
        result = posttune_cli("ls", "families")
        assert "myfamily" in result.stdout

Plugins registered in a test live in an isolated plugin set that replaces the process's for
that test only; installed entry points are not loaded into it. This is the one module of
``posttune.testing`` that imports pytest: pytest loads it, nothing else needs to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from posttune.plugins import PluginInfo, PluginSet, new_plugin_set, set_plugins
from posttune.testing import CliResult, run_cli


@pytest.fixture
def posttune_plugins() -> Iterator[PluginSet]:
    """An isolated plugin set (built-ins only, no entry points), active for this test."""
    plugins = new_plugin_set()
    previous = set_plugins(plugins)
    try:
        yield plugins
    finally:
        set_plugins(previous)


@pytest.fixture
def register_plugin(posttune_plugins: PluginSet) -> Callable[..., PluginInfo]:
    """``register_plugin(obj, name=None, distribution=None, version="0")`` into the isolated set, its registration
    hooks run at once: a plugin that fails to load (a refused API, a hook that raises, a bad descriptor) fails the
    test with the reason, as `posttune plugins` would report it, unless ``broken=True`` (a test of that failure)."""

    def register(plugin: Any, *, name: str | None = None, distribution: str | None = None,
                 version: str = "0", broken: bool = False) -> PluginInfo:
        info = posttune_plugins.register(plugin, name=name, distribution=distribution, version=version)
        posttune_plugins.registry  # noqa: B018  (building it runs the hooks and records what they raise)
        if info.error is not None and not broken:
            pytest.fail(f"plugin {info.name} failed to load: {info.error}", pytrace=False)
        return info

    return register


@pytest.fixture
def posttune_cli(posttune_plugins: PluginSet) -> Callable[..., CliResult]:
    """``posttune_cli("ls", "families")`` runs the CLI in-process against the isolated plugins."""
    return run_cli
