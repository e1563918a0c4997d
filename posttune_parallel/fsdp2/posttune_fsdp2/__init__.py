"""posttune-fsdp2: the ``fsdp2`` parallel plan (``torch.distributed.fsdp.fully_shard``).

Parameters, gradients and optimizer state are sharded over the ``dp_shard`` mesh dimension,
which splits the batch, and over every other dimension whose ranks hold different tokens (e.g.
``cp``'s: those ranks reduce gradients together). Frozen model roles (a DPO reference, a
teacher) are sharded the same way, so no rank holds a whole extra model. Importing this package
does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from posttune import hookimpl
from posttune.plugin import ConfigError, Estimate, MeshDim, ModelTarget, ParallelPlan, RunConfig, Session

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

ORDER = 100  # last: TP / loss parallel / CP (and activation checkpointing, 50) come first
#: outermost: data parallelism spans the slowest links (nodes); cp (20) and tp (30) sit inside it
MESH_DIM = MeshDim("dp_shard", order=10, splits="batch")


@dataclass(frozen=True)
class FSDP2Options:
    """`parallel.options.fsdp2`."""

    mixed_precision: bool | None = None  # bf16 compute, fp32 reduce; None: on when model.dtype is bf16
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"  # compute dtype with mixed precision
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # gradient reduce-scatter dtype with mixed precision
    reshard_after_forward: bool = True  # free gathered layer weights after forward (re-gather in backward)
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in CPU memory


def apply(session: Session, target: ModelTarget) -> None:
    from posttune_fsdp2.shard import shard_model

    shard_model(session, target)


def validate(config: RunConfig) -> None:
    if config.adapter is not None and config.checkpoint.save_merged:
        raise ConfigError("checkpoint.save_merged", "not supported with fsdp2 (the model is sharded): save the "
                                                    "adapter and merge it on one process")


def init_device(options: FSDP2Options) -> str | None:
    """With CPU offload the sharded parameters live in CPU memory, so they materialise there."""
    return "cpu" if options.cpu_offload else None


def estimate(est: Estimate, plan: Any) -> Estimate:
    """`posttune plan`'s memory estimate: each process holds 1/degree of every model's weights, gradients
    and optimizer state (of this plan's mesh dimension; frozen roles are sharded the same way)."""
    est = est.sharded(plan.mesh.get(MESH_DIM.name, 1))
    if plan.parallel_options["fsdp2"].cpu_offload and est.device != "cpu":  # not measured: counted as if on the GPU
        note = "fsdp2's cpu_offload keeps the sharded weights, gradients and optimizer state above in CPU memory"
        est = replace(est, notes=(*est.notes, note))
    return est


PLAN = ParallelPlan(
    name="fsdp2",
    apply=apply,
    mesh_dim=MESH_DIM,
    order=ORDER,
    validate=validate,
    config=FSDP2Options,
    init_device=init_device,
    estimate=estimate,
    description="FSDP2 (fully_shard): shard parameters, gradients and optimizer state over dp_shard",
)


@hookimpl
def posttune_register_parallel_plans(register):
    register(PLAN)
