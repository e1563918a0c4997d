"""Every config posttune-llama bundles validates, and starts with the command that runs it."""

from __future__ import annotations

import pytest

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_memory
import posttune_sft
import posttune_torchao

NAMES = sorted(path.stem for path in posttune_llama.CONFIGS.glob("*.yaml"))


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")  # the real-size configs
    register_plugin(posttune_torchao, distribution="posttune-torchao", version="0.1.0")  # mixtral-8x7b-qlora


def test_every_size_family_has_configs():
    assert {"llama-demo-reverse", "llama3.2-1b-sft", "llama3.2-1b-lora", "mistral-7b-lora", "mixtral-tiny-reverse",
            "mixtral-8x7b-qlora"} <= set(NAMES)


def test_plan_counts_every_expert_of_mixtral_8x7b(plugins, posttune_cli):
    """Mixtral 8x7B has 46,702,792,704 parameters (its model card's 46.7B): NF4 stores the frozen layers'
    weights, experts included, in about 0.53 bytes each, so the weights estimate is far below bf16's 87 GiB."""
    result = posttune_cli("plan", "mixtral-tiny-reverse", "~model.build_overrides", "model.size=8x7b",
                          "model.dtype=bf16", "adapter.rank=16", "memory=[qlora_nf4]")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    params = next(line for line in lines if line.startswith("parameters: "))
    assert params.startswith("parameters: 46,7") and "(13,631,488 trainable)" in params, params
    weights = next(line for line in lines if line.startswith("  policy: weights "))
    assert 20 < float(weights.split()[2]) < 30, weights  # GiB: NF4 experts and attention, bf16 embeddings


@pytest.mark.parametrize("name", NAMES)
def test_bundled_config_validates_and_shows_its_command(plugins, posttune_cli, name):
    text = (posttune_llama.CONFIGS / f"{name}.yaml").read_text()
    assert text.splitlines()[0] == f"# posttune train {name}"
    result = posttune_cli("validate", name)
    assert result.exit_code == 0, result.stderr
    assert name in posttune_cli("ls", "configs").stdout


def test_plan_estimates_memory_from_a_meta_build(plugins, posttune_cli):
    """Llama 3.1 8B has 8,030,261,248 parameters; bf16 weights + grads + two AdamW states = 8 bytes each
    (59.83 GiB), and the peak adds activations, logits and the process (tests/core/test_memory_estimate.py)."""
    result = posttune_cli("plan", "llama-demo-reverse", "~model.build_overrides", "model.size=8b", "model.dtype=bf16")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "parameters: 8,030,261,248 (8,030,261,248 trainable)" in lines
    assert "  policy: weights 14.96 GiB, gradients 14.96 GiB, optimizer 29.92 GiB" in lines
    assert lines[-1].startswith("  total ") and float(lines[-1].split()[1]) > 59.83
    lora = posttune_cli("plan", "llama-demo-reverse", "~model.build_overrides", "model.size=1b", "adapter.rank=16")
    assert "parameters: 1,247,086,592 (11,272,192 trainable)" in lora.stdout  # Llama 3.2 1B + rank-16 LoRA


def test_plan_without_network_still_prints_the_plan(plugins, posttune_cli):
    result = posttune_cli("plan", "llama3.1-8b-lora")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("memory estimate: not available (meta-llama/Llama-3.1-8B")
    assert posttune_cli("plan", "llama3.1-8b-lora", "--no-estimate").stdout.splitlines()[-1].startswith("train")
