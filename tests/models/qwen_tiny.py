"""Tiny Qwen2 / Qwen3 configs for the qwen tests, and a native model carrying an HF model's weights.

The configs cover what the families add over Llama: q/k/v bias (qwen2), sliding-window layers
from ``max_window_layers`` on with sequences longer than the window (qwen2), per-head q/k
RMSNorm with ``head_dim`` != hidden/heads and optional bias on all four projections (qwen3),
tied and untied embeddings, GQA.
"""

from __future__ import annotations

from typing import Any

import transformers
from torch import nn

import posttune_qwen
from posttune.testing.tiny import TINY
from posttune.testing.tiny import native_from_hf as shared_native_from_hf

FAMILIES = {"qwen2": posttune_qwen.QWEN2, "qwen3": posttune_qwen.QWEN3}
CONVERTERS = {c.family: c for c in posttune_qwen.CONVERTERS}


def tiny_qwen2_config(**overrides: Any) -> transformers.Qwen2Config:
    """The core's tiny shape (2 layers, hidden 64, GQA 4:2, vocab 512) as a Qwen2Config."""
    return transformers.Qwen2Config(**{**TINY, **overrides})


def tiny_qwen3_config(**overrides: Any) -> transformers.Qwen3Config:
    """The tiny shape as a Qwen3Config with head_dim 32 (hidden/heads is 16)."""
    return transformers.Qwen3Config(**{**TINY, "head_dim": 32, **overrides})


#: 3 layers, the first full, the other two sliding over 8 tokens (tests run 24+ tokens)
SLIDING = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3}

CONFIGS = {
    "qwen2_gqa": lambda: tiny_qwen2_config(),
    "qwen2_tied": lambda: tiny_qwen2_config(tie_word_embeddings=True),
    "qwen2_sliding_window": lambda: tiny_qwen2_config(**SLIDING),
    "qwen2_yarn_rope": lambda: tiny_qwen2_config(max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6}),
    "qwen3_gqa": lambda: tiny_qwen3_config(),
    "qwen3_tied": lambda: tiny_qwen3_config(tie_word_embeddings=True, num_key_value_heads=1),
    "qwen3_attention_bias": lambda: tiny_qwen3_config(attention_bias=True, head_dim=24),
    "qwen3_sliding_window": lambda: tiny_qwen3_config(**SLIDING),
}


def native_from_hf(hf_model: nn.Module) -> nn.Module:
    """The native qwen2/qwen3 model carrying an HF model's weights."""
    family = FAMILIES[hf_model.config.model_type]
    return shared_native_from_hf(hf_model, family, CONVERTERS[family.name])
