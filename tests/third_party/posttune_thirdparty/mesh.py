"""A parallel plan that owns a mesh dimension the core has never heard of, as a third party writes one.

    parallel: {plans: [replicas]}        # torchrun --nproc-per-node N: N whole replicas, mesh rep=N

``replicas`` declares the dimension ``rep``: outermost, and it splits the batch, so the core's
loaders give each of its ranks different rows and the trainer sums losses and token counts over
it. Every rank holds the whole model; after each micro-batch's backward the plan averages the
gradients over ``rep`` (the trainer undoes that mean with the rest of its normalisation), so the
replicas take the same steps and the run equals one process that sees the whole global batch.
Nothing here is known to the core: the name ``rep``, its place in the mesh and what it splits
come from the declaration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from posttune.plugin import Estimate, MeshDim, ParallelPlan, Session

NAME = "replicas"
REP = MeshDim("rep", order=0, splits="batch")


def apply(session: Session, target: Any) -> None:
    """Once, for the policy (``frozen="skip"``): average its gradients after every backward."""
    session.step_contexts.append(average_gradients)


@contextlib.contextmanager
def average_gradients(session: Session, batch: Any) -> Iterator[None]:
    """Around a micro-batch's forward, loss and backward: on exit every rank holds the mean gradient."""
    yield
    import torch

    from posttune.plugin import all_reduce_sum, token_group

    group, size = token_group(session)  # the ranks of ``rep``: they hold different rows
    grads = [p.grad for p in session.model.parameters() if p.grad is not None]
    if size == 1 or not grads:
        return
    with torch.no_grad():
        flat = all_reduce_sum(torch.cat([grad.reshape(-1) for grad in grads]), group) / size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def estimate(est: Estimate, plan: Any) -> Estimate:
    """Every rank holds the whole model, its gradients and optimizer state: per rank, as one process."""
    return est


PLAN = ParallelPlan(
    name=NAME, apply=apply, mesh_dim=REP, order=100, frozen="skip", estimate=estimate,
    conflicts=("fsdp2", "tp", "cp"),  # they make gradients DTensors, which this plain average does not handle
    description="a whole model per rank over the mesh dimension rep, gradients averaged (a third-party example)",
)


def register_parallel_plans(register: Any) -> None:
    register(PLAN)
