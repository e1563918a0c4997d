"""The gemma, gemma2 and gemma3 families match transformers' logits on the same weights.

docs/architecture.md, "Principles": fp32 logits within 1e-4 of transformers on the same weights.
"""

from __future__ import annotations

import json
from fnmatch import fnmatch

import pytest
import torch
import transformers

import posttune_gemma
import posttune_generate
import posttune_lora
from gemma_tiny import CONFIGS, CONVERTERS, FAMILIES, native_from_hf, tiny_gemma2_config, tiny_gemma3_config
from posttune.errors import PosttuneError
from posttune.testing.tiny import tiny_hf_model

FP32_TOLERANCE = 1e-4
#: as in test_llama_parity: one bf16 ulp is 2**-8 for the logits' magnitude; allow 2.5 ulps, and
#: no further from the fp32 logits than transformers' own bf16 run, give or take one ulp
BF16_TOLERANCE = 1e-2
BF16_ULP = 2**-8


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


@pytest.mark.parametrize("name", ["gemma_gqa", "gemma2_tight_softcap", "gemma3_local_global_rope"])
def test_logits_match_transformers_bf16(name):
    """Not run on gemma2_softcap_window: its large weights amplify bf16 rounding until both
    implementations sit ~0.1 from the fp32 logits (and from each other)."""
    hf_model = tiny_hf_model(CONFIGS[name]())
    ids = _tokens()
    with torch.no_grad():
        reference = hf_model(ids).logits
        hf_model.to(torch.bfloat16)
        model = native_from_hf(hf_model)
        expected, got = hf_model(ids).logits.float(), model(ids).float()
    assert model.embed.weight.dtype == torch.bfloat16
    assert (got - expected).abs().max().item() <= BF16_TOLERANCE
    assert (got - reference).abs().max().item() <= (expected - reference).abs().max().item() + BF16_ULP


def test_soft_caps_really_bind_in_the_parity_configs():
    """The caps of gemma2_softcap_window change the logits: the parity test is not vacuous."""
    capped = native_from_hf(tiny_hf_model(CONFIGS["gemma2_softcap_window"]()))
    ids = _tokens(24, 1)
    with torch.no_grad():
        logits = capped(ids)
        assert logits.abs().max() < 5.0
        raw = capped.output(capped.hidden_states(ids))
        assert raw.abs().max() > 6.0
        torch.testing.assert_close(capped.logits(capped.hidden_states(ids)), logits)
        for layer in capped.layers:
            layer.attn.softcap = None
        assert (capped(ids) - logits).abs().max() > 1e-3


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_key_map_round_trips_every_tensor(name):
    hf_model = tiny_hf_model(CONFIGS[name]())
    config = hf_model.config.to_dict()
    converter = CONVERTERS[_family_of(config)]
    for key, tensor in hf_model.state_dict().items():
        native_key, native_tensor = converter.to_native(key, tensor, config)
        hf_key, hf_tensor = converter.from_native(native_key, native_tensor, config)
        assert hf_key == key and hf_tensor is tensor


def _family_of(config: dict) -> str:
    return {"gemma3_text": "gemma3"}.get(config["model_type"], config["model_type"])


def test_gemma1_and_gemma2_read_post_attention_layernorm_differently():
    """Gemma 1's post_attention_layernorm is the pre-MLP norm; Gemma 2's normalises the attention output."""
    key = "model.layers.0.post_attention_layernorm.weight"
    assert CONVERTERS["gemma"].to_native(key, None, {})[0] == "layers.0.mlp_norm.weight"
    assert CONVERTERS["gemma2"].to_native(key, None, {})[0] == "layers.0.attn_post_norm.weight"
    assert CONVERTERS["gemma3"].to_native("model.layers.1.self_attn.q_norm.weight", None, {})[0] == \
        "layers.1.attn.q_norm.weight"


def test_converter_skips_cached_rotary_frequencies_and_refuses_foreign_tensors():
    converter = CONVERTERS["gemma3"]
    assert converter.to_native("model.rotary_emb.inv_freq", torch.ones(2), {}) is None
    with pytest.raises(PosttuneError, match="vision_tower"):
        converter.to_native("model.vision_tower.weight", torch.ones(2), {})


@pytest.mark.parametrize("family", posttune_gemma.FAMILIES, ids=lambda f: f.name)
def test_to_hf_config_loads_in_transformers_and_reads_back(family, tmp_path):
    for size, kwargs in family.sizes.items():
        (tmp_path / "config.json").write_text(json.dumps(family.to_hf_config(kwargs)))
        loaded = transformers.AutoConfig.from_pretrained(tmp_path)
        assert loaded.architectures == list(family.architectures)
        assert transformers.AutoModelForCausalLM._model_mapping[type(loaded)].__name__ == family.architectures[0]
        back = family.from_hf_config(loaded.to_dict())
        assert {k: back[k] for k in kwargs} == kwargs, size


def test_gemma2_layers_alternate_and_gemma3_repeats_its_pattern_without_layer_types():
    gemma2 = {k: v for k, v in tiny_gemma2_config(num_hidden_layers=4).to_dict().items() if k != "layer_types"}
    assert FAMILIES["gemma2"].from_hf_config(gemma2)["layer_types"] == (
        "sliding_attention", "full_attention", "sliding_attention", "full_attention")
    gemma3 = {k: v for k, v in tiny_gemma3_config(num_hidden_layers=7).to_dict().items()
              if k not in ("layer_types", "sliding_window_pattern")}
    assert FAMILIES["gemma3"].from_hf_config(gemma3)["layer_types"] == ("sliding_attention",) * 5 + (
        "full_attention", "sliding_attention")  # sliding_window_pattern absent: transformers' default, 6


def test_gemma3_reads_legacy_rope_spellings_as_transformers5_ones():
    current = tiny_gemma3_config(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}).to_dict()
    legacy = {k: v for k, v in current.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"type": "linear", "factor": 8.0},
                  sliding_window_pattern=2)
    family = FAMILIES["gemma3"]
    assert family.from_hf_config(legacy) == family.from_hf_config(current)
    kwargs = family.from_hf_config(current)
    assert (kwargs["rope_theta"], kwargs["local_rope_theta"]) == (1e6, 1e4)
    assert kwargs["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}


def test_gemma1_legacy_gelu_means_the_tanh_approximation():
    config = {**CONFIGS["gemma_gqa"]().to_dict(), "hidden_act": "gelu"}
    assert FAMILIES["gemma"].from_hf_config(config)["activation"] == "gelu_tanh"
    assert FAMILIES["gemma2"].from_hf_config({**tiny_gemma2_config().to_dict(), "hidden_activation": "gelu"})[
        "activation"] == "gelu"  # Gemma 2 reads the name as written, as transformers does


@pytest.mark.parametrize("change, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "'chunked_attention'"),
    ({"hidden_activation": "relu"}, "'relu'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic_ntk", "rope_theta": 1e6}}}, "'dynamic_ntk'"),
])
def test_bad_config_json_is_a_one_line_error(change, message):
    with pytest.raises(PosttuneError, match=message) as error:
        FAMILIES["gemma3"].from_hf_config({**tiny_gemma3_config().to_dict(), **change})
    assert "\n" not in str(error.value)


def test_plugin_registers_three_families_and_converters(register_plugin):
    from posttune.plugins import get_registry

    register_plugin(posttune_gemma, distribution="posttune-gemma", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    registry = get_registry()
    for name, architecture in (("gemma", "GemmaForCausalLM"), ("gemma2", "Gemma2ForCausalLM"),
                               ("gemma3", "Gemma3ForCausalLM")):
        assert registry.get("model_family", name).architectures == (architecture,)
    assert {"gemma:hf", "gemma2:hf", "gemma3:hf"} <= set(registry.names("checkpoint_converter"))


@pytest.mark.parametrize("family", posttune_gemma.FAMILIES, ids=lambda f: f.name)
def test_tp_plan_and_lora_targets_name_real_modules(family):
    modules = dict(family.build(**family.sizes["tiny"]).named_modules())
    for pattern in (*family.tp_plan, *family.lora_targets):
        matched = [module for name, module in modules.items() if fnmatch(name, pattern)]
        assert matched and not any(isinstance(m, torch.nn.Identity) for m in matched), pattern
