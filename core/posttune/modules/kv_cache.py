"""A preallocated key/value cache for generation: prefill once, then one token per step.

Each layer's buffers are allocated on its first write ([batch, kv_heads, max_len, head_dim],
in the keys' dtype and device), so the cache needs no knowledge of the model. Layers write at
``length``; the decoder calls ``advance`` once per forward after every layer has written.
Sliding-window models keep all keys and let the mask hide the old ones: exact, and simple.

The buffers live in the KVCache and a LayerCache is a short-lived view of one layer: nothing
points back from what the cache holds to the cache, so its buffers are freed the moment the last
reference goes. A reference cycle here (an earlier version kept ``KVCache <-> LayerCache``) left
every generation batch's cache to Python's cyclic collector, which runs rarely: an RL example's rollouts
piled up 14 MiB of dead caches per step and fragmented the heap to twice its live size.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0  # tokens already cached (the next write starts here)
        self.keys: dict[int, torch.Tensor] = {}  # layer index -> [batch, kv_heads, max_len, head_dim]
        self.values: dict[int, torch.Tensor] = {}

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def reset(self) -> None:
        self.length = 0

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` names, in its order (a row may be named several times): a prompt
        prefilled once becomes the cache of each of its copies."""
        for layer in self.keys:
            self.keys[layer] = self.keys[layer].index_select(0, index)
            self.values[layer] = self.values[layer].index_select(0, index)


class LayerCache:
    """One layer's view of a KVCache (made per forward; it holds the cache, the cache never holds it)."""

    def __init__(self, cache: KVCache, index: int):
        self.cache = cache
        self.index = index

    @property
    def k(self) -> torch.Tensor | None:
        return self.cache.keys.get(self.index)

    @property
    def v(self) -> torch.Tensor | None:
        return self.cache.values.get(self.index)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [batch, kv_heads, seq, head_dim] at the cache's position; return all keys so far."""
        cache = self.cache
        start, end = cache.length, cache.length + k.shape[2]
        if end > cache.max_len:
            raise ValueError(f"KV cache is full: {end} tokens requested, max_len is {cache.max_len}")
        if self.index not in cache.keys:
            shape = (k.shape[0], k.shape[1], cache.max_len, k.shape[3])
            cache.keys[self.index] = k.new_zeros(shape)
            cache.values[self.index] = v.new_zeros(shape)
        keys, values = cache.keys[self.index], cache.values[self.index]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]
