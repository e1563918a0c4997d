"""One adapted linear layer: LoRA (Hu et al. 2021) and DoRA (Liu et al. 2024).

``LoRALinear`` is an ``AdaptedLinear`` (the core's adapter protocol): it wraps a frozen ``nn.Linear``
and keeps it, untouched, as its child ``base``::

    layers.0.attn.q_proj.base.weight      the base weight (frozen), native name + ".base"
    layers.0.attn.q_proj.base.bias        (when the layer has one)
    layers.0.attn.q_proj.lora_A.weight    [rank, in]   kaiming-uniform
    layers.0.attn.q_proj.lora_B.weight    [out, rank]  zeros, so a fresh adapter changes nothing
    layers.0.attn.q_proj.magnitude        [out]        DoRA only: row norms of the base weight

``lora_A``/``lora_B`` are ``nn.Linear`` too, so tensor parallelism can shard ``lora_B`` like
the base layer and replicate ``lora_A``.

LoRA:  ``y = base(x) + s * B(A(dropout(x)))`` with ``s = alpha / rank`` (rank-stabilised LoRA,
Kalajdzievski 2023, PEFT's ``use_rslora``: ``s = alpha / sqrt(rank)``, so a higher rank still learns).

DoRA, as PEFT computes it: the weight is ``m * V / ||V||_row`` with ``V = W + s * B @ A`` and
the norm detached from the graph (section 4.3 of the paper), so::

    y = base(x) + (m / ||V|| - 1) * W x' + (m / ||V||) * s * B(A(x'))      x' = dropout(x)

which, without dropout, is exactly ``F.linear(x, m * V / ||V||, bias)``. The magnitude ``m``
starts as ``||W||_row`` so a fresh DoRA adapter changes nothing either.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from posttune.plugin import AdaptedLinear, PosttuneError, apply_adapters, copy_into

Kind = Literal["lora", "dora"]
KINDS: tuple[str, ...] = ("lora", "dora")


class LoRALinear(AdaptedLinear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0,
                 kind: Kind = "lora", dtype: torch.dtype | None = None, rslora: bool = False):
        super().__init__(base)
        weight = base.weight
        dtype = dtype or weight.dtype
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=weight.device, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=weight.device, dtype=dtype)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.magnitude = (nn.Parameter(torch.empty(base.out_features, device=weight.device, dtype=dtype))
                          if kind == "dora" else None)
        self.rank, self.alpha, self.dropout_p, self.kind = rank, float(alpha), float(dropout), kind
        self.rslora = rslora
        self.scaling = self.alpha / (math.sqrt(rank) if rslora else rank)
        self.train(base.training)  # the new dropout too: an adapter added to a model in eval mode must not drop out
        if weight.device.type != "meta":
            self.reset_adapter()

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A from kaiming-uniform (as nn.Linear and PEFT), B from zeros, DoRA m from ``||W||_row``.

        Needs the real base weight: called at construction, or by ``init_adapters`` once a
        model built on the meta device has its weights loaded.
        """
        weight_a = self.lora_A.weight
        if hasattr(weight_a, "device_mesh"):  # sharded (FSDP2/TP): draw the whole matrix, keep this rank's part
            full = torch.empty(weight_a.shape, dtype=weight_a.dtype, device=weight_a.device)
            copy_into(weight_a, nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator))
        else:
            nn.init.kaiming_uniform_(weight_a, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_B.weight)
        if self.magnitude is not None:
            self.magnitude.copy_(row_norm(self.base.weight, self.lora_delta()))

    def lora_delta(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``s * B @ A`` in the adapter's dtype (or ``dtype``): the update to the base weight, shape [out, in]."""
        return self.scaling * (self.lora_B.weight.to(dtype) @ self.lora_A.weight.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        if self.disabled:
            return result
        dtype = self.lora_A.weight.dtype
        if self.magnitude is None:
            update = self.lora_B(self.lora_A(self.dropout(x).to(dtype)))
            return result + (self.scaling * update).to(result.dtype)
        return result + self._dora_update(x, result).to(result.dtype)

    def _dora_update(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        weight = self.base.weight
        dtype = self.lora_A.weight.dtype
        if isinstance(self.dropout, nn.Identity) or not self.training:
            # W x is already in ``result``: reuse it rather than a second matmul.
            base_out = result if self.base.bias is None else result - self.base.bias
            xd = x
        else:
            xd = self.dropout(x)
            base_out = F.linear(xd, weight)
        norm = row_norm(weight, self.lora_delta().detach()).detach()
        scale = (self.magnitude / norm).to(dtype)
        update = self.lora_B(self.lora_A(xd.to(dtype)))
        return (scale - 1) * base_out.to(dtype) + scale * self.scaling * update

    def effective_weight(self) -> torch.Tensor:
        """``W + s * B @ A`` (DoRA: row-rescaled, the norm detached as in ``forward``), differentiable."""
        weight = self.base.weight
        delta = self.lora_delta().to(weight.dtype)
        if self.magnitude is None:
            return weight + delta
        norm = row_norm(weight, delta.detach()).detach()
        return (self.magnitude / norm).to(weight.dtype).unsqueeze(1) * (weight + delta)

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The single weight this layer computes with (dropout aside), in ``dtype`` (default: the base's): the
        update computed and added in fp32 and rounded once, as PEFT's ``merge_and_unload`` does (a bf16 merge is
        bitwise PEFT's)."""
        weight = self.base.weight
        merged = weight.float() + self.lora_delta(torch.float32)
        if self.magnitude is not None:
            merged = merged * (self.magnitude.float() / merged.norm(dim=1)).unsqueeze(1)
        return merged.to(dtype or weight.dtype)

    def extra_repr(self) -> str:
        drop = f", dropout={self.dropout_p}" if self.dropout_p else ""
        return f"kind={self.kind}, rank={self.rank}, alpha={self.alpha:g}{drop}{', rslora' if self.rslora else ''}"


def row_norm(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``||W + delta||`` per output row (DoRA's column norm of the [in, out] weight), W's dtype."""
    return torch.linalg.vector_norm(weight + delta.to(weight.dtype), dim=1)


def apply_lora(model: nn.Module, *, targets: Any, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               kind: Kind = "lora", dtype: torch.dtype | None = None, aliases: Any = None,
               rslora: bool = False) -> list[str]:
    """``apply_adapters`` with LoRA (or DoRA) layers of these settings: what a script adapting a model by hand
    calls (a run wraps its layers from ``adapter:``). Returns the adapted module names."""
    if kind not in KINDS:
        raise PosttuneError(f"adapters: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(rank, int) or rank < 1:
        raise PosttuneError(f"adapters: rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise PosttuneError(f"adapters: alpha must be positive, got {alpha!r}")
    if not 0 <= dropout < 1:
        raise PosttuneError(f"adapters: dropout must be in [0, 1), got {dropout!r}")

    def wrap(linear: nn.Linear) -> LoRALinear:
        return LoRALinear(linear, rank=rank, alpha=alpha, dropout=dropout, kind=kind, dtype=dtype, rslora=rslora)

    return apply_adapters(model, targets=targets, wrap=wrap, aliases=aliases)
