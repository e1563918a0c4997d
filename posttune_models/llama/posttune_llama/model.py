"""The Llama / Mistral architecture, assembled from posttune's core blocks.

Both families are the same pre-norm decoder (RMSNorm, GQA with RoPE, SwiGLU); Mistral adds a
sliding attention window. Native module names (what ``TP_PLAN``, ``LORA_TARGETS`` and the
checkpoint converter refer to)::

    embed, layers.N.attn_norm, layers.N.attn.{q,k,v,o}_proj, layers.N.mlp_norm,
    layers.N.mlp.{gate,up,down}_proj, norm, output
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttune.modules import Decoder


def build(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
          num_kv_heads: int | None = None, head_dim: int | None = None, max_position_embeddings: int = 8192,
          rope_theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None, norm_eps: float = 1e-5,
          tie_word_embeddings: bool = False, attention_bias: bool = False, mlp_bias: bool = False,
          activation: str = "silu", sliding_window: int | None = None) -> Decoder:
    """A Llama-style decoder following posttune's native model contract (``posttune.modules.decoder``)."""
    from torch import nn  # imported on the first build, not with the plugin module

    from posttune.modules import Attention, Decoder, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding

    head_dim = head_dim or hidden_size // num_heads

    def layer() -> DecoderLayer:
        attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, bias=attention_bias,
                         sliding_window=sliding_window)
        mlp = GatedMLP(hidden_size, intermediate_size, activation=activation, bias=mlp_bias)
        return DecoderLayer(attn, mlp, RMSNorm(hidden_size, norm_eps), RMSNorm(hidden_size, norm_eps))

    rope = RotaryEmbedding(head_dim, theta=rope_theta, scaling=rope_scaling,
                           max_position_embeddings=max_position_embeddings)
    return Decoder(nn.Embedding(vocab_size, hidden_size), [layer() for _ in range(num_layers)],
                   RMSNorm(hidden_size, norm_eps), rope, tie_word_embeddings=tie_word_embeddings)
