"""The pre-norm decoder: embedding -> layers (attention + MLP, each with a residual) -> norm -> head.

The native model contract every family returns from ``build``::

    logits = model(input_ids, positions=None, document_ids=None, kv_cache=None)  # [b, s, vocab]
    hidden = model.hidden_states(input_ids, ...)  # final-normed [b, s, hidden]; logits = model.output(hidden)

Positions default to 0..s-1 (continuing from a KV cache's length); with ``document_ids`` they
restart at 0 for each document of a packed row, and attention stays within each document.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from posttune.modules.attention import Attention, attention_mask
from posttune.modules.kv_cache import KVCache, LayerCache
from posttune.modules.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    """``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, attn: Attention, mlp: nn.Module, attn_norm: nn.Module, mlp_norm: nn.Module):
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.mlp_norm = mlp_norm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """A decoder-only language model assembled from blocks (see the module docstring for the contract)."""

    def __init__(self, embed: nn.Embedding, layers: Iterable[DecoderLayer], norm: nn.Module,
                 rope: RotaryEmbedding, *, tie_word_embeddings: bool = False):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rope = rope
        vocab_size, hidden_size = embed.weight.shape
        self.output = nn.Linear(hidden_size, vocab_size, bias=False)
        self.tie_word_embeddings = tie_word_embeddings
        self.init_buffers()

    def init_buffers(self) -> None:
        """Re-tie the output head to the embedding: ``to_empty`` from the meta device (torch 2.13)
        gives every module its own fresh parameter, silently untying shared weights."""
        if self.tie_word_embeddings and self.output.weight is not self.embed.weight:
            self.output.weight = self.embed.weight

    def hidden_states(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        batch, seq = input_ids.shape
        start = kv_cache.length if kv_cache is not None else 0
        if positions is None:
            positions = default_positions(batch, seq, start=start, document_ids=document_ids,
                                          device=input_ids.device)
        cos, sin = self.rope(positions)
        x = self.embed(input_ids)
        masks: dict[int | None, torch.Tensor | None] = {}  # one mask per distinct sliding window
        for index, layer in enumerate(self.layers):
            window = layer.attn.sliding_window
            if window not in masks:
                masks[window] = attention_mask(seq, start + seq, device=input_ids.device,
                                               document_ids=document_ids, sliding_window=window)
            cache = kv_cache.layer(index) if kv_cache is not None else None
            x = layer(x, cos, sin, masks[window], cache)
        if kv_cache is not None:
            kv_cache.advance(seq)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions=positions, document_ids=document_ids, kv_cache=kv_cache)
        return self.output(hidden)


def default_positions(batch: int, seq: int, *, start: int = 0, document_ids: torch.Tensor | None = None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions [batch, seq]: ``start..start+seq-1``, or restarting at 0 at each document boundary."""
    index = torch.arange(start, start + seq, device=device).expand(batch, seq)
    if document_ids is None:
        return index
    boundary = torch.ones_like(document_ids, dtype=torch.bool)
    boundary[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(boundary, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first
