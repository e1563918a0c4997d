"""posttune-fsdp2: the ``fsdp2`` parallel plan (``torch.distributed.fsdp.fully_shard``).

Parameters, gradients and optimizer state are sharded over the ``dp_shard`` mesh dimension
(and ``cp`` with context parallelism: those ranks see different tokens, so they reduce
gradients together). Frozen model roles (a DPO reference, a teacher) are sharded the same way,
so no rank holds a whole extra model. Importing this package does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from posttune import hookimpl
from posttune.plugin import ParallelPlan
from posttune.plugin import ConfigError

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

ORDER = 100  # last: TP / loss parallel / CP (and activation checkpointing, 50) come first


@dataclass(frozen=True)
class FSDP2Options:
    """`parallel.options.fsdp2`."""

    mixed_precision: bool | None = None  # bf16 compute, fp32 reduce; None: on when model.dtype is bf16
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"  # compute dtype with mixed precision
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # gradient reduce-scatter dtype with mixed precision
    reshard_after_forward: bool = True  # free gathered layer weights after forward (re-gather in backward)
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in CPU memory


def apply(session: Any, target: Any) -> None:
    from posttune_fsdp2.shard import shard_model

    shard_model(session, target)


def validate(config: Any) -> None:
    if config.adapter is not None and config.checkpoint.save_merged:
        raise ConfigError("checkpoint.save_merged", "not supported with fsdp2 (the model is sharded): save the "
                                                    "adapter and merge it on one process")


PLAN = ParallelPlan(
    name="fsdp2",
    apply=apply,
    mesh_dim="dp_shard",
    order=ORDER,
    validate=validate,
    config=FSDP2Options,
    description="FSDP2 (fully_shard): shard parameters, gradients and optimizer state over dp_shard",
)


@hookimpl
def posttune_register_parallel_plans(register):
    register(PLAN)
