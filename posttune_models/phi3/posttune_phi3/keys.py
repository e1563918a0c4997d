"""Phi-3's tensor names: Llama's, with two fused projections split on load and joined on save.

``model.layers.N.self_attn.qkv_proj.weight`` holds the query rows (``num_attention_heads *
head_dim``), then the key rows, then the value rows (``num_key_value_heads * head_dim`` each);
``model.layers.N.mlp.gate_up_proj.weight`` holds the gate rows, then the up rows (transformers'
``Phi3MLP`` chunks its output in that order). Loading yields each part as its own native tensor
(a view: nothing is copied before the model's parameters are filled); saving holds q, k and v
(gate and up) until the last arrives and concatenates them (``posttune.plugin.Join``). The row
counts come from config.json and are checked against the tensor, so a checkpoint whose config
disagrees with its weights fails in one line naming both.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from posttune.plugin import Join, LayeredKeyMap, PosttuneError, decoder_keys

#: HF fused module (inside a layer) -> its native parts, in the order their rows are stacked
FUSED = {"self_attn.qkv_proj": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _cat(parts: list[Any]) -> Any:
    import torch

    return torch.cat(parts, dim=0)


def part_rows(fused: str, hf_config: Mapping[str, Any]) -> tuple[int, ...]:
    """Rows of each part of ``fused`` (a key of ``FUSED``) for this config.json."""
    if fused == "mlp.gate_up_proj":
        return (hf_config["intermediate_size"],) * 2
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


@dataclass(frozen=True)
class FusedKeys:
    """``to_native``/``from_native`` of the phi3 converter."""

    keys: LayeredKeyMap = field(default_factory=lambda: decoder_keys("phi3"))
    _hf: re.Pattern = field(init=False, repr=False)
    _native: re.Pattern = field(init=False, repr=False)
    _fused_of: dict[str, str] = field(init=False, repr=False)  # native part -> its HF fused module

    def __post_init__(self) -> None:
        fused = "|".join(re.escape(name) for name in FUSED)
        parts = "|".join(re.escape(part) for parts in FUSED.values() for part in parts)
        object.__setattr__(self, "_hf", re.compile(rf"model\.layers\.(\d+)\.({fused})\.weight"))
        object.__setattr__(self, "_native", re.compile(rf"layers\.(\d+)\.({parts})\.weight"))
        object.__setattr__(self, "_fused_of", {part: name for name, parts in FUSED.items() for part in parts})

    def to_native(self, key: str, tensor: Any, hf_config: Mapping[str, Any]) -> Any:
        match = self._hf.fullmatch(key)
        if match is None:
            return self.keys.to_native(key, tensor, hf_config)
        return self._split(key, match.group(1), match.group(2), tensor, hf_config)

    def _split(self, key: str, layer: str, fused: str, tensor: Any, hf_config: Mapping[str, Any]
               ) -> Iterator[tuple[str, Any]]:
        rows = part_rows(fused, hf_config)
        if tensor.shape[0] != sum(rows):
            raise PosttuneError(f"checkpoint tensor '{key}' has {tensor.shape[0]} rows; config.json's sizes give "
                                f"{' + '.join(map(str, rows))} = {sum(rows)}")
        start = 0
        for part, count in zip(FUSED[fused], rows):
            yield f"layers.{layer}.{part}.weight", tensor[start:start + count]
            start += count

    def from_native(self, key: str, tensor: Any, hf_config: Mapping[str, Any]) -> Any:
        match = self._native.fullmatch(key)
        if match is None:
            return self.keys.from_native(key, tensor, hf_config)
        layer, part = match.groups()
        fused = self._fused_of[part]
        parts = tuple(f"layers.{layer}.{name}.weight" for name in FUSED[fused])
        return Join(f"model.layers.{layer}.{fused}.weight", parts, _cat), tensor
