"""Shard each ``Experts`` module over the ``ep`` ranks and route tokens to them with all-to-all.

Rank r of ``ep`` holds experts ``[r * E/ep, (r + 1) * E/ep)``: the stacked parameters become
DTensors sharded on dim 0 over the ``ep`` mesh (so gradient norms, checkpoints and FSDP2 see one
tensor), and the module's ``dispatch`` sends each row, already sorted by expert, to its expert's
rank (``all_to_all_single`` with uneven splits; a rank may receive nothing), runs the local
experts with grouped GEMM, and sends the outputs back the same way. Dropless: no capacity factor,
every row is computed.

Gradients: a rank's experts see the rows of every ``ep`` rank, so their gradient already sums
the ``ep`` group's tokens. The trainer's normalisation assumes a data-parallel mean over every
rank that holds different tokens (FSDP2 averages the other parameters over ``dp_shard x ep``),
so the experts' gradients are divided by ``ep`` on the way back; FSDP2 then averages them over
``dp_shard``, which completes the same mean.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as collectives
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from posttune.modules import Experts

WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def shard_experts(model: nn.Module, mesh: Any) -> int:
    """Shard every ``Experts`` of ``model`` over ``mesh`` (the ``ep`` dimension); returns how many."""
    found = 0
    for module in model.modules():
        if isinstance(module, Experts):
            for name in WEIGHTS:
                param = getattr(module, name)
                sharded = distribute_tensor(param.data, mesh, [Shard(0)])
                setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            module.dispatch = Dispatcher(mesh)
            found += 1
    return found


class Dispatcher:
    """``Experts.dispatch`` over one ``ep`` mesh (see the module docstring)."""

    def __init__(self, mesh: Any):
        self.group, self.size, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()

    def __call__(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        local = experts.num_experts // self.size
        # how many rows of each of my experts every rank sends me: [ep (source), local experts]
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        received_counts = received_counts.view(self.size, local)
        send = counts.view(self.size, local).sum(dim=1)
        sizes = torch.cat([send, received_counts.sum(dim=1), received_counts.reshape(-1)]).tolist()  # one sync
        send_splits, receive_splits = sizes[:self.size], sizes[self.size:2 * self.size]
        per_source = torch.tensor(sizes[2 * self.size:]).view(self.size, local)
        arrived = self._exchange(rows, receive_splits, send_splits)
        # rows arrive source by source; the experts want them expert by expert
        order = expert_major(per_source).to(rows.device)
        weights = tuple(_ScaleGrad.apply(_local(getattr(experts, name)), 1.0 / self.size) for name in WEIGHTS)
        out = experts.compute(arrived[order], per_source.sum(dim=0).to(counts.device), weights)
        back = torch.empty_like(out).index_copy_(0, order, out) if len(order) else out
        return self._exchange(back, send_splits, receive_splits)

    def _exchange(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        out = collectives.all_to_all_single_autograd(rows, output_splits, input_splits, self.group)
        return collectives.wait_tensor(out)


def expert_major(per_source: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder blocks laid out source-major (``per_source[s, e]`` rows of expert e
    from source s, sources in order) into expert-major order (each expert's rows, sources in order)."""
    flat = per_source.reshape(-1)
    starts = (flat.cumsum(0) - flat).view_as(per_source)
    sources, experts = per_source.shape
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + per_source[s, e]))
              for e in range(experts) for s in range(sources)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param
