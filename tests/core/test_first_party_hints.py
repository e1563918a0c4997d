"""`first_party.NAMES`, the table behind every `pip install posttune-...` hint, says which first-party distribution
registers each name: checked against what the installed first-party distributions do register."""

from __future__ import annotations

import pytest

from posttune import first_party
from posttune.plugins import load_entry_points, new_plugin_set
from posttune.registry import KINDS

DISTRIBUTIONS = {dist for names in first_party.NAMES.values() for dist in names.values()}


def test_every_first_party_name_has_its_install_hint_and_every_hint_is_registered():
    plugins = new_plugin_set()  # every installed distribution's plugins, whatever set the test session made active
    load_entry_points(plugins)
    registry = plugins.registry
    registered = {(kind, name): item.provenance.distribution for kind in KINDS if kind != "checkpoint_converter"
                  for name, item in registry.entries[kind].items() if item.provenance.distribution in DISTRIBUTIONS}
    missing = DISTRIBUTIONS - set(registered.values())
    if missing:
        pytest.skip(f"first-party distributions not installed here: {', '.join(sorted(missing))}")
    hints = {(kind, name): dist for kind, names in first_party.NAMES.items() for name, dist in names.items()}
    assert {key: dist for key, dist in registered.items() if hints.get(key) != dist} == {}  # a name without a hint
    assert {key: dist for key, dist in hints.items() if registered.get(key) != dist} == {}  # a hint nothing backs


@pytest.mark.parametrize("name, words", [
    ("grpo-tiny-reverse", "posttune-grpo bundles it — pip install posttune-grpo"),  # once it said: did you mean
    ("dpo-tiny-revers", " (did you mean 'dpo-tiny-reverse'?) — pip install posttune-dpo"),
    ("no-such-config", " (see `posttune ls configs`)"),
])
def test_a_bundled_config_of_a_plugin_not_installed_names_its_distribution(fake_plugin, posttune_cli, name, words):
    result = posttune_cli("validate", name)
    assert (result.exit_code, result.stderr) == (2, f"posttune: error: no config file or bundled config named "
                                                    f"'{name}'{'' if words[0] == ' ' else ': '}{words}\n")
