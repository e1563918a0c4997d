"""Flex attention for the attention block: a mask that brings its own attention call.

``Attention.forward`` receives the mask the decoder (or a plan's hook) gives it; when that
mask is a ``FlexMask`` it calls ``FlexMask.attend`` instead of SDPA. A plan builds one
``FlexMask`` per micro-batch: a ``BlockMask`` from any ``mask_mod`` (causal, documents,
positions rearranged by a load balancer) plus, optionally, a function that completes keys and
values first (context parallelism all-gathers them over its ranks, so each rank's queries see
the whole sequence).

torch 2.13 on CPU runs flex attention forward in eager mode (its unfused reference path); its
backward needs a GPU, so plans that train through it are GPU-only.
"""

from __future__ import annotations

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
        score_mod = None
        if softcap is not None:
            def score_mod(score: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
                return soft_cap(score, softcap)
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=self.block_mask, scale=scale,
                              enable_gqa=q.shape[1] != k.shape[1])


def block_mask(mask_mod: Callable[..., torch.Tensor], *, batch: int | None, q_len: int, kv_len: int,
               device: torch.device | str) -> Any:
    """``create_block_mask`` without compiling (small masks, and CPU machines without a compiler)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device, _compile=False)
