"""The Hugging Face <-> native tensor-name map for Llama and Mistral checkpoints.

Tensors pass through unchanged: HF stores q/k projections in the rotate-half RoPE layout that
posttune keeps natively (HF's own conversion from Meta's interleaved layout already permuted
them), so no permutation is needed in either direction.

A tied checkpoint usually has no ``lm_head.weight``; the native ``output.weight`` is then the
embedding's parameter and is filled by ``model.embed_tokens.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttune.errors import PosttuneError

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
HF_LAYERS, NATIVE_LAYERS = "model.layers.", "layers."
#: tensors some checkpoints carry that the native model recomputes instead
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _rename(key: str, top: Mapping[str, str], per_layer: Mapping[str, str], prefix: str,
            new_prefix: str) -> str | None:
    module, _, param = key.rpartition(".")
    if module in top:
        return f"{top[module]}.{param}"
    if module.startswith(prefix):
        index, _, rest = module[len(prefix):].partition(".")
        if index.isdigit() and rest in per_layer:
            return f"{new_prefix}{index}.{per_layer[rest]}.{param}"
    return None


_NATIVE_TOP = {v: k for k, v in TOP_LEVEL.items()}
_NATIVE_PER_LAYER = {v: k for k, v in PER_LAYER.items()}


def to_native(key: str, tensor: Any, hf_config: Mapping[str, Any]) -> tuple[str, Any] | None:
    """(native key, tensor) for an HF tensor; None for one the native model does not keep."""
    if key.endswith(IGNORED_SUFFIXES):
        return None
    native = _rename(key, TOP_LEVEL, PER_LAYER, HF_LAYERS, NATIVE_LAYERS)
    if native is None:
        raise PosttuneError(f"checkpoint tensor '{key}' is not part of a {hf_config.get('model_type', 'llama')} "
                            f"model (is this the right family?)")
    return native, tensor


def from_native(key: str, tensor: Any, hf_config: Mapping[str, Any]) -> tuple[str, Any]:
    """(HF key, tensor) for a native tensor."""
    hf_key = _rename(key, _NATIVE_TOP, _NATIVE_PER_LAYER, NATIVE_LAYERS, HF_LAYERS)
    if hf_key is None:
        raise PosttuneError(f"native tensor '{key}' has no Hugging Face name in the llama family")
    return hf_key, tensor
