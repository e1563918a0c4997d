"""Flex attention for the attention block: a mask that brings its own attention call.

``Attention.forward`` receives the mask the decoder (or a plan's hook) gives it; when that
mask is a ``FlexMask`` it calls ``FlexMask.attend`` instead of SDPA. A plan builds one
``FlexMask`` per micro-batch: a ``BlockMask`` from any ``mask_mod`` (causal, documents,
positions rearranged by a load balancer) plus, optionally, a function that completes keys and
values first (context parallelism all-gathers them over its ranks, so each rank's queries see
the whole sequence).

torch 2.13 on CPU runs flex attention forward in eager mode (its unfused reference path); its
backward needs a GPU, so plans that train through it are GPU-only. On a GPU the call is compiled (once per
shape) and so is the block mask: eager flex attention materialises the whole [batch, heads, q, kv] score
matrix, which at the lengths context parallelism exists for does not fit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttune.modules.softcap import soft_cap

KVGather = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class FlexMask:
    """A ``BlockMask`` and how keys/values reach it; passed where a boolean mask would be."""

    block_mask: Any  # torch.nn.attention.flex_attention.BlockMask
    gather_kv: KVGather | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """[batch, heads, q_len, head_dim] queries over (gathered) keys/values, GQA included; ``softcap`` bounds
        the scaled scores as the dense path does (``cap * tanh(score / cap)``, Gemma 2's)."""
        from torch.nn.attention.flex_attention import flex_attention

        if self.gather_kv is not None:
            k, v = self.gather_kv(k, v)
        attention = _compiled() if q.is_cuda else flex_attention
        return attention(q, k, v, score_mod=None if softcap is None else _capped(softcap), block_mask=self.block_mask,
                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@functools.cache
def _compiled() -> Callable[..., torch.Tensor]:
    """flex attention compiled into fused kernels (a GPU's): one per shape, as torchtitan compiles it."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _capped(cap: float) -> Callable[..., torch.Tensor]:
    """Gemma 2's soft-cap as a score_mod: one function per cap, so a compiled call is not traced again per layer."""
    def score_mod(score: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return soft_cap(score, cap)

    return score_mod


def block_mask(mask_mod: Callable[..., torch.Tensor], *, batch: int | None, q_len: int, kv_len: int,
               device: torch.device | str) -> Any:
    """``create_block_mask``, compiled on a GPU (a long sequence's mask is built in its kernels), not on the CPU
    (small masks, and CPU machines without a compiler)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device,
                             _compile=torch.device(device).type == "cuda")
