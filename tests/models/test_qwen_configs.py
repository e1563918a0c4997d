"""Every config posttune-qwen bundles validates offline, and starts with the command that runs it."""

from __future__ import annotations

import pytest
import yaml

import posttune_ep
import posttune_fsdp2
import posttune_memory
import posttune_generate
import posttune_lora
import posttune_qwen
import posttune_sft

NAMES = sorted(path.stem for path in posttune_qwen.CONFIGS.glob("*.yaml"))


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_qwen, distribution="posttune-qwen", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_fsdp2, distribution="posttune-fsdp2", version="0.1.0")  # qwen3-30b-a3b-lora
    register_plugin(posttune_ep, distribution="posttune-ep", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")


def test_full_and_lora_recipes_for_each_bundled_model():
    models = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b")
    dense = {f"{model}-{kind}" for model in models for kind in ("sft", "lora")}
    assert set(NAMES) == dense | {"qwen3-30b-a3b-lora"}


@pytest.mark.parametrize("name", NAMES)
def test_bundled_config_validates_and_shows_its_command(plugins, posttune_cli, name):
    text = (posttune_qwen.CONFIGS / f"{name}.yaml").read_text()
    assert text.splitlines()[0] == f"# posttune train {name}"
    config = yaml.safe_load(text)
    assert config["model"]["path"].startswith("Qwen/")  # a hub id: `family` lets it validate offline
    family = "qwen2" if name.startswith("qwen2.5") else "qwen3_moe" if "-a3b" in name else "qwen3"
    assert config["model"]["family"] == family
    assert ("adapter" in config) is name.endswith("-lora")
    result = posttune_cli("validate", name)
    assert result.exit_code == 0, result.stderr
    assert name in posttune_cli("ls", "configs").stdout
