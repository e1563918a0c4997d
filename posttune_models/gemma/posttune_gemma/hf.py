"""The Hugging Face <-> native tensor-name maps for Gemma, Gemma 2 and Gemma 3 checkpoints.

Tensors pass through unchanged: HF Gemma q/k projections are already in the rotate-half RoPE
layout posttune keeps, and the ``(1 + w)`` norm weights are stored as offsets, which is what
``RMSNorm(offset=True)`` holds. Checkpoints are tied: ``lm_head.weight`` is usually absent and
the native ``output.weight`` is the embedding's parameter.

One trap the per-family maps exist for: Gemma 1's ``post_attention_layernorm`` is the norm
*before* the MLP (as in Llama), while in Gemma 2/3 it normalises the attention output and the
pre-MLP norm is ``pre_feedforward_layernorm``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttune.plugin import LayeredKeyMap

TOP_LEVEL = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "output"}
_BLOCKS = {f"self_attn.{name}": f"attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
    f"mlp.{name}": f"mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")}
_GEMMA2 = {**_BLOCKS, "input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
           "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_post_norm"}
PER_LAYER: dict[str, dict[str, str]] = {
    "gemma": {**_BLOCKS, "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"},
    "gemma2": _GEMMA2,
    "gemma3": {**_GEMMA2, "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"},
}
HINT = " multimodal Gemma 3 checkpoints need their text-only Gemma3ForCausalLM export"
KEYS = {family: LayeredKeyMap(family, TOP_LEVEL, layer, hint=HINT) for family, layer in PER_LAYER.items()}


def to_native(key: str, tensor: Any, hf_config: Mapping[str, Any], *, family: str) -> tuple[str, Any] | None:
    """(native key, tensor) for an HF tensor; None for one the native model does not keep."""
    return KEYS[family].to_native(key, tensor, hf_config)


def from_native(key: str, tensor: Any, hf_config: Mapping[str, Any], *, family: str) -> tuple[str, Any]:
    """(HF key, tensor) for a native tensor."""
    return KEYS[family].from_native(key, tensor, hf_config)
