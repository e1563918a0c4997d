"""Gated feed-forward (SwiGLU / GeGLU): ``down(act(gate(x)) * up(x))``.

Llama, Mistral and Qwen use SiLU; Gemma uses the tanh approximation of GELU. Exact (erf)
GELU is there for checkpoints whose config.json asks for it by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from posttune.errors import PosttuneError


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise PosttuneError(f"unknown MLP activation '{name}' (supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.activation = activation
        self.act = get_activation(activation)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"
