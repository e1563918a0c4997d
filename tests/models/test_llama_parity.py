"""The llama and mistral families match transformers' logits on the same weights.

docs/architecture.md, "Principles": fp32 logits within 1e-4 of transformers on the same weights.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import posttune_llama
import posttune_generate
import posttune_lora
from posttune.errors import PosttuneError
from posttune.testing.tiny import tiny_hf_model, tiny_llama_config, tiny_mistral_config

FP32_TOLERANCE = 1e-4
#: bf16 carries 8 significant bits, so one ulp is 2**-8 ~= 3.9e-3 for |x| in [0.5, 1), where this
#: tiny model's logits lie. Both implementations round at different points (SDPA vs eager
#: softmax) and land about one ulp apart; the bound allows 2.5 ulps. The native model must also
#: be no further from the fp32 logits than transformers' own bf16 run is, give or take one ulp.
BF16_TOLERANCE = 1e-2
BF16_ULP = 2**-8

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}

CONFIGS = {
    "mha": lambda: tiny_llama_config(num_key_value_heads=4),
    "gqa": lambda: tiny_llama_config(num_key_value_heads=2),
    "mqa": lambda: tiny_llama_config(num_key_value_heads=1),
    "tied_embeddings": lambda: tiny_llama_config(tie_word_embeddings=True),
    "llama3_rope": lambda: tiny_llama_config(rope_parameters=dict(LLAMA3_ROPE)),
    "attention_and_mlp_bias": lambda: tiny_llama_config(attention_bias=True, mlp_bias=True),
    # the two bias fields are read each under its own name (a checkpoint may have one without the other)
    "attention_bias_only": lambda: tiny_llama_config(attention_bias=True),
    "explicit_head_dim": lambda: tiny_llama_config(head_dim=32),
    "linear_rope": lambda: tiny_llama_config(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 10000.0}),
    # max_position_embeddings < sequence length, so dynamic NTK actually rescales
    "dynamic_rope": lambda: tiny_llama_config(max_position_embeddings=16, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "yarn_rope": lambda: tiny_llama_config(max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
    # 24 tokens through an 8-token window: the window really cuts attention off
    "mistral_sliding_window": lambda: tiny_mistral_config(sliding_window=8),
    "mistral_full_attention": lambda: tiny_mistral_config(sliding_window=None),
}


def _tokens(seq: int = 24, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers_fp32(name, to_native):
    hf_model = tiny_hf_model(CONFIGS[name]())
    model = to_native(hf_model)
    ids = _tokens()
    with torch.no_grad():
        expected, got = hf_model(ids).logits, model(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= FP32_TOLERANCE


def test_hidden_states_are_what_the_output_head_reads(to_native):
    model = to_native(tiny_hf_model(tiny_llama_config()))
    ids = _tokens(8, 1)
    with torch.no_grad():
        torch.testing.assert_close(model.output(model.hidden_states(ids)), model(ids))


@pytest.mark.parametrize("name", ["gqa", "mistral_sliding_window"])
def test_logits_match_transformers_bf16(name, to_native):
    hf_model = tiny_hf_model(CONFIGS[name]())
    ids = _tokens()
    with torch.no_grad():
        reference = hf_model(ids).logits
        hf_model.to(torch.bfloat16)
        model = to_native(hf_model)
        expected, got = hf_model(ids).logits.float(), model(ids).float()
    assert model.embed.weight.dtype == torch.bfloat16
    assert (got - expected).abs().max().item() <= BF16_TOLERANCE
    hf_error = (expected - reference).abs().max().item()
    assert (got - reference).abs().max().item() <= hf_error + BF16_ULP


@pytest.mark.parametrize("name", ["tied_embeddings", "attention_and_mlp_bias", "mistral_sliding_window"])
def test_key_map_round_trips_every_tensor(name):
    hf_model = tiny_hf_model(CONFIGS[name]())
    config = hf_model.config.to_dict()
    converter = {c.family: c for c in posttune_llama.CONVERTERS}[config["model_type"]]
    for key, tensor in hf_model.state_dict().items():
        native_key, native_tensor = converter.to_native(key, tensor, config)
        hf_key, hf_tensor = converter.from_native(native_key, native_tensor, config)
        assert hf_key == key and hf_tensor is tensor


def test_converter_skips_cached_rotary_frequencies_and_refuses_foreign_tensors():
    converter = posttune_llama.CONVERTERS[0]
    assert converter.to_native("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(2), {}) is None
    with pytest.raises(PosttuneError, match="vision_tower"):
        converter.to_native("model.vision_tower.weight", torch.ones(2), {})


@pytest.mark.parametrize(("key", "says"), [
    ("embed_tokens.weight", "(its names lack the 'model.' prefix: a base model saved without its LM head; "
                            "transformers loads it as AutoModelForCausalLM, whose save_pretrained writes the names "
                            "posttune reads)"),
    ("layers.0.mlp.up_proj.weight", "(its names lack the 'model.' prefix"),
    ("multi_modal_projector.linear_1.weight", "(outside the decoder and its head: from a multimodal checkpoint, "
                                              "export its text model alone (its ForCausalLM class) and load that; "
                                              "else is this the right family?)"),
    ("model.layers.0.mlp.experts.0.weight", "(is this the right family?; the checkpoint's config.json says "
                                            "model_type x)"),
])
def test_a_foreign_tensor_says_what_the_checkpoint_looks_like(key, says):
    with pytest.raises(PosttuneError) as caught:
        posttune_llama.CONVERTERS[0].to_native(key, torch.ones(2), {"model_type": "x"})
    assert str(caught.value).startswith(f"checkpoint tensor '{key}' is not part of a llama model {says}")


@pytest.mark.parametrize("family", [posttune_llama.LLAMA, posttune_llama.MISTRAL], ids=lambda f: f.name)
def test_to_hf_config_loads_in_transformers_and_reads_back(family, tmp_path):
    for size, kwargs in family.sizes.items():
        (tmp_path / "config.json").write_text(json.dumps(family.to_hf_config(kwargs)))
        loaded = transformers.AutoConfig.from_pretrained(tmp_path)
        assert loaded.architectures == list(family.architectures)
        back = family.from_hf_config(loaded.to_dict())
        assert {k: back[k] for k in kwargs} == kwargs, size


def test_from_hf_config_reads_legacy_and_transformers5_rope_spellings():
    base = tiny_llama_config().to_dict()
    base.pop("rope_parameters")
    legacy = {**base, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}
    current = {**base, "rope_parameters": dict(LLAMA3_ROPE)}
    assert posttune_llama.LLAMA.from_hf_config(legacy) == posttune_llama.LLAMA.from_hf_config(current)
    assert posttune_llama.LLAMA.from_hf_config(current)["rope_theta"] == 500000.0


def test_a_config_with_both_rope_spellings_reads_as_transformers_reads_it(tmp_path):
    """A transformers-5 file plus a v4-era context-extension edit (rope_scaling, top-level rope_theta): transformers
    reads the old keys; posttune must build the same rotation, not the one rope_parameters still names."""
    config = {**tiny_llama_config().to_dict(), "rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters
    ours = posttune_llama.LLAMA.from_hf_config(config)
    assert (theirs["rope_type"], theirs["factor"], theirs["rope_theta"]) == ("linear", 4.0, 5000.0)
    assert ours["rope_theta"] == 5000.0 and ours["rope_scaling"]["rope_type"] == "linear"
    assert ours["rope_scaling"]["factor"] == 4.0


def test_unknown_rope_type_is_a_one_line_error():
    config = {**tiny_llama_config().to_dict(), "rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}
    with pytest.raises(PosttuneError) as error:
        posttune_llama.LLAMA.from_hf_config(config)
    message = str(error.value)
    assert "\n" not in message and "'su'" in message and "llama3" in message and "yarn" in message


def test_plugin_registers_both_families_and_converters(register_plugin):
    from posttune.plugins import get_registry

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    registry = get_registry()
    assert registry.get("model_family", "llama").architectures == ("LlamaForCausalLM",)
    assert registry.get("model_family", "mistral").architectures == ("MistralForCausalLM",)
    assert {"llama:hf", "mistral:hf"} <= set(registry.names("checkpoint_converter"))


def test_tp_plan_and_lora_targets_name_real_modules():
    from fnmatch import fnmatch

    family = posttune_llama.LLAMA
    names = [name for name, _ in family.build(**family.sizes["tiny"]).named_modules()]
    for pattern in (*family.tp_plan, *family.lora_targets):
        assert any(fnmatch(name, pattern) for name in names), pattern
