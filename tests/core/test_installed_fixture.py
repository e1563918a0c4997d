"""The `installed` fixture beside `posttune_cli` leaves the process's plugin set as it found it (the two tests run in
this order on one worker: tox's ``--dist loadfile``)."""

from __future__ import annotations

from posttune.plugins import get_plugins, set_plugins

SOURCE = """
from posttune.plugins import hookimpl
from posttune.descriptors import ModelFamily

POSTTUNE_PLUGIN_API = 2

@hookimpl
def posttune_register_model_families(register):
    register(ModelFamily("leaky", ("LeakyForCausalLM",), dict, dict, sizes={"tiny": {}}))
"""


def test_installed_beside_the_cli_sees_the_fake_distribution(fake_distribution, installed, posttune_cli):
    fake_distribution("posttune-leaky", "posttune_leaky", SOURCE)
    installed()
    result = posttune_cli("ls", "families")
    assert result.exit_code == 0 and "leaky" in result.stdout, result.stdout


def test_the_process_plugin_set_is_the_installed_one_afterwards():
    families = {item.descriptor.name for item in get_plugins().registry.items("model_family")}
    assert "llama" in families, sorted(families)  # the isolated set (built-ins only) leaked: no family at all
    set_plugins(None)  # and it is the process's own, loaded from entry points
    assert {item.descriptor.name for item in get_plugins().registry.items("model_family")} == families
