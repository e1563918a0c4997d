"""The qwen2 and qwen3 families match transformers' logits on the same weights.

docs/architecture.md, "Principles": fp32 logits within 1e-4 of transformers on the same weights.
"""

from __future__ import annotations

import json
from fnmatch import fnmatch

import pytest
import torch
import transformers

import posttune_generate

import posttune_lora
import posttune_qwen
from posttune.errors import PosttuneError
from posttune.testing.tiny import tiny_hf_model
from qwen_tiny import CONFIGS, CONVERTERS, native_from_hf, tiny_qwen2_config, tiny_qwen3_config

FP32_TOLERANCE = 1e-4
#: as in test_llama_parity: one bf16 ulp is 2**-8 for the logits' magnitude; allow 2.5 ulps, and
#: no further from the fp32 logits than transformers' own bf16 run, give or take one ulp
BF16_TOLERANCE = 1e-2
BF16_ULP = 2**-8
FAMILIES = {"qwen2": posttune_qwen.QWEN2, "qwen3": posttune_qwen.QWEN3}


def _tokens(seq: int = 24, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers_fp32(name):
    hf_model = tiny_hf_model(CONFIGS[name]())
    model = native_from_hf(hf_model)
    ids = _tokens()
    with torch.no_grad():
        expected, got = hf_model(ids).logits, model(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= FP32_TOLERANCE


@pytest.mark.parametrize("name", ["qwen2_sliding_window", "qwen3_gqa"])
def test_logits_match_transformers_bf16(name):
    hf_model = tiny_hf_model(CONFIGS[name]())
    ids = _tokens()
    with torch.no_grad():
        reference = hf_model(ids).logits
        hf_model.to(torch.bfloat16)
        model = native_from_hf(hf_model)
        expected, got = hf_model(ids).logits.float(), model(ids).float()
    assert (got - expected).abs().max().item() <= BF16_TOLERANCE
    assert (got - reference).abs().max().item() <= (expected - reference).abs().max().item() + BF16_ULP


@pytest.mark.parametrize("name", ["qwen2_sliding_window", "qwen3_sliding_window"])
def test_sliding_layers_are_the_ones_transformers_slides(name):
    hf_model = tiny_hf_model(CONFIGS[name]())
    model = native_from_hf(hf_model)
    expected = [layer.self_attn.sliding_window for layer in hf_model.model.layers]
    assert expected == [None, 8, 8]
    assert [layer.attn.sliding_window for layer in model.layers] == expected


def test_the_window_changes_the_logits():
    """Guards the sliding-window parity test against a window too wide to cut anything off."""
    windowed = tiny_hf_model(CONFIGS["qwen2_sliding_window"]())
    full = tiny_hf_model(tiny_qwen2_config(num_hidden_layers=3))
    ids = _tokens()
    with torch.no_grad():
        assert (windowed(ids).logits - full(ids).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_key_map_round_trips_every_tensor(name):
    hf_model = tiny_hf_model(CONFIGS[name]())
    config = hf_model.config.to_dict()
    converter = CONVERTERS[config["model_type"]]
    for key, tensor in hf_model.state_dict().items():
        native_key, native_tensor = converter.to_native(key, tensor, config)
        hf_key, hf_tensor = converter.from_native(native_key, native_tensor, config)
        assert hf_key == key and hf_tensor is tensor


def test_qwen3_norms_map_to_the_attention_slots_and_qwen2_refuses_them():
    qwen2, qwen3 = CONVERTERS["qwen2"], CONVERTERS["qwen3"]
    key = "model.layers.3.self_attn.q_norm.weight"
    assert qwen3.to_native(key, torch.ones(2), {})[0] == "layers.3.attn.q_norm.weight"
    assert qwen2.to_native("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(2), {}) is None
    with pytest.raises(PosttuneError, match="not part of a qwen2 model"):
        qwen2.to_native(key, torch.ones(2), {})


@pytest.mark.parametrize("family", FAMILIES.values(), ids=lambda f: f.name)
def test_to_hf_config_loads_in_transformers_and_reads_back(family, tmp_path):
    sliding = {**family.sizes["tiny"], "num_layers": 3, "sliding_window": 8,
               "layer_types": ("full_attention", "sliding_attention", "sliding_attention")}
    for size, kwargs in [*family.sizes.items(), ("tiny+sliding", sliding)]:
        (tmp_path / "config.json").write_text(json.dumps(family.to_hf_config(kwargs)))
        loaded = transformers.AutoConfig.from_pretrained(tmp_path)
        assert loaded.architectures == list(family.architectures)
        back = family.from_hf_config(loaded.to_dict())
        assert {k: back[k] for k in kwargs} == kwargs, size


def test_from_hf_config_reads_legacy_and_transformers5_rope_spellings():
    """Qwen2.5 long-context configs spell YaRN the old way (`rope_scaling` with `type`)."""
    base = tiny_qwen2_config().to_dict()
    base.pop("rope_parameters")
    legacy = {**base, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32}}
    current = {**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 32, "rope_theta": 1e6}}
    family = posttune_qwen.QWEN2
    assert family.from_hf_config(legacy) == family.from_hf_config(current)
    assert family.from_hf_config(current)["rope_theta"] == 1e6
    assert family.from_hf_config(current)["rope_scaling"]["rope_type"] == "yarn"


def test_sliding_window_follows_use_sliding_window_then_layer_types_or_max_window_layers():
    read = posttune_qwen.QWEN2.from_hf_config
    released = {**tiny_qwen2_config().to_dict(), "use_sliding_window": False, "sliding_window": 32768,
                "max_window_layers": 1}
    released.pop("layer_types")  # a transformers-4 config.json, as every Qwen2.5 release ships
    assert (read(released)["sliding_window"], read(released)["layer_types"]) == (None, None)
    legacy = read({**released, "use_sliding_window": True, "sliding_window": 8})
    current = read(tiny_qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=1).to_dict())
    assert legacy["sliding_window"] == current["sliding_window"] == 8
    assert legacy["layer_types"] == current["layer_types"] == ("full_attention", "sliding_attention")
    with pytest.raises(PosttuneError) as error:
        read({**released, "use_sliding_window": True, "layer_types": ["full_attention", "chunked"]})
    assert "\n" not in str(error.value) and "layer_types" in str(error.value)


def test_qwen3_head_dim_is_read_not_derived():
    config = tiny_qwen3_config().to_dict()
    assert posttune_qwen.QWEN3.from_hf_config(config)["head_dim"] == 32
    config.pop("head_dim")  # transformers' Qwen3Config then uses its default, 128
    assert posttune_qwen.QWEN3.from_hf_config(config)["head_dim"] == 128 == transformers.Qwen3Config().head_dim


def test_unknown_rope_type_and_activation_are_one_line_errors():
    config = tiny_qwen3_config().to_dict()
    for bad, field in (({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "'su'"),
                       ({"hidden_act": "relu"}, "hidden_act")):
        with pytest.raises(PosttuneError) as error:
            posttune_qwen.QWEN3.from_hf_config({**config, **bad})
        assert "\n" not in str(error.value) and field in str(error.value)


def test_plugin_registers_both_families_and_converters(register_plugin):
    from posttune.plugins import get_registry

    register_plugin(posttune_qwen, distribution="posttune-qwen", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    registry = get_registry()
    assert registry.get("model_family", "qwen2").architectures == ("Qwen2ForCausalLM",)
    assert registry.get("model_family", "qwen3").architectures == ("Qwen3ForCausalLM",)
    assert {"qwen2:hf", "qwen3:hf"} <= set(registry.names("checkpoint_converter"))


@pytest.mark.parametrize("family", FAMILIES.values(), ids=lambda f: f.name)
def test_tp_plan_and_lora_targets_name_real_modules(family):
    names = [name for name, _ in family.build(**family.sizes["tiny"]).named_modules()]
    for pattern in (*family.tp_plan, *family.lora_targets):
        assert any(fnmatch(name, pattern) for name in names), pattern


def test_bias_and_query_key_norms_follow_each_family():
    qwen2 = posttune_qwen.QWEN2.build(**posttune_qwen.QWEN2.sizes["tiny"])
    qwen3 = posttune_qwen.QWEN3.build(**posttune_qwen.QWEN3.sizes["tiny"])
    assert isinstance(qwen2.layers[0].attn.q_norm, torch.nn.Identity)
    assert qwen3.layers[0].attn.q_norm.weight.shape == (32,)
    assert qwen2.layers[0].attn.q_proj.bias is not None and qwen2.layers[0].attn.o_proj.bias is None
    assert qwen3.layers[0].attn.q_proj.bias is None
