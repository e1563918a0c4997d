"""Gemma checkpoints through the real files: transformers -> posttune -> transformers."""

from __future__ import annotations

import json

import pytest
import transformers

import posttune
import posttune_gemma
import posttune_generate
import posttune_lora
from posttune.errors import PosttuneError
from gemma_tiny import CONFIGS
from posttune.testing.tiny import save_tiny_hf_checkpoint
from logits import assert_close, native_logits, transformers_logits


@pytest.fixture(autouse=True)
def gemma_plugin(register_plugin):
    register_plugin(posttune_gemma, name="gemma", distribution="posttune-gemma")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")


@pytest.mark.parametrize("name", ["gemma_gqa", "gemma_mqa_untied", "gemma2_softcap_window",
                                  "gemma3_local_global_rope", "gemma3_final_softcap_untied"])
def test_sharded_checkpoint_loads_and_saves_back_with_transformers_logits(name, tmp_path):
    reference = save_tiny_hf_checkpoint(tmp_path / "hf", CONFIGS[name](), max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = posttune.load_model(tmp_path / "hf")
    assert_close(native_logits(model), transformers_logits(reference))
    posttune.save_model(model, tmp_path / "out", max_shard_size="100KB")
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert_close(transformers_logits(tmp_path / "out"), transformers_logits(reference))


def test_source_config_fields_survive_a_round_trip(tmp_path):
    reference = save_tiny_hf_checkpoint(tmp_path / "hf", CONFIGS["gemma3_local_global_rope"]())
    posttune.save_model(posttune.load_model(tmp_path / "hf"), tmp_path / "out")
    before = json.loads((tmp_path / "hf" / "config.json").read_text())
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    assert after == before
    assert_close(transformers_logits(tmp_path / "out"), transformers_logits(reference))


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_model_built_from_a_named_size_saves_as_a_transformers_checkpoint(family, tmp_path):
    """No source config.json: the family's to_hf_config writes one transformers builds the same model from."""
    model = posttune.build_model(family, "tiny", num_layers=3, **(
        {} if family == "gemma" else {"layer_types": ("sliding_attention", "full_attention", "sliding_attention"),
                                      "sliding_window": 8})).eval()
    posttune.save_model(model, tmp_path / "out")
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")).__name__ == \
        posttune_gemma.config.ARCHITECTURES[family]
    assert_close(transformers_logits(tmp_path / "out"), native_logits(model))


def test_a_multimodal_gemma3_checkpoint_says_to_export_its_text_model(tmp_path):
    """The hub's gemma-3-4b-it is Gemma3ForConditionalGeneration: its text fields sit under text_config. Both
    refusals (found by architecture, or read as the named gemma3 family) say what it is and what to load."""
    text = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384)
    config = transformers.Gemma3Config(text_config=text.to_dict())
    written = {**config.to_dict(), "architectures": ["Gemma3ForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(written))
    hint = ("this is a multimodal checkpoint (its text model's fields are under text_config): posttune trains the "
            "text model, so export it alone (its ForCausalLM class) and load that")
    for family in (None, "gemma3"):
        with pytest.raises(PosttuneError) as caught:
            posttune.load_model(tmp_path, family=family)
        assert str(caught.value).endswith(f"; {hint}") and "\n" not in str(caught.value)
