"""Named sizes (complete build kwargs). ``tiny`` is for tests and demos; override ``vocab_size``
to match a tiny tokenizer. The others are the released checkpoints' shapes (Mixtral's: config.json
of the Instruct releases, whose ``intermediate_size`` is each expert's width)."""

from __future__ import annotations

from typing import Any

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_LLAMA32_ROPE = {**_LLAMA31_ROPE, "factor": 32.0}

_TINY: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 2048, "rope_theta": 10000.0,
    "rope_scaling": None, "norm_eps": 1e-5, "tie_word_embeddings": True,
}

_LLAMA3: dict[str, Any] = {
    "vocab_size": 128256, "num_kv_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
}

LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_layers": 16, "num_heads": 32,
           "head_dim": 64, "rope_scaling": _LLAMA32_ROPE, "tie_word_embeddings": True},  # Llama-3.2-1B
    "3b": {**_LLAMA3, "hidden_size": 3072, "intermediate_size": 8192, "num_layers": 28, "num_heads": 24,
           "head_dim": 128, "rope_scaling": _LLAMA32_ROPE, "tie_word_embeddings": True},  # Llama-3.2-3B
    "8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32, "num_heads": 32,
           "head_dim": 128, "rope_scaling": _LLAMA31_ROPE, "tie_word_embeddings": False},  # Llama-3.1-8B
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
                     "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
                     "rope_theta": 100000.0, "rope_scaling": None, "norm_eps": 1e-5, "tie_word_embeddings": True,
                     "attention_bias": False, "mlp_bias": False},  # SmolLM2-135M-Instruct (a LlamaForCausalLM)
}

_MISTRAL7B: dict[str, Any] = {
    "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32, "num_heads": 32,
    "num_kv_heads": 8, "head_dim": 128, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rope_scaling": None, "norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
}

MISTRAL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {**_TINY, "tie_word_embeddings": False, "sliding_window": 16},
    "7b": _MISTRAL7B,  # Mistral-7B-v0.3 (full attention)
    "7b-v0.1": {**_MISTRAL7B, "vocab_size": 32000, "rope_theta": 10000.0, "sliding_window": 4096},
}

_EXPERTS: dict[str, Any] = {"activation": "silu", "num_experts": 8, "top_k": 2, "z_loss_coef": 0.0,
                            "tie_word_embeddings": False, "sliding_window": None}  # every Mixtral release
_MIXTRAL: dict[str, Any] = {**_EXPERTS, "num_kv_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
                            "rope_scaling": None, "norm_eps": 1e-5}

MIXTRAL_SIZES: dict[str, dict[str, Any]] = {
    # 8 experts of width 32, 2 per token (as the qwen MoE families' tiny size)
    "tiny": {**_TINY, **_EXPERTS, "intermediate_size": 32, "aux_loss_coef": 0.001},
    "8x7b": {**_MIXTRAL, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32,
             "num_heads": 32, "max_position_embeddings": 32768, "aux_loss_coef": 0.02},  # Mixtral-8x7B-Instruct-v0.1
    "8x22b": {**_MIXTRAL, "vocab_size": 32768, "hidden_size": 6144, "intermediate_size": 16384, "num_layers": 56,
              "num_heads": 48, "max_position_embeddings": 65536,
              "aux_loss_coef": 0.001},  # Mixtral-8x22B-Instruct-v0.1
}

SMOLLM3_SIZES: dict[str, dict[str, Any]] = {
    # 4 layers so that one is NoPE (the fourth), as in every fourth layer of the release
    "tiny": {**_TINY, "num_layers": 4, "no_rope_layers": (1, 1, 1, 0), "rope_theta": 2000000.0},
    "3b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008, "num_layers": 36, "num_heads": 16,
           "num_kv_heads": 4, "head_dim": 128, "max_position_embeddings": 65536, "rope_theta": 5000000.0,
           "rope_scaling": None, "norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
           "mlp_bias": False, "no_rope_layers": tuple(int((i + 1) % 4 != 0) for i in range(36))},  # SmolLM3-3B
}
