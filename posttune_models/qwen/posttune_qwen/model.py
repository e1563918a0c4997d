"""The Qwen2 / Qwen3 architectures, assembled from posttune's core blocks.

The mixture-of-experts releases (``qwen2_moe``: Qwen1.5-MoE, Qwen2-57B-A14B; ``qwen3_moe``:
Qwen3-30B-A3B, Qwen3-235B-A22B) keep their dense sibling's attention and replace the MLP of
every ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` with ``posttune.modules.MoE``
(Qwen2-MoE adds a shared expert behind a sigmoid gate).

Both are the Llama-style pre-norm decoder (RMSNorm, GQA with RoPE, SwiGLU). Qwen2 puts a bias
on the q/k/v projections but none on o_proj; Qwen3 has no bias (all four get one with
``attention_bias``) and RMS-normalises each query and key head over ``head_dim`` before RoPE,
through the core ``Attention``'s ``q_norm``/``k_norm`` slots. Either may slide an attention
window over the layers ``layer_types`` marks ``sliding_attention``.

Native module names (what ``TP_PLAN``, ``LORA_TARGETS`` and the converters refer to)::

    embed, layers.N.attn_norm, layers.N.attn.{q,k,v,o}_proj, layers.N.attn.{q,k}_norm (qwen3),
    layers.N.mlp_norm, layers.N.mlp.{gate,up,down}_proj, norm, output
    MoE layers: layers.N.mlp.router, layers.N.mlp.experts.{gate,up,down}_proj (stacked),
    layers.N.mlp.shared_expert.{gate,up,down}_proj and layers.N.mlp.shared_gate (qwen2_moe)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from torch import nn

from posttune.modules import Attention, Decoder, DecoderLayer, Experts, GatedMLP, MoE, RMSNorm, Router, RotaryEmbedding
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
    attention = partial(_qwen3_attention, hidden_size, num_heads, num_kv_heads, head_dim, attention_bias, norm_eps)
    return _decoder(attention, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                    num_layers=num_layers, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                    rope_theta=rope_theta, rope_scaling=rope_scaling, norm_eps=norm_eps,
                    tie_word_embeddings=tie_word_embeddings, sliding_window=sliding_window, layer_types=layer_types)


#: the dense builders' defaults for what an MoE builder passes through to ``_decoder`` unchanged
MOE_DENSE_DEFAULTS: dict[str, Any] = {"max_position_embeddings": 32768, "rope_theta": 10000.0, "rope_scaling": None,
                                      "tie_word_embeddings": False, "sliding_window": None, "layer_types": None}


def build_qwen3_moe(*, num_experts: int, top_k: int, moe_intermediate_size: int, norm_topk_prob: bool = False,
                    decoder_sparse_step: int = 1, mlp_only_layers: Sequence[int] = (), aux_loss_coef: float = 0.001,
                    z_loss_coef: float = 0.0, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                    head_dim: int = 128, attention_bias: bool = False, norm_eps: float = 1e-6,
                    **dense: Any) -> Decoder:
    """A Qwen3-MoE decoder: Qwen3's attention, ``posttune.modules.MoE`` feed-forward layers."""
    attention = partial(_qwen3_attention, hidden_size, num_heads, num_kv_heads, head_dim, attention_bias, norm_eps)
    moe = partial(_moe, hidden_size, num_experts, top_k, moe_intermediate_size, norm_topk_prob, aux_loss_coef,
                  z_loss_coef, 0)
    return _decoder(attention, hidden_size=hidden_size, head_dim=head_dim, norm_eps=norm_eps,
                    mlp=_sparse_layers(moe, decoder_sparse_step, mlp_only_layers), **{**MOE_DENSE_DEFAULTS, **dense})


def build_qwen2_moe(*, num_experts: int, top_k: int, moe_intermediate_size: int, norm_topk_prob: bool = False,
                    decoder_sparse_step: int = 1, mlp_only_layers: Sequence[int] = (), aux_loss_coef: float = 0.001,
                    z_loss_coef: float = 0.0, shared_expert_intermediate_size: int = 0, hidden_size: int,
                    num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                    attention_bias: bool = True, **dense: Any) -> Decoder:
    """A Qwen2-MoE decoder: Qwen2's attention (q/k/v bias), MoE layers with a gated shared expert."""
    def attention(window: int | None) -> Attention:
        return Attention(hidden_size, num_heads, num_kv_heads, head_dim, bias=attention_bias, out_bias=False,
                         sliding_window=window)

    moe = partial(_moe, hidden_size, num_experts, top_k, moe_intermediate_size, norm_topk_prob, aux_loss_coef,
                  z_loss_coef, shared_expert_intermediate_size)
    return _decoder(attention, hidden_size=hidden_size, head_dim=head_dim or hidden_size // num_heads,
                    mlp=_sparse_layers(moe, decoder_sparse_step, mlp_only_layers),
                    **{**MOE_DENSE_DEFAULTS, "norm_eps": 1e-6, **dense})


def _qwen3_attention(hidden_size: int, num_heads: int, num_kv_heads: int | None, head_dim: int, bias: bool,
                     norm_eps: float, window: int | None) -> Attention:
    attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, bias=bias, sliding_window=window)
    attn.q_norm = RMSNorm(head_dim, norm_eps)  # per head, over head_dim, before RoPE
    attn.k_norm = RMSNorm(head_dim, norm_eps)
    return attn


def _moe(hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, normalize: bool, aux_loss_coef: float,
         z_loss_coef: float, shared_size: int) -> MoE:
    shared = GatedMLP(hidden_size, shared_size, activation="silu") if shared_size else None
    return MoE(Router(hidden_size, num_experts, top_k, normalize=normalize),
               Experts(num_experts, hidden_size, intermediate_size, activation="silu"), shared_expert=shared,
               shared_gate=nn.Linear(hidden_size, 1, bias=False) if shared else None, aux_loss_coef=aux_loss_coef,
               z_loss_coef=z_loss_coef)


def _sparse_layers(moe: Callable[[], MoE], step: int,
                   dense_layers: Sequence[int]) -> Callable[[int, int, int], nn.Module]:
    """Layer index -> its feed-forward: MoE on every ``step``-th layer (1-based) not listed dense, as transformers."""
    def mlp(index: int, hidden_size: int, intermediate_size: int) -> nn.Module:
        if index not in dense_layers and (index + 1) % step == 0:
            return moe()
        return GatedMLP(hidden_size, intermediate_size, activation="silu")

    return mlp


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
             sliding_window: int | None, layer_types: Sequence[str] | None,
             mlp: Callable[[int, int, int], nn.Module] | None = None) -> Decoder:
    """``mlp(layer index, hidden_size, intermediate_size)``: each layer's feed-forward (SwiGLU by default)."""
    def layer(index: int, window: int | None) -> DecoderLayer:
        ffn = (mlp(index, hidden_size, intermediate_size) if mlp
               else GatedMLP(hidden_size, intermediate_size, activation="silu"))
        return DecoderLayer(attention(window), ffn, RMSNorm(hidden_size, norm_eps), RMSNorm(hidden_size, norm_eps))

    rope = RotaryEmbedding(head_dim, theta=rope_theta, scaling=rope_scaling,
                           max_position_embeddings=max_position_embeddings)
    layers = [layer(i, window) for i, window in enumerate(layer_windows(num_layers, sliding_window, layer_types))]
    return Decoder(nn.Embedding(vocab_size, hidden_size), layers, RMSNorm(hidden_size, norm_eps), rope,
                   tie_word_embeddings=tie_word_embeddings)
