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

from posttune.errors import PosttuneError

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
HF_LAYERS, NATIVE_LAYERS = "model.layers.", "layers."
#: tensors some checkpoints carry that the native model recomputes instead
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

Converter = Callable[[str, Any, Mapping[str, Any]], Any]


def rename(key: str, top: Mapping[str, str], per_layer: Mapping[str, str], prefix: str, new_prefix: str) -> str | None:
    """``key`` with its module path mapped (top-level modules, or ``prefix``N.module); None if unknown."""
    module, _, param = key.rpartition(".")
    if module in top:
        return f"{top[module]}.{param}"
    if module.startswith(prefix):
        index, _, rest = module[len(prefix):].partition(".")
        if index.isdigit() and rest in per_layer:
            return f"{new_prefix}{index}.{per_layer[rest]}.{param}"
    return None


def converters(family: str) -> tuple[Converter, Converter]:
    """(to_native, from_native) for ``family``'s checkpoints."""
    layer = PER_LAYER[family]
    native_top = {v: k for k, v in TOP_LEVEL.items()}
    native_layer = {v: k for k, v in layer.items()}

    def to_native(key: str, tensor: Any, hf_config: Mapping[str, Any]) -> tuple[str, Any] | None:
        """(native key, tensor) for an HF tensor; None for one the native model does not keep."""
        if key.endswith(IGNORED_SUFFIXES):
            return None
        native = rename(key, TOP_LEVEL, layer, HF_LAYERS, NATIVE_LAYERS)
        if native is None:
            raise PosttuneError(f"checkpoint tensor '{key}' is not part of a {family} model "
                                f"(is this the right family?)")
        return native, tensor

    def from_native(key: str, tensor: Any, hf_config: Mapping[str, Any]) -> tuple[str, Any]:
        """(HF key, tensor) for a native tensor."""
        hf_key = rename(key, native_top, native_layer, NATIVE_LAYERS, HF_LAYERS)
        if hf_key is None:
            raise PosttuneError(f"native tensor '{key}' has no Hugging Face name in the {family} family")
        return hf_key, tensor

    return to_native, from_native
