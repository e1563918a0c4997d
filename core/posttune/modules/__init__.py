"""Building blocks shared by model families: norms, RoPE, attention, MLPs, mixtures of experts, the
decoder, the KV cache.

A family plugin assembles these in its ``build``; it never subclasses them.
"""

from __future__ import annotations

from torch import nn

from posttune.modules.attention import Attention, attention_mask, explicit_attention
from posttune.modules.decoder import Decoder, DecoderLayer, default_positions, forward_takes
from posttune.modules.flex_attention import FlexMask, block_mask
from posttune.modules.kv_cache import KVCache, LayerCache
from posttune.modules.mlp import GatedMLP
from posttune.modules.moe import Experts, MoE, Router, expert_linear
from posttune.modules.rmsnorm import RMSNorm
from posttune.modules.rope import (ROPE_TYPES, RotaryEmbedding, apply_rotary, rope_frequencies, rope_type,
                                   split_rope_parameters)
from posttune.modules.softcap import soft_cap


def init_buffers(model: nn.Module) -> nn.Module:
    """Restore what ``to_empty`` loses and no checkpoint carries; call it right after ``to_empty``.

    A model built on the meta device and materialised with ``to_empty`` holds garbage in
    non-persistent buffers (RoPE frequencies) and, in torch 2.13, has its tied weights untied
    (the output head gets its own parameter). Each module concerned exposes ``init_buffers()``.
    """
    for module in model.modules():
        method = getattr(module, "init_buffers", None)
        if callable(method):
            method()
    return model


__all__ = [
    "ROPE_TYPES", "Attention", "Decoder", "DecoderLayer", "Experts", "FlexMask", "GatedMLP", "KVCache", "LayerCache",
    "MoE", "RMSNorm", "Router", "RotaryEmbedding", "apply_rotary", "attention_mask", "block_mask", "default_positions",
    "expert_linear", "explicit_attention", "forward_takes", "init_buffers",
    "rope_frequencies", "rope_type", "soft_cap", "split_rope_parameters",
]
