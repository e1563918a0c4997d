"""A Phi-3-style model family, as a third party writes one: its checkpoints fuse tensors, the model does not.

Hugging Face's ``Phi3ForCausalLM`` stores each layer's q/k/v projections as one ``qkv_proj``
(rows: all query heads, then the key heads, then the value heads) and gate/up as one
``gate_up_proj`` (gate rows, then up rows). Natively they stay apart, as ``posttune.modules``'
decoder has them, so the core's tensor-parallel plan and LoRA targets apply unchanged. The
converter splits a fused tensor on load (one HF tensor -> several native ones) and joins the parts
back on save (``Join``: several native tensors -> one HF tensor); every other tensor keeps Llama's
name (``decoder_keys``). Nothing here is known to the core.

Named ``fused_phi3``, not ``phi3``: posttune-phi3 (first-party) reads the same architecture, so a run
picks this family by naming it (``model.family: fused_phi3``), which wins over the architecture.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from posttune.plugin import (DECODER_LINEAR_LAYERS, DECODER_TP_PLAN, CheckpointConverter, Join, LayeredKeyMap,
                             ModelFamily, PosttuneError, decoder_hf_config, decoder_keys, decoder_kwargs)

NAME = "fused_phi3"
ARCHITECTURE = "Phi3ForCausalLM"
#: HF fused module -> the modules it holds, in row order, under the names Llama gives them
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
KEYS: LayeredKeyMap = decoder_keys(NAME)  # Llama's names for everything but the fused tensors
LAYER_TENSOR = re.compile(r"(model\.layers\.\d+\.)(.+)\.(\w+)")  # prefix, module, parameter


def to_native(key: str, tensor: Any, hf_config: Mapping[str, Any]) -> Any:
    """A fused tensor -> its parts under native names (views: nothing is copied); others renamed."""
    match = LAYER_TENSOR.fullmatch(key)
    if match is None or match[2] not in FUSED:
        return KEYS.to_native(key, tensor, hf_config)
    prefix, fused, param = match.groups()
    rows = _rows(fused, tensor, hf_config)
    if sum(rows) != tensor.shape[0]:
        raise PosttuneError(f"checkpoint tensor '{key}' has {tensor.shape[0]} rows; config.json's sizes give "
                            f"{' + '.join(map(str, rows))}")
    names = [KEYS.to_native(f"{prefix}{part}.{param}", tensor, hf_config)[0] for part in FUSED[fused]]
    return list(zip(names, tensor.split(rows), strict=True))


def from_native(key: str, tensor: Any, hf_config: Mapping[str, Any]) -> Any:
    """A part of a fused tensor -> ``Join`` (held until its siblings arrive); others renamed."""
    hf_key, value = KEYS.from_native(key, tensor, hf_config)
    match = LAYER_TENSOR.fullmatch(hf_key)
    fused = next((fused for fused, parts in FUSED.items() if match and match[2] in parts), None)
    if fused is None:
        return hf_key, value
    prefix, _, param = match.groups()
    natives = tuple(KEYS.to_native(f"{prefix}{part}.{param}", tensor, hf_config)[0] for part in FUSED[fused])
    return Join(f"{prefix}{fused}.{param}", natives, join=_concatenate), value


def _rows(fused: str, tensor: Any, hf_config: Mapping[str, Any]) -> list[int]:
    if fused == "mlp.gate_up_proj":
        return [tensor.shape[0] // 2] * 2
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]


def _concatenate(parts: list[Any]) -> Any:
    import torch

    return torch.cat(parts)


def from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Build kwargs from Phi-3's config.json (Llama's fields, plus its sliding window)."""
    if config.get("hidden_act", "silu") != "silu":
        raise PosttuneError(f"config.json: hidden_act '{config['hidden_act']}' is not supported by the {NAME} family")
    kwargs = decoder_kwargs(config, NAME, max_position_embeddings=4096, windowed=True)
    return {**kwargs, "sliding_window": config.get("sliding_window")}


def to_hf_config(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    config = decoder_hf_config(kwargs, ARCHITECTURE, NAME, max_position_embeddings=4096, norm_eps=1e-5)
    return {**config, "hidden_act": "silu", "sliding_window": kwargs.get("sliding_window")}


def build(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
          num_kv_heads: int | None = None, head_dim: int | None = None, max_position_embeddings: int = 4096,
          rope_theta: float = 10000.0, rope_scaling: Mapping[str, Any] | None = None, norm_eps: float = 1e-5,
          tie_word_embeddings: bool = False, sliding_window: int | None = None) -> Any:
    """Llama's decoder from ``posttune.modules`` blocks: q/k/v and gate/up are separate Linears."""
    from torch import nn

    from posttune.modules import Attention, Decoder, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding

    head_dim = head_dim or hidden_size // num_heads

    def layer() -> DecoderLayer:
        attention = Attention(hidden_size, num_heads, num_kv_heads, head_dim, sliding_window=sliding_window)
        mlp = GatedMLP(hidden_size, intermediate_size, activation="silu")
        return DecoderLayer(attention, mlp, RMSNorm(hidden_size, norm_eps), RMSNorm(hidden_size, norm_eps))

    rope = RotaryEmbedding(head_dim, theta=rope_theta, scaling=rope_scaling,
                           max_position_embeddings=max_position_embeddings)
    return Decoder(nn.Embedding(vocab_size, hidden_size), [layer() for _ in range(num_layers)],
                   RMSNorm(hidden_size, norm_eps), rope, tie_word_embeddings=tie_word_embeddings)


FAMILY = ModelFamily(
    name=NAME, architectures=(ARCHITECTURE,), from_hf_config=from_hf_config, build=build, to_hf_config=to_hf_config,
    sizes={"tiny": {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
                    "num_kv_heads": 2, "max_position_embeddings": 256, "norm_eps": 1e-5}},
    tp_plan=DECODER_TP_PLAN, lora_targets=DECODER_LINEAR_LAYERS,
    description="Phi-3 (Phi3ForCausalLM: fused qkv_proj and gate_up_proj in its checkpoints; a third-party example)",
)
CONVERTER = CheckpointConverter(NAME, "hf", to_native=to_native, from_native=from_native,
                                description="Phi-3's fused q/k/v and gate/up split on load, joined on save")


def register_model_families(register: Any) -> None:
    register(FAMILY)


def register_checkpoint_converters(register: Any) -> None:
    register(CONVERTER)
