"""RMSNorm: scale by the reciprocal root-mean-square, computed in fp32 whatever the model dtype.

Two weight conventions exist in released checkpoints: Llama-style ``w * x_hat`` (weight
initialised to ones) and Gemma-style ``(1 + w) * x_hat`` (weight stored as an offset from one,
initialised to zeros). ``offset=True`` selects the latter so Gemma reuses this module unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma scales in fp32, then casts
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        # Llama casts back first and scales in the model dtype; matching that keeps bf16 parity
        return self.weight * normed.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.offset else nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}"
