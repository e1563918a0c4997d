"""The Gemma, Gemma 2 and Gemma 3 (text) architecture, assembled from posttune's core blocks.

One builder serves the three families; what differs between them is switched on by kwargs:

- all: embeddings scaled by sqrt(hidden), RMSNorm with ``(1 + w)`` weights, GELU-tanh gated
  MLP, tied output head (by default), head_dim independent of hidden / heads.
- Gemma 2 / 3 (``post_norms``): a norm after attention and after the MLP, before each joins
  the residual; local (sliding-window) and global layers (``layer_types``);
  ``query_pre_attn_scalar`` sets the attention scale to its inverse square root.
- Gemma 2: attention-score and final-logit soft-capping (``attn_softcap``, ``final_softcap``).
- Gemma 3 (``qk_norm``): RMSNorm over each head's queries and keys; local layers rotate with
  their own RoPE base (``local_rope_theta``).

Native module names (what ``TP_PLAN``, ``LORA_TARGETS`` and the checkpoint converters refer to)::

    embed, layers.N.attn_norm, layers.N.attn.{q,k,v,o}_proj, layers.N.attn.{q,k}_norm,
    layers.N.attn_post_norm, layers.N.mlp_norm, layers.N.mlp.{gate,up,down}_proj,
    layers.N.mlp_post_norm, norm, output
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttune.modules import Decoder

SLIDING, FULL = "sliding_attention", "full_attention"


def build(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
          num_kv_heads: int | None = None, head_dim: int = 256, max_position_embeddings: int = 8192,
          rope_theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None, norm_eps: float = 1e-6,
          tie_word_embeddings: bool = True, attention_bias: bool = False, activation: str = "gelu_tanh",
          query_pre_attn_scalar: float | None = None, post_norms: bool = False, qk_norm: bool = False,
          layer_types: Sequence[str] | None = None, sliding_window: int | None = None,
          attn_softcap: float | None = None, final_softcap: float | None = None,
          local_rope_theta: float | None = None, local_rope_scaling: Mapping[str, Any] | None = None) -> Decoder:
    """A Gemma-style decoder following posttune's native model contract (``posttune.modules.decoder``)."""
    from torch import nn  # imported on the first build, not with the plugin module

    from posttune.modules import Attention, Decoder, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding

    scale = None if query_pre_attn_scalar is None else query_pre_attn_scalar ** -0.5

    def norm(dim: int = hidden_size) -> RMSNorm:
        return RMSNorm(dim, norm_eps, offset=True)

    def layer(kind: str) -> DecoderLayer:
        attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, bias=attention_bias, scale=scale,
                         sliding_window=sliding_window if kind == SLIDING else None, softcap=attn_softcap)
        if qk_norm:
            attn.q_norm, attn.k_norm = norm(head_dim), norm(head_dim)
        mlp = GatedMLP(hidden_size, intermediate_size, activation=activation)
        return DecoderLayer(attn, mlp, norm(), norm(), attn_post_norm=norm() if post_norms else None,
                            mlp_post_norm=norm() if post_norms else None)

    def rope(theta: float, scaling: Mapping[str, Any] | None) -> RotaryEmbedding:
        return RotaryEmbedding(head_dim, theta=theta, scaling=scaling, max_position_embeddings=max_position_embeddings)

    kinds = list(layer_types) if layer_types is not None else [FULL] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, num_layers is {num_layers}")
    local = rope(local_rope_theta, local_rope_scaling) if local_rope_theta is not None else None
    return Decoder(nn.Embedding(vocab_size, hidden_size), [layer(kind) for kind in kinds], norm(),
                   rope(rope_theta, rope_scaling), tie_word_embeddings=tie_word_embeddings,
                   embed_scale=hidden_size ** 0.5, local_rope=local, logit_softcap=final_softcap)
