"""Gated feed-forward (SwiGLU / GeGLU): ``down(act(gate(x)) * up(x))``.

Llama, Mistral and Qwen use SiLU; Gemma uses the tanh approximation of GELU. Exact (erf)
GELU is there for checkpoints whose config.json asks for it by name.

`gated_product` keeps ``gate`` and ``up`` for the backward and recomputes ``act(gate)`` there:
autograd would also keep ``act(gate)``, a third tensor of the intermediate width, for each layer
(a quarter of a Llama layer's saved activations in fp32; docs/benchmarks.md, "Where a CPU step's
memory goes"). The backward calls the kernels autograd's own would, in the same order, so
gradients are bitwise those of the plain expression.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttune.errors import PosttuneError


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: each activation's derivative as autograd computes it: ``grad_of[name](grad, x)`` is grad * act'(x)
_GRAD_OF: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": torch.ops.aten.silu_backward,
    "gelu": torch.ops.aten.gelu_backward,
    "gelu_tanh": lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh"),
}


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise PosttuneError(f"unknown MLP activation '{name}' (supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


class _GatedProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
        ctx.activation = activation
        ctx.save_for_backward(gate, up)
        return ACTIVATIONS[activation](gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        gate, up = ctx.saved_tensors
        grad_gate = _GRAD_OF[ctx.activation](grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * ACTIVATIONS[ctx.activation](gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up, None


def gated_product(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up``, saving only ``gate`` and ``up`` for the backward (``act(gate)`` is recomputed there).

    Under ``torch.compile`` the plain expression is traced instead: the compiler chooses what to save itself.
    """
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return ACTIVATIONS[activation](gate) * up
    return _GatedProduct.apply(gate, up, activation)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.activation = activation
        self.act = get_activation(activation)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_product(self.gate_proj(x), self.up_proj(x), self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"
