"""The Hugging Face <-> native tensor-name maps for Gemma, Gemma 2 and Gemma 3 checkpoints.

Llama's names (``posttune.plugin.decoder_keys``) with one trap the per-family maps exist for:
Gemma 1's ``post_attention_layernorm`` is the norm *before* the MLP (as in Llama), while in
Gemma 2/3 it normalises the attention output and the pre-MLP norm is ``pre_feedforward_layernorm``.

Tensors pass through unchanged: HF Gemma q/k projections are already in the rotate-half RoPE
layout posttune keeps, and the ``(1 + w)`` norm weights are stored as offsets, which is what
``RMSNorm(offset=True)`` holds. Checkpoints are tied: ``lm_head.weight`` is usually absent and
the native ``output.weight`` is the embedding's parameter.
"""

from __future__ import annotations

from posttune.plugin import decoder_keys

_GEMMA2 = {"post_attention_layernorm": "attn_post_norm", "pre_feedforward_layernorm": "mlp_norm",
           "post_feedforward_layernorm": "mlp_post_norm"}
PER_LAYER: dict[str, dict[str, str]] = {
    "gemma": {},
    "gemma2": _GEMMA2,
    "gemma3": {**_GEMMA2, "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"},
}
HINT = " multimodal Gemma 3 checkpoints need their text-only Gemma3ForCausalLM export"
KEYS = {family: decoder_keys(family, layer, hint=HINT) for family, layer in PER_LAYER.items()}
