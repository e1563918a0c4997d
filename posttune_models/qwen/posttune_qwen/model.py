"""The Qwen2 / Qwen3 architectures, assembled from posttune's core blocks.

Both are the Llama-style pre-norm decoder (RMSNorm, GQA with RoPE, SwiGLU). Qwen2 puts a bias
on the q/k/v projections but none on o_proj; Qwen3 has no bias (all four get one with
``attention_bias``) and RMS-normalises each query and key head over ``head_dim`` before RoPE,
through the core ``Attention``'s ``q_norm``/``k_norm`` slots. Either may slide an attention
window over the layers ``layer_types`` marks ``sliding_attention``.

Native module names (what ``TP_PLAN``, ``LORA_TARGETS`` and the converters refer to)::

    embed, layers.N.attn_norm, layers.N.attn.{q,k,v,o}_proj, layers.N.attn.{q,k}_norm (qwen3),
    layers.N.mlp_norm, layers.N.mlp.{gate,up,down}_proj, norm, output
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from posttune.modules import Attention, Decoder, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding
from posttune_qwen.config import SLIDING


def build_qwen2(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                num_kv_heads: int | None = None, head_dim: int | None = None, max_position_embeddings: int = 32768,
                rope_theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None, norm_eps: float = 1e-6,
                tie_word_embeddings: bool = False, sliding_window: int | None = None,
                layer_types: Sequence[str] | None = None) -> Decoder:
    """A Qwen2 / Qwen2.5 decoder following posttune's native model contract (``posttune.modules.decoder``)."""
    def attention(window: int | None) -> Attention:
        return Attention(hidden_size, num_heads, num_kv_heads, head_dim, bias=True, out_bias=False,
                         sliding_window=window)

    return _decoder(attention, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                    num_layers=num_layers, head_dim=head_dim or hidden_size // num_heads,
                    max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                    rope_scaling=rope_scaling, norm_eps=norm_eps, tie_word_embeddings=tie_word_embeddings,
                    sliding_window=sliding_window, layer_types=layer_types)


def build_qwen3(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                num_kv_heads: int | None = None, head_dim: int = 128, max_position_embeddings: int = 40960,
                rope_theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None, norm_eps: float = 1e-6,
                tie_word_embeddings: bool = False, sliding_window: int | None = None,
                layer_types: Sequence[str] | None = None, attention_bias: bool = False) -> Decoder:
    """A Qwen3 (dense) decoder following posttune's native model contract (``posttune.modules.decoder``)."""
    def attention(window: int | None) -> Attention:
        attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, bias=attention_bias,
                         sliding_window=window)
        attn.q_norm = RMSNorm(head_dim, norm_eps)  # per head, over head_dim, before RoPE
        attn.k_norm = RMSNorm(head_dim, norm_eps)
        return attn

    return _decoder(attention, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                    num_layers=num_layers, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                    rope_theta=rope_theta, rope_scaling=rope_scaling, norm_eps=norm_eps,
                    tie_word_embeddings=tie_word_embeddings, sliding_window=sliding_window, layer_types=layer_types)


def layer_windows(num_layers: int, sliding_window: int | None, layer_types: Sequence[str] | None) -> list[int | None]:
    """Each layer's attention window: ``sliding_window`` where ``layer_types`` says it slides.

    With a window but no ``layer_types``, every layer slides (as ``use_sliding_window`` with
    ``max_window_layers=0`` does in transformers).
    """
    if sliding_window is None:
        return [None] * num_layers
    if layer_types is None:
        return [sliding_window] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers, the model has {num_layers}")
    return [sliding_window if kind == SLIDING else None for kind in layer_types]


def _decoder(attention: Callable[[int | None], Attention], *, vocab_size: int, hidden_size: int,
             intermediate_size: int, num_layers: int, head_dim: int, max_position_embeddings: int,
             rope_theta: float, rope_scaling: Mapping[str, Any] | None, norm_eps: float, tie_word_embeddings: bool,
             sliding_window: int | None, layer_types: Sequence[str] | None) -> Decoder:
    def layer(window: int | None) -> DecoderLayer:
        mlp = GatedMLP(hidden_size, intermediate_size, activation="silu")
        return DecoderLayer(attention(window), mlp, RMSNorm(hidden_size, norm_eps), RMSNorm(hidden_size, norm_eps))

    rope = RotaryEmbedding(head_dim, theta=rope_theta, scaling=rope_scaling,
                           max_position_embeddings=max_position_embeddings)
    layers = [layer(window) for window in layer_windows(num_layers, sliding_window, layer_types)]
    return Decoder(nn.Embedding(vocab_size, hidden_size), layers, RMSNorm(hidden_size, norm_eps), rope,
                   tie_word_embeddings=tie_word_embeddings)
