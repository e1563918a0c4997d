"""Tanh soft-capping: ``cap * tanh(x / cap)`` squashes values smoothly into (-cap, cap).

Used on attention scores (before masking and softmax) and on final logits by models that
bound them this way (released ones use caps such as 50 and 30). ``cap=None`` is the
identity, so callers apply it unconditionally.
"""

from __future__ import annotations

import torch


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``, or ``x`` unchanged when ``cap`` is None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap
