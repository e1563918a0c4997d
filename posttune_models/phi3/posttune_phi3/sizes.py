"""Named sizes (complete build kwargs). ``tiny`` is for tests and demos; the others are the released
checkpoints' shapes, for ``posttune plan`` and from-scratch builds. Training a release loads its
config.json, which also carries what these leave out: Phi-3.5's and Phi-4-mini's LongRoPE factor
lists (``phi4-mini`` here is its first 4096 positions' shape, plain RoPE)."""

from __future__ import annotations

from typing import Any

_PHI3: dict[str, Any] = {"vocab_size": 32064, "max_position_embeddings": 4096, "rope_theta": 10000.0,
                         "rope_scaling": None, "partial_rotary_factor": 1.0, "norm_eps": 1e-5,
                         "tie_word_embeddings": False, "sliding_window": 2047}

PHI3_SIZES: dict[str, dict[str, Any]] = {
    # partial rotary as Phi-4-mini (3/4 of each head), tied embeddings
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 2048, "rope_theta": 10000.0,
             "rope_scaling": None, "partial_rotary_factor": 0.75, "norm_eps": 1e-5, "tie_word_embeddings": True,
             "sliding_window": None},
    "mini": {**_PHI3, "hidden_size": 3072, "intermediate_size": 8192, "num_layers": 32, "num_heads": 32,
             "num_kv_heads": 32, "head_dim": 96},  # Phi-3-mini-4k-instruct
    "medium": {**_PHI3, "hidden_size": 5120, "intermediate_size": 17920, "num_layers": 40, "num_heads": 40,
               "num_kv_heads": 10, "head_dim": 128},  # Phi-3-medium-4k-instruct
    "phi4": {**_PHI3, "vocab_size": 100352, "max_position_embeddings": 16384, "rope_theta": 250000.0,
             "sliding_window": None, "hidden_size": 5120, "intermediate_size": 17920, "num_layers": 40,
             "num_heads": 40, "num_kv_heads": 10, "head_dim": 128},  # Phi-4 (14B)
    "phi4-mini": {**_PHI3, "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 8192, "num_layers": 32,
                  "num_heads": 24, "num_kv_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.75,
                  "tie_word_embeddings": True, "sliding_window": 262144},  # Phi-4-mini-instruct
}
