"""What config.json's own checks accept but a family cannot build is the family's one line; no value that passes
those checks makes a family's ``from_hf_config`` or ``build`` throw anything but a PosttuneError (property-based,
deterministic: ``derandomize``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from gemma_tiny import tiny_gemma2_config, tiny_gemma3_config, tiny_gemma_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qwen_tiny import tiny_qwen2_config, tiny_qwen3_config

import posttune_gemma
import posttune_llama
import posttune_qwen
from posttune.checkpoint.hf_config_check import check_hf_config
from posttune.errors import PosttuneError
from posttune.testing.tiny import tiny_llama_config, tiny_mistral_config

FAMILIES = {family.name: family for family in (posttune_llama.LLAMA, posttune_llama.MISTRAL, posttune_qwen.QWEN2,
                                               posttune_qwen.QWEN3, *posttune_gemma.FAMILIES)}
TINY = {"llama": tiny_llama_config, "mistral": tiny_mistral_config, "qwen2": tiny_qwen2_config,
        "qwen3": tiny_qwen3_config, "gemma": tiny_gemma_config, "gemma2": tiny_gemma2_config,
        "gemma3": tiny_gemma3_config}


def config_json(family: str, **fields) -> dict:
    """The tiny config of ``family`` as its config.json holds it, ``fields`` written over it."""
    return {**json.loads(TINY[family]().to_json_string(use_diff=False)), **fields}


WINDOW_0 = "a window of 0 tokens hides every position from"
FAMILY_ONLY = [  # (family, fields, the family's one line)
    *[(family, {"intermediate_size": [128, 128]},
       f"config.json: intermediate_size: the {family} family builds one MLP width for every layer, got a list")
      for family in ("llama", "qwen2", "gemma3")],
    *[(family, {"rms_norm_eps": None},
       f"config.json: rms_norm_eps: expected a positive number for the {family} family's RMSNorm, got null")
      for family in ("mistral", "qwen3", "gemma")],
    ("mistral", {"sliding_window": 0}, f"config.json: sliding_window: {WINDOW_0} the mistral family's attention "
                                       "(null: no window)"),
    ("gemma2", {"sliding_window": 0}, f"config.json: sliding_window: {WINDOW_0} the gemma2 family's attention "
                                      "(null: no window)"),
    ("gemma3", {"sliding_window": 0}, f"config.json: sliding_window: {WINDOW_0} the gemma3 family's attention "
                                      "(null: no window)"),
    ("mistral", {"layer_types": ["full_attention", "sliding_attention"]},
     "config.json: layer_types: the mistral family builds every layer as sliding_attention (sliding_window: 8), got "
     "['full_attention', 'sliding_attention']; drop layer_types, or use a family that reads it per layer (qwen2, "
     "qwen3)"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 0, "layer_types": ["sliding_attention"] * 2},
     "config.json: sliding_window: use_sliding_window is true but the window is 0 tokens, which hides every "
     "position from attention"),
]


@pytest.mark.parametrize(("family", "fields", "message"), FAMILY_ONLY,
                         ids=[f"{family}-{next(iter(fields))}" for family, fields, _ in FAMILY_ONLY])
def test_what_only_the_family_cannot_build_is_its_one_line(family, fields, message):
    config = check_hf_config(config_json(family, **fields), "config.json")  # the file's own checks pass
    with pytest.raises(PosttuneError) as caught:
        FAMILIES[family].from_hf_config(config)
    assert str(caught.value) == message


def test_mistral_layer_types_of_its_one_kind_build_as_without_them():
    every = FAMILIES["mistral"].from_hf_config(config_json("mistral", layer_types=["sliding_attention"] * 2))
    assert every == FAMILIES["mistral"].from_hf_config(config_json("mistral"))


def test_a_disabled_qwen_window_of_0_is_no_window():
    """transformers 5 writes sliding_window 0 when use_sliding_window is false: nothing slides."""
    kwargs = FAMILIES["qwen2"].from_hf_config(config_json("qwen2", use_sliding_window=False, sliding_window=0))
    assert kwargs["sliding_window"] is None and kwargs["layer_types"] is None


FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "sliding_window_pattern",
          "max_window_layers", "use_sliding_window", "rms_norm_eps", "rope_theta", "rope_local_base_freq",
          "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "partial_rotary_factor",
          "tie_word_embeddings", "attention_bias", "hidden_act", "hidden_activation", "layer_types", "rope_scaling",
          "rope_parameters", "use_bidirectional_attention"]
#: small sizes keep a meta-device build quick; the ceilings have their own test in tests/core
SCALARS = st.one_of(st.none(), st.booleans(), st.sampled_from([-3, -1, 0, 1, 2, 3, 4, 7, 8, 64, 2**40]),
                    st.sampled_from([0.0, 0.5, 1.0, 2.0, 64.0, -1.0, math.nan, math.inf, 1e-6, 1e4]),
                    st.sampled_from(["", "silu", "gelu", "64", "linear", "full_attention", "sliding_attention"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "rope_theta", "low_freq_factor",
                                     "high_freq_factor", "original_max_position_embeddings", "full_attention",
                                     "sliding_attention", "partial_rotary_factor"]), inner, max_size=4)),
    max_leaves=6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(edits=st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=3))
def test_no_value_that_passes_the_checks_crashes_a_family(family, edits):
    config = config_json(family, **edits)
    try:
        check_hf_config(config, "config.json")
        kwargs = FAMILIES[family].from_hf_config(config)
        with torch.device("meta"):
            FAMILIES[family].build(**kwargs)
    except PosttuneError as exc:
        assert "\n" not in str(exc)
