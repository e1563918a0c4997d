"""Named sizes (complete build kwargs). ``tiny`` is for tests and demos; override ``vocab_size``
to match a tiny tokenizer. The others are the released checkpoints' shapes (Gemma 3 ``4b`` is
the text decoder of gemma-3-4b, loadable from a text-only Gemma3ForCausalLM export)."""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"


def pattern(num_layers: int, every: int) -> tuple[str, ...]:
    """``every - 1`` sliding-window layers, then one global layer, repeated."""
    return tuple(SLIDING if (index + 1) % every else FULL for index in range(num_layers))


_COMMON: dict[str, Any] = {
    "head_dim": 256, "norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "activation": "gelu_tanh",
}
_TINY: dict[str, Any] = {
    **_COMMON, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
}

_GEMMA: dict[str, Any] = {**_COMMON, "vocab_size": 256000, "max_position_embeddings": 8192, "rope_theta": 10000.0,
                          "rope_scaling": None}

GEMMA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {**_TINY, "rope_theta": 10000.0, "rope_scaling": None},
    "2b": {**_GEMMA, "hidden_size": 2048, "intermediate_size": 16384, "num_layers": 18, "num_heads": 8,
           "num_kv_heads": 1},  # gemma-2b
    "7b": {**_GEMMA, "hidden_size": 3072, "intermediate_size": 24576, "num_layers": 28, "num_heads": 16,
           "num_kv_heads": 16},  # gemma-7b
}

_GEMMA2: dict[str, Any] = {
    **_GEMMA, "query_pre_attn_scalar": 256, "post_norms": True, "qk_norm": False, "sliding_window": 4096,
    "attn_softcap": 50.0, "final_softcap": 30.0,
}

GEMMA2_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {**_TINY, **{k: _GEMMA2[k] for k in ("rope_theta", "rope_scaling", "post_norms", "qk_norm",
                                                  "attn_softcap", "final_softcap")},
             "query_pre_attn_scalar": 16, "sliding_window": 16, "layer_types": pattern(2, 2)},
    "2b": {**_GEMMA2, "hidden_size": 2304, "intermediate_size": 9216, "num_layers": 26, "num_heads": 8,
           "num_kv_heads": 4, "layer_types": pattern(26, 2)},  # gemma-2-2b
    "9b": {**_GEMMA2, "hidden_size": 3584, "intermediate_size": 14336, "num_layers": 42, "num_heads": 16,
           "num_kv_heads": 8, "layer_types": pattern(42, 2)},  # gemma-2-9b
}

_GEMMA3: dict[str, Any] = {
    **_COMMON, "query_pre_attn_scalar": 256, "post_norms": True, "qk_norm": True, "attn_softcap": None,
    "final_softcap": None, "rope_theta": 1_000_000.0, "local_rope_theta": 10_000.0, "local_rope_scaling": None,
}

GEMMA3_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {**_TINY, **{k: _GEMMA3[k] for k in ("post_norms", "qk_norm", "attn_softcap", "final_softcap",
                                                  "rope_theta", "local_rope_theta", "local_rope_scaling")},
             "rope_scaling": None, "query_pre_attn_scalar": 16, "sliding_window": 16, "layer_types": pattern(2, 2)},
    "1b": {**_GEMMA3, "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_layers": 26,
           "num_heads": 4, "num_kv_heads": 1, "max_position_embeddings": 32768, "rope_scaling": None,
           "sliding_window": 512, "layer_types": pattern(26, 6)},  # gemma-3-1b
    "4b": {**_GEMMA3, "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240, "num_layers": 34,
           "num_heads": 8, "num_kv_heads": 4, "max_position_embeddings": 131072,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024,
           "layer_types": pattern(34, 6)},  # gemma-3-4b, text decoder
}
