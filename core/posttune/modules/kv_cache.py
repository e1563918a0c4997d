"""A preallocated key/value cache for generation: prefill once, then one token per step.

Each layer's buffers are allocated on its first write ([batch, kv_heads, max_len, head_dim],
in the keys' dtype and device), so the cache needs no knowledge of the model. Layers write at
``length``; the decoder calls ``advance`` once per forward after every layer has written.
Sliding-window models keep all keys and let the mask hide the old ones: exact, and simple.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0  # tokens already cached (the next write starts here)
        self._layers: dict[int, LayerCache] = {}

    def layer(self, index: int) -> LayerCache:
        if index not in self._layers:
            self._layers[index] = LayerCache(self)
        return self._layers[index]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def reset(self) -> None:
        self.length = 0


class LayerCache:
    """One layer's view of a KVCache."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [batch, kv_heads, seq, head_dim] at the cache's position; return all keys so far."""
        start, end = self.cache.length, self.cache.length + k.shape[2]
        if end > self.cache.max_len:
            raise ValueError(f"KV cache is full: {end} tokens requested, max_len is {self.cache.max_len}")
        if self.k is None or self.v is None:
            shape = (k.shape[0], k.shape[1], self.cache.max_len, k.shape[3])
            self.k = k.new_zeros(shape)
            self.v = v.new_zeros(shape)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]
