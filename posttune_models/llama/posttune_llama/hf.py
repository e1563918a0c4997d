"""The Hugging Face <-> native tensor-name map for Llama and Mistral checkpoints.

Tensors pass through unchanged: HF stores q/k projections in the rotate-half RoPE layout that
posttune keeps natively (HF's own conversion from Meta's interleaved layout already permuted
them), so no permutation is needed in either direction.

A tied checkpoint usually has no ``lm_head.weight``; the native ``output.weight`` is then the
embedding's parameter and is filled by ``model.embed_tokens.weight``.
"""

from __future__ import annotations

from posttune.plugin import LayeredKeyMap

TOP_LEVEL = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "output"}
PER_LAYER = {
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
#: llama and mistral checkpoints share one name map (the error names the checkpoint's model_type)
KEYS = LayeredKeyMap("llama", TOP_LEVEL, PER_LAYER)
to_native = KEYS.to_native
from_native = KEYS.from_native
