"""posttune-ep: the ``ep`` parallel plan, expert parallelism for mixture-of-experts families.

Each ``posttune.modules.Experts`` is split over the ``ep`` ranks (rank r holds ``num_experts / ep``
consecutive experts); tokens travel to their experts' ranks and back with all-to-all
(``dispatch.py``). The ``ep`` ranks hold different tokens (the dimension splits the batch), so
FSDP2, which this plan requires, shards the other parameters over ``dp_shard x ep`` and the
experts further over ``dp_shard``. Importing this package does not import torch.

    parallel:
      plans: [fsdp2, ep]
      dims: {ep: 8}    # dp_shard takes the remaining ranks
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from posttune.plugin import (ConfigError, Estimate, MeshDim, ModelTarget, ParallelPlan, RunConfig, Session,
                             registering)

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

ORDER = 8  # before TP (10), which leaves the experts to it, and before FSDP2 (100), which wraps the shards
#: inside dp_shard (10): the all-to-all of every MoE layer wants faster links than the gradient reduce
MESH_DIM = MeshDim("ep", order=15, splits="batch")


def apply(session: Session, target: ModelTarget) -> None:
    from posttune_ep.dispatch import shard_experts

    if not shard_experts(target.model, session.mesh[MESH_DIM.name]):
        raise ConfigError("parallel.plans", f"ep: the {target.role} model ({target.family.name}) has no "
                                            "mixture-of-experts layers to split")


def validate(config: RunConfig) -> None:
    """A mixture-of-experts family whose expert count the ``ep`` degree divides, checked before launch."""
    degree = config.parallel.dims.get(MESH_DIM.name, 1)
    from posttune.plugin import model_kwargs

    experts = model_kwargs(config).get("num_experts")
    family = config.model.family or "this model"
    if experts is None:
        raise ConfigError("parallel.plans", f"ep splits the experts of a mixture-of-experts model; {family} is "
                                            "dense (no num_experts): remove ep")
    if degree > 1 and experts % degree:
        raise ConfigError("parallel.dims.ep", f"ep={degree} does not divide the model's {experts} experts; "
                                              f"choose an ep degree that does")


def estimate(est: Estimate, plan: Any) -> Estimate:
    """Each ``ep`` rank holds 1/ep of the experts, and FSDP2 shards the rest over ``dp_shard x ep``:
    together, 1/ep of what FSDP2's own term left (which divides by ``dp_shard``)."""
    est = est.sharded(plan.mesh.get(MESH_DIM.name, 1))
    note = "ep's all-to-all buffers (each rank's routed rows, twice per MoE layer) are not counted"
    return replace(est, notes=(*est.notes, note))


PLAN = ParallelPlan(
    name="ep",
    apply=apply,
    mesh_dim=MESH_DIM,
    order=ORDER,
    requires=("fsdp2",),
    validate=validate,
    estimate=estimate,
    description="expert parallelism: each MoE layer's experts split over ep, tokens sent to them with all-to-all",
)

posttune_register_parallel_plans = registering((PLAN,))
