"""Every config posttune-llama bundles validates, and starts with the command that runs it."""

from __future__ import annotations

import pytest

import posttune_llama
import posttune_sft

NAMES = sorted(path.stem for path in posttune_llama.CONFIGS.glob("*.yaml"))


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


def test_every_size_family_has_configs():
    assert {"llama-demo-reverse", "llama3.2-1b-sft", "llama3.2-1b-lora", "mistral-7b-lora"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_bundled_config_validates_and_shows_its_command(plugins, posttune_cli, name):
    text = (posttune_llama.CONFIGS / f"{name}.yaml").read_text()
    assert text.splitlines()[0] == f"# posttune train {name}"
    result = posttune_cli("validate", name)
    assert result.exit_code == 0, result.stderr
    assert name in posttune_cli("ls", "configs").stdout
