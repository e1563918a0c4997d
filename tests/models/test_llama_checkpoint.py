"""Llama and Mistral checkpoints through the real files: transformers -> posttune -> transformers."""

from __future__ import annotations

import json

import pytest
import torch

import posttune
import posttune_llama
import posttune_generate
import posttune_lora
from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config, tiny_mistral_config
from logits import assert_close, native_logits, transformers_logits


@pytest.fixture(autouse=True)
def llama_plugin(register_plugin):
    register_plugin(posttune_llama, name="llama", distribution="posttune-llama")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")


@pytest.mark.parametrize("config", [
    pytest.param(lambda: tiny_llama_config(), id="llama"),
    pytest.param(lambda: tiny_llama_config(tie_word_embeddings=True), id="llama_tied"),
    pytest.param(lambda: tiny_mistral_config(), id="mistral"),
])
def test_sharded_checkpoint_loads_and_saves_back_with_transformers_logits(config, tmp_path):
    reference = save_tiny_hf_checkpoint(tmp_path / "hf", config(), max_shard_size="100KB")
    model = posttune.load_model(tmp_path / "hf")
    assert_close(native_logits(model), transformers_logits(reference))
    posttune.save_model(model, tmp_path / "out", max_shard_size="100KB")
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert_close(transformers_logits(tmp_path / "out"), transformers_logits(reference))


def test_source_config_fields_survive_a_round_trip(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    reference = save_tiny_hf_checkpoint(tmp_path / "hf", tiny_llama_config(rope_parameters=rope))
    posttune.save_model(posttune.load_model(tmp_path / "hf"), tmp_path / "out")
    before = json.loads((tmp_path / "hf" / "config.json").read_text())
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    assert after == before
    assert_close(transformers_logits(tmp_path / "out"), transformers_logits(reference))


def test_bf16_checkpoint_loads_as_bf16(tmp_path):
    reference = save_tiny_hf_checkpoint(tmp_path / "fp32", tiny_llama_config())
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = posttune.load_model(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    posttune.save_model(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_model_built_from_a_named_size_saves_as_a_transformers_checkpoint(tmp_path):
    model = posttune.build_model("llama", "tiny", num_layers=1).eval()
    posttune.save_model(model, tmp_path / "out")
    assert_close(transformers_logits(tmp_path / "out"), native_logits(model))


@pytest.mark.parametrize("overrides", [{"attention_bias": True}, {"mlp_bias": True}, {"head_dim": 32}],
                         ids=["attention_bias", "mlp_bias", "head_dim"])
def test_a_size_with_overrides_saves_a_config_json_transformers_builds_alike(tmp_path, overrides):
    """Build kwargs the named size does not hold are written to config.json each under its own field (one bias
    without the other; a head_dim other than hidden_size / num_heads), so transformers builds the same model. The
    biases are made non-zero: a bias config.json drops would change the logits, not fall back to its zero init."""
    model = posttune.build_model("llama", "tiny", num_layers=1, **overrides).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    posttune.save_model(model, tmp_path / "out")
    assert_close(transformers_logits(tmp_path / "out"), native_logits(model))
