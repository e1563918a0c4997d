"""The Hugging Face <-> native tensor-name maps for Qwen2 and Qwen3 checkpoints.

Tensors pass through unchanged: HF Qwen checkpoints store q/k in the rotate-half RoPE layout
posttune keeps natively. Qwen3 adds the per-head ``q_norm``/``k_norm`` weights; a Qwen2 map
refuses them, so a checkpoint read with the wrong family fails on its first foreign tensor.

A tied checkpoint usually has no ``lm_head.weight``; the native ``output.weight`` is then the
embedding's parameter and is filled by ``model.embed_tokens.weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from posttune.plugin import LayeredKeyMap

TOP_LEVEL = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "output"}
QWEN2_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.k_proj": "attn.k_proj",
    "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.o_proj",
    "post_attention_layernorm": "mlp_norm",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}
QWEN3_LAYER = {**QWEN2_LAYER, "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
PER_LAYER = {"qwen2": QWEN2_LAYER, "qwen3": QWEN3_LAYER}
Converter = Callable[[str, Any, Mapping[str, Any]], Any]


def converters(family: str) -> tuple[Converter, Converter]:
    """(to_native, from_native) for ``family``'s checkpoints."""
    keys = LayeredKeyMap(family, TOP_LEVEL, PER_LAYER[family])
    return keys.to_native, keys.from_native
