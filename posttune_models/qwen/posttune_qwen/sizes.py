"""Named sizes (complete build kwargs). ``tiny`` is for tests and demos; override ``vocab_size``
to match a tiny tokenizer. The others are the released checkpoints' shapes (config.json of the
Instruct / post-trained releases; none of them turns sliding windows on)."""

from __future__ import annotations

from typing import Any

_QWEN = {"rope_scaling": None, "norm_eps": 1e-6, "sliding_window": None}

_TINY2: dict[str, Any] = {
    **_QWEN, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 2048, "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
_QWEN25: dict[str, Any] = {**_QWEN, "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0}

QWEN2_SIZES: dict[str, dict[str, Any]] = {
    "tiny": _TINY2,
    "0.5b": {**_QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_layers": 24, "num_heads": 14,
             "num_kv_heads": 2, "head_dim": 64, "tie_word_embeddings": True},  # Qwen2.5-0.5B
    "1.5b": {**_QWEN25, "hidden_size": 1536, "intermediate_size": 8960, "num_layers": 28, "num_heads": 12,
             "num_kv_heads": 2, "head_dim": 128, "tie_word_embeddings": True},  # Qwen2.5-1.5B
    "7b": {**_QWEN25, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_layers": 28,
           "num_heads": 28, "num_kv_heads": 4, "head_dim": 128, "tie_word_embeddings": False},  # Qwen2.5-7B
}

_QWEN3: dict[str, Any] = {
    **_QWEN, "vocab_size": 151936, "num_kv_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "attention_bias": False,
}

QWEN3_SIZES: dict[str, dict[str, Any]] = {
    # head_dim 32 != hidden/heads (16), as in the real sizes
    "tiny": {**_TINY2, "head_dim": 32, "attention_bias": False},
    "0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_layers": 28, "num_heads": 16,
             "tie_word_embeddings": True},  # Qwen3-0.6B
    "1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_layers": 28, "num_heads": 16,
             "tie_word_embeddings": True},  # Qwen3-1.7B
    "4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_layers": 36, "num_heads": 32,
           "tie_word_embeddings": True},  # Qwen3-4B
    "8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_layers": 36, "num_heads": 32,
           "tie_word_embeddings": False},  # Qwen3-8B
}

_MOE_TINY: dict[str, Any] = {
    **_TINY2, "intermediate_size": 96, "num_experts": 8, "top_k": 2, "moe_intermediate_size": 32,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": (), "aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
}
_QWEN3_MOE: dict[str, Any] = {
    **_QWEN3, "num_kv_heads": 4, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": (),
    "aux_loss_coef": 0.001, "tie_word_embeddings": False, "top_k": 8,
}

QWEN3_MOE_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {**_MOE_TINY, "head_dim": 32, "attention_bias": False},
    "30b-a3b": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "num_layers": 48, "num_heads": 32,
                "num_experts": 128, "moe_intermediate_size": 768},  # Qwen3-30B-A3B
    "235b-a22b": {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288, "num_layers": 94, "num_heads": 64,
                  "num_experts": 128, "moe_intermediate_size": 1536},  # Qwen3-235B-A22B
}

QWEN2_MOE_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {**_MOE_TINY, "shared_expert_intermediate_size": 64, "norm_topk_prob": False, "attention_bias": True},
    "a2.7b": {**_QWEN25, "hidden_size": 2048, "intermediate_size": 5632, "num_layers": 24, "num_heads": 16,
              "num_kv_heads": 16, "head_dim": 128, "tie_word_embeddings": False, "num_experts": 60, "top_k": 4,
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
              "decoder_sparse_step": 1, "mlp_only_layers": (), "aux_loss_coef": 0.001, "max_position_embeddings": 8192,
              "attention_bias": True},  # Qwen1.5-MoE-A2.7B
    "57b-a14b": {**_QWEN25, "hidden_size": 3584, "intermediate_size": 18944, "num_layers": 28, "num_heads": 28,
                 "num_kv_heads": 4, "head_dim": 128, "tie_word_embeddings": False, "num_experts": 64, "top_k": 8,
                 "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480, "norm_topk_prob": False,
                 "decoder_sparse_step": 1, "mlp_only_layers": (), "aux_loss_coef": 0.001,
                 "attention_bias": True},  # Qwen2-57B-A14B
}
