"""The Llama / Mistral / Mixtral / SmolLM3 architectures, assembled from posttune's core blocks.

All four are the same pre-norm decoder (RMSNorm, GQA with RoPE); Mistral adds a sliding
attention window; SmolLM3 is Llama with RoPE left out of the layers ``no_rope_layers`` marks 0
(every fourth layer in the releases: NoPE). Llama and Mistral feed each layer through SwiGLU; Mixtral keeps Mistral's
attention (no bias, optional window) and makes every layer's feed-forward a mixture of experts
(``posttune.modules.MoE``: a softmax router whose top-k weights are renormalised to sum to 1, as
transformers' ``MixtralTopKRouter``; no shared expert). Native module names (what ``TP_PLAN``,
``LORA_TARGETS`` and the checkpoint converters refer to)::

    embed, layers.N.attn_norm, layers.N.attn.{q,k,v,o}_proj, layers.N.mlp_norm,
    layers.N.mlp.{gate,up,down}_proj, norm, output
    mixtral: layers.N.mlp.router, layers.N.mlp.experts.{gate,up,down}_proj (stacked) instead of the MLP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from posttune.modules import Decoder


def build(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
          num_kv_heads: int | None = None, head_dim: int | None = None, max_position_embeddings: int = 8192,
          rope_theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None, norm_eps: float = 1e-5,
          tie_word_embeddings: bool = False, attention_bias: bool = False, mlp_bias: bool = False,
          activation: str = "silu", sliding_window: int | None = None,
          no_rope_layers: Sequence[int] | None = None) -> Decoder:
    """A Llama-style decoder following posttune's native model contract (``posttune.modules.decoder``).

    ``no_rope_layers`` (SmolLM3's config.json field): one flag per layer, 0 for a layer without RoPE."""
    from posttune.modules import GatedMLP  # imported on the first build, not with the plugin module

    def mlp() -> nn.Module:
        return GatedMLP(hidden_size, intermediate_size, activation=activation, bias=mlp_bias)

    return _decoder(mlp, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                    rope_theta=rope_theta, rope_scaling=rope_scaling, norm_eps=norm_eps,
                    tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias,
                    sliding_window=sliding_window, no_rope_layers=no_rope_layers)


def build_mixtral(*, num_experts: int, top_k: int, vocab_size: int, hidden_size: int, intermediate_size: int,
                  num_layers: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                  max_position_embeddings: int = 131072, rope_theta: float = 1000000.0,
                  rope_scaling: Mapping[str, Any] | None = None, norm_eps: float = 1e-5,
                  tie_word_embeddings: bool = False, sliding_window: int | None = None, activation: str = "silu",
                  aux_loss_coef: float = 0.001, z_loss_coef: float = 0.0) -> Decoder:
    """A Mixtral decoder: Mistral's attention, every feed-forward ``num_experts`` experts of width
    ``intermediate_size`` with ``top_k`` per token. No bias anywhere (MixtralForCausalLM has none);
    the defaults are MixtralConfig's (``config.MIXTRAL_DEFAULTS``, which ``to_hf_config`` writes)."""
    from posttune.modules import Experts, MoE, Router

    def moe() -> nn.Module:
        return MoE(Router(hidden_size, num_experts, top_k, normalize=True),
                   Experts(num_experts, hidden_size, intermediate_size, activation=activation),
                   aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)

    return _decoder(moe, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                    rope_theta=rope_theta, rope_scaling=rope_scaling, norm_eps=norm_eps,
                    tie_word_embeddings=tie_word_embeddings, attention_bias=False, sliding_window=sliding_window)


def _decoder(mlp: Callable[[], nn.Module], *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
             num_kv_heads: int | None, head_dim: int | None, max_position_embeddings: int, rope_theta: float,
             rope_scaling: Mapping[str, Any] | None, norm_eps: float, tie_word_embeddings: bool,
             attention_bias: bool, sliding_window: int | None,
             no_rope_layers: Sequence[int] | None = None) -> Decoder:
    """The decoder the builders share; ``mlp()`` makes one layer's feed-forward (a dense MLP or experts)."""
    from torch import nn

    from posttune.modules import Attention, Decoder, DecoderLayer, RMSNorm, RotaryEmbedding

    head_dim = head_dim or hidden_size // num_heads
    if no_rope_layers is not None and len(no_rope_layers) != num_layers:
        raise ValueError(f"no_rope_layers must give one flag per layer ({num_layers}), got {len(no_rope_layers)}")

    def layer(index: int) -> DecoderLayer:
        attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, bias=attention_bias,
                         sliding_window=sliding_window, rope=no_rope_layers is None or bool(no_rope_layers[index]))
        return DecoderLayer(attn, mlp(), RMSNorm(hidden_size, norm_eps), RMSNorm(hidden_size, norm_eps))

    rope = RotaryEmbedding(head_dim, theta=rope_theta, scaling=rope_scaling,
                           max_position_embeddings=max_position_embeddings)
    return Decoder(nn.Embedding(vocab_size, hidden_size), [layer(index) for index in range(num_layers)],
                   RMSNorm(hidden_size, norm_eps), rope, tie_word_embeddings=tie_word_embeddings)
