"""config.json fields left out (older or hand-written checkpoints) read with transformers' defaults: the other
parity tests build configs with transformers' ``to_dict()``, which writes every field, so a reader's default for an
absent one was never exercised. Each case drops or sets one field and compares logits with transformers reading the
same dict (Qwen MoE: the same saved directory through ``from_pretrained``)."""

from __future__ import annotations

import json

import pytest
import torch
from gemma_tiny import native_from_hf, tiny_gemma2_config, tiny_gemma3_config

import posttune
import posttune_gemma
import posttune_generate
import posttune_lora
import posttune_llama
import posttune_phi3
import posttune_qwen
from posttune.testing.tiny import TINY, tiny_hf_model

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.fixture
def families(register_plugin):
    register_plugin(posttune_qwen, distribution="posttune-qwen", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_gemma, distribution="posttune-gemma", version="0.1.0")


@pytest.mark.parametrize("config, absent", [
    (lambda: transformers.Qwen3MoeConfig(**{**TINY, "head_dim": 32, **MOE, "norm_topk_prob": False}),
     "norm_topk_prob"),  # Qwen3MoeConfig's default: False
    (lambda: transformers.Qwen3MoeConfig(**{**TINY, "head_dim": 16, **MOE}), "head_dim"),  # hidden // heads: 16
    (lambda: transformers.Qwen2MoeConfig(**{**TINY, **MOE, "shared_expert_intermediate_size": 48}), "qkv_bias"),
    (lambda: transformers.Qwen2MoeConfig(**{**TINY, **MOE, "shared_expert_intermediate_size": 48}),
     "decoder_sparse_step"),
], ids=["qwen3_moe-norm_topk_prob", "qwen3_moe-head_dim", "qwen2_moe-qkv_bias", "qwen2_moe-decoder_sparse_step"])
def test_a_qwen_moe_config_without_a_field_loads_as_transformers_loads_it(families, tmp_path, config, absent):
    assert_loads_as_transformers_without(config(), absent, tmp_path)


def assert_loads_as_transformers_without(config: transformers.PretrainedConfig, absent: str, path) -> None:
    """A tiny checkpoint of ``config`` whose config.json lacks ``absent``: posttune's model gives transformers'
    logits (each library filling the field with its own default)."""
    tiny_hf_model(config).save_pretrained(path)
    written = json.loads((path / "config.json").read_text())
    del written[absent]
    (path / "config.json").write_text(json.dumps(written))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    model = posttune.load_model(path, dtype="float32").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).float(), reference(IDS).logits, rtol=0, atol=1e-4)


@pytest.fixture
def llama_phi3(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_phi3, distribution="posttune-phi3", version="0.1.0")


@pytest.mark.parametrize("config, absent", [
    # Llama 1 era files have no num_key_value_heads: LlamaConfig's default is one key/value head per query head
    (lambda: transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 4}), "num_key_value_heads"),
    (lambda: transformers.LlamaConfig(**TINY), "tie_word_embeddings"),  # LlamaConfig's default: False
    (lambda: transformers.Phi3Config(**{**TINY, "num_key_value_heads": 4}), "num_key_value_heads"),
    # Phi3Config's default 1e-5, not the 1e-6 of most decoders; weights 10x wider so that eps moves the logits
    (lambda: transformers.Phi3Config(**{**TINY, "initializer_range": 0.2}), "rms_norm_eps"),
], ids=["llama-num_key_value_heads", "llama-tie_word_embeddings", "phi3-num_key_value_heads", "phi3-rms_norm_eps"])
def test_a_llama_or_phi3_config_without_a_field_loads_as_transformers_loads_it(llama_phi3, tmp_path, config, absent):
    """An older or hand-written config.json without the field: the family's default for it is transformers'
    (the fused qkv_proj of Phi-3 is split with the same default key/value heads)."""
    assert_loads_as_transformers_without(config(), absent, tmp_path)


def gemma_cases() -> dict:
    def without(config, *keys, **extra):
        data = config.to_dict()
        for key in keys:
            data.pop(key, None)
        return {**data, **extra}

    return {  # name: (config class, the dict both sides read)
        "gemma2-query_pre_attn_scalar": (transformers.Gemma2Config,
                                         lambda: without(tiny_gemma2_config(), "query_pre_attn_scalar")),
        "gemma3-attn_logit_softcapping": (transformers.Gemma3TextConfig,  # Gemma 3's attention takes no soft-cap
                                          lambda: tiny_gemma3_config(attn_logit_softcapping=0.5).to_dict()),
        "gemma3-legacy_rope_theta": (transformers.Gemma3TextConfig,  # rope_theta alone: the local layers' 10,000
                                     lambda: without(tiny_gemma3_config(), "rope_parameters", "rope_local_base_freq",
                                                     rope_theta=1_000_000.0)),
    }


@pytest.mark.parametrize("name", list(gemma_cases()))
def test_a_gemma_config_field_left_out_or_ignored_reads_as_transformers_reads_it(name):
    torch.manual_seed(0)
    config_class, written = gemma_cases()[name]
    data = written()
    config = config_class.from_dict(data)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    reference.config.to_dict = lambda: dict(data)  # the native side reads exactly the dict transformers read
    native = native_from_hf(reference)
    with torch.no_grad():
        torch.testing.assert_close(native(IDS).float(), reference(IDS).logits, rtol=0, atol=1e-4)
