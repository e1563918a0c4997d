"""Small wrappers so the trainer reads the same on one process and on many."""

from __future__ import annotations

import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_main() -> bool:
    return rank() == 0


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (e.g. the grad norm under FSDP2) as a plain tensor; plain tensors pass through."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
