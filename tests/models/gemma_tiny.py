"""Tiny Gemma / Gemma 2 / Gemma 3 configs for the gemma tests, and a native model carrying an HF model's weights.

The configs cover what the families add over Llama: sqrt(hidden)-scaled embeddings and
``(1 + w)`` norms with head_dim != hidden/heads (all), attention and final-logit soft-capping
with caps small enough to bite on random weights, ``query_pre_attn_scalar`` != head_dim,
alternating sliding-window layers with sequences (24 tokens) three times the window (gemma2),
q/k norms, local and global RoPE bases with linear scaling on the global one, and a final
soft-cap on Gemma 3. Each family has a GQA config and an MQA or untied one.
"""

from __future__ import annotations

from typing import Any

import transformers
from torch import nn

import posttune_gemma
from posttune.testing.tiny import TINY
from posttune.testing.tiny import native_from_hf as shared_native_from_hf

FAMILIES = {family.name: family for family in posttune_gemma.FAMILIES}
CONVERTERS = {c.family: c for c in posttune_gemma.CONVERTERS}
#: the token ids Gemma checkpoints use (pad 0, eos 1, bos 2)
GEMMA_TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "rms_norm_eps": 1e-6}
WINDOW = {"sliding_window": 8, "num_hidden_layers": 3}  # layers: local, global, local


def tiny_gemma_config(**overrides: Any) -> transformers.GemmaConfig:
    """The core's tiny shape (hidden 64, GQA 4:2, vocab 512) as a GemmaConfig with head_dim 32."""
    return transformers.GemmaConfig(**{**TINY, **GEMMA_TOKENS, "head_dim": 32, "tie_word_embeddings": True,
                                       **overrides})


def tiny_gemma2_config(**overrides: Any) -> transformers.Gemma2Config:
    return transformers.Gemma2Config(**{**TINY, **GEMMA_TOKENS, **WINDOW, "head_dim": 32,
                                        "query_pre_attn_scalar": 32, "tie_word_embeddings": True, **overrides})


def tiny_gemma3_config(**overrides: Any) -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(**{**TINY, **GEMMA_TOKENS, **WINDOW, "head_dim": 32,
                                            "query_pre_attn_scalar": 32, "sliding_window_pattern": 2,
                                            "tie_word_embeddings": True, **overrides})


LOCAL_GLOBAL_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}

CONFIGS = {
    "gemma_gqa": lambda: tiny_gemma_config(),
    "gemma_mqa_untied": lambda: tiny_gemma_config(num_key_value_heads=1, tie_word_embeddings=False,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # larger initial weights, so attention scores (up to ~13) and logits (~9) really reach the caps
    "gemma2_softcap_window": lambda: tiny_gemma2_config(attn_logit_softcapping=5.0, final_logit_softcapping=5.0,
                                                        query_pre_attn_scalar=20, initializer_range=0.2),
    # default weights with caps tight enough to bind (scores ~0.1, logits ~0.7): the bf16 case
    "gemma2_tight_softcap": lambda: tiny_gemma2_config(attn_logit_softcapping=0.1, final_logit_softcapping=0.5),
    "gemma2_no_softcap_mqa": lambda: tiny_gemma2_config(attn_logit_softcapping=None, final_logit_softcapping=None,
                                                        num_key_value_heads=1, sliding_window=5),
    "gemma3_local_global_rope": lambda: tiny_gemma3_config(rope_parameters=LOCAL_GLOBAL_ROPE),
    "gemma3_final_softcap_untied": lambda: tiny_gemma3_config(final_logit_softcapping=3.0, tie_word_embeddings=False,
                                                              query_pre_attn_scalar=48, sliding_window_pattern=3),
}


def native_from_hf(hf_model: nn.Module) -> nn.Module:
    """The native gemma model carrying an HF model's weights (the file loader is tested on its own)."""
    model_type = hf_model.config.model_type
    family = FAMILIES[{"gemma3_text": "gemma3"}.get(model_type, model_type)]
    return shared_native_from_hf(hf_model, family, CONVERTERS[family.name])
