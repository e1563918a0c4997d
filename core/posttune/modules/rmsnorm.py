"""RMSNorm: scale by the reciprocal root-mean-square, computed in fp32 whatever the model dtype.

Two weight conventions exist in released checkpoints: Llama-style ``w * x_hat`` (weight
initialised to ones) and Gemma-style ``(1 + w) * x_hat`` (weight stored as an offset from one,
initialised to zeros). ``offset=True`` selects the latter so Gemma reuses this module unchanged.

In training the norm keeps only its input for the backward and recomputes the normalisation there
(`_Recomputed`): autograd would keep the normalised fp32 rows too (and, for a bf16 model, the
input's fp32 copy), one or two extra tensors of the hidden width per norm, about a fifth of a Llama
layer's saved activations in fp32 (docs/benchmarks.md, "Where a CPU step's memory goes"). The
recomputation is a handful of elementwise operations on rows the backward reads anyway.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # without the input's gradient autograd keeps only the normalised rows, as this would keep the input;
        # under torch.compile the compiler chooses what to save itself
        if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and x.requires_grad):
            return rms_norm(x, self.weight, self.eps, self.offset)
        return _Recomputed.apply(x, self.weight, self.eps, self.offset)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.offset else nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:  # Gemma scales in fp32, then casts
        return (normed * (1.0 + weight.float())).to(x.dtype)
    # Llama casts back first and scales in the model dtype; matching that keeps bf16 parity
    return weight * normed.to(x.dtype)


class _Recomputed(torch.autograd.Function):
    """`rms_norm` saving only its input and weight; the backward recomputes it and runs autograd's own backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        ctx.eps, ctx.offset = eps, offset
        ctx.save_for_backward(x, weight)
        return rms_norm(x, weight, eps, offset)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(ctx.needs_input_grad[0])
            weight = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            out = rms_norm(x, weight, ctx.eps, ctx.offset)
        wanted = [t for t in (x, weight) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return (next(grads) if x.requires_grad else None, next(grads) if weight.requires_grad else None, None, None)
