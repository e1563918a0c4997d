"""The Phi-3 architecture, assembled from posttune's core blocks.

A Llama-style pre-norm decoder (RMSNorm, GQA, SwiGLU, no biases) whose RoPE may rotate only the
first ``partial_rotary_factor`` of each head (``posttune.modules.apply_rotary`` passes the rest
through) and may use LongRoPE, with an optional sliding window on every layer. Native module names
are Llama's (the converter splits HF's fused ``qkv_proj``/``gate_up_proj`` into them)::

    embed, layers.N.attn_norm, layers.N.attn.{q,k,v,o}_proj, layers.N.mlp_norm,
    layers.N.mlp.{gate,up,down}_proj, norm, output
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from posttune.modules import Attention, Decoder, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding


def build(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
          num_kv_heads: int | None = None, head_dim: int | None = None, max_position_embeddings: int = 4096,
          rope_theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None,
          partial_rotary_factor: float = 1.0, norm_eps: float = 1e-5, tie_word_embeddings: bool = False,
          sliding_window: int | None = None, activation: str = "silu") -> Decoder:
    """A Phi-3 decoder following posttune's native model contract (``posttune.modules.decoder``)."""
    head_dim = head_dim or hidden_size // num_heads
    rotated = int(head_dim * partial_rotary_factor)  # as transformers rounds it
    if rotated < 2 or rotated % 2:
        raise ValueError(f"partial_rotary_factor {partial_rotary_factor} rotates {rotated} of head_dim {head_dim}: "
                         f"RoPE needs an even number of dimensions")

    def layer() -> DecoderLayer:
        attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, sliding_window=sliding_window)
        mlp = GatedMLP(hidden_size, intermediate_size, activation=activation)
        return DecoderLayer(attn, mlp, RMSNorm(hidden_size, norm_eps), RMSNorm(hidden_size, norm_eps))

    rope = RotaryEmbedding(rotated, theta=rope_theta, scaling=rope_scaling,
                           max_position_embeddings=max_position_embeddings)
    return Decoder(nn.Embedding(vocab_size, hidden_size), [layer() for _ in range(num_layers)],
                   RMSNorm(hidden_size, norm_eps), rope, tie_word_embeddings=tie_word_embeddings)
