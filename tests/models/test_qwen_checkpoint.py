"""Qwen2 and Qwen3 checkpoints through the real files: transformers -> posttune -> transformers."""

from __future__ import annotations

import json

import pytest

import posttune
import posttune_generate
import posttune_lora
import posttune_qwen
from posttune.testing.tiny import save_tiny_hf_checkpoint
from qwen_tiny import CONFIGS
from logits import assert_close, native_logits, transformers_logits


@pytest.fixture(autouse=True)
def qwen_plugin(register_plugin):
    register_plugin(posttune_qwen, name="qwen", distribution="posttune-qwen")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")


@pytest.mark.parametrize("name", ["qwen2_gqa", "qwen2_tied", "qwen2_sliding_window",
                                  "qwen3_gqa", "qwen3_tied", "qwen3_attention_bias"])
def test_sharded_checkpoint_loads_and_saves_back_with_transformers_logits(name, tmp_path):
    reference = save_tiny_hf_checkpoint(tmp_path / "hf", CONFIGS[name](), max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = posttune.load_model(tmp_path / "hf")
    assert_close(native_logits(model), transformers_logits(reference))
    posttune.save_model(model, tmp_path / "out", max_shard_size="100KB")
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert_close(transformers_logits(tmp_path / "out"), transformers_logits(reference))


def test_source_config_fields_survive_a_round_trip(tmp_path):
    reference = save_tiny_hf_checkpoint(tmp_path / "hf", CONFIGS["qwen2_sliding_window"]())
    posttune.save_model(posttune.load_model(tmp_path / "hf"), tmp_path / "out")
    before = json.loads((tmp_path / "hf" / "config.json").read_text())
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    assert after == before
    assert_close(transformers_logits(tmp_path / "out"), transformers_logits(reference))


@pytest.mark.parametrize("family, overrides", [
    ("qwen2", {}),
    ("qwen2", {"num_layers": 3, "sliding_window": 8,
               "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}),
    ("qwen3", {"tie_word_embeddings": False, "attention_bias": True}),
], ids=["qwen2", "qwen2_sliding", "qwen3_untied_bias"])
def test_model_built_from_a_named_size_saves_as_a_transformers_checkpoint(family, overrides, tmp_path):
    """Without a source config.json, `to_hf_config` alone must tell transformers the architecture."""
    model = posttune.build_model(family, "tiny", **overrides).eval()
    posttune.save_model(model, tmp_path / "out")
    assert_close(transformers_logits(tmp_path / "out"), native_logits(model))


def test_a_named_family_that_does_not_read_the_checkpoint_is_refused_before_loading(register_plugin, tmp_path):
    """A Qwen3 checkpoint named qwen2 would fail mid-load on a tensor qwen2 lacks (q_norm): refused at plan time,
    naming the family that reads it; the right name, or none, plans."""
    import posttune_sft

    from posttune.config import validate
    from posttune.errors import ConfigError
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry

    register_plugin(posttune_sft, distribution="posttune-sft")
    save_tiny_hf_checkpoint(tmp_path / "hf", CONFIGS["qwen3_gqa"]())

    def plan(**model):
        raw = {"model": {"path": str(tmp_path / "hf"), **model}, "method": "sft",
               "data": {"train": {"path": "d.jsonl", "format": "chat"}}}
        return resolve_plan(validate(raw), get_registry())

    with pytest.raises(ConfigError) as refused:
        plan(family="qwen2")
    assert str(refused.value) == ("config: model.family: 'qwen2' does not read this checkpoint's architecture "
                                  "(Qwen3ForCausalLM); 'qwen3' does: set model.family: qwen3, or leave it out to take "
                                  "the family from config.json")
    assert plan(family="qwen3").family.descriptor.name == plan().family.descriptor.name == "qwen3"
