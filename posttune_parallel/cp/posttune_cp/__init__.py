"""posttune-cp: the ``cp`` parallel plan, context parallelism over the sequence dimension.

Each micro-batch is split over the ``cp`` ranks along the sequence, load-balanced for causal
attention (rank r holds chunks r and 2*cp-1-r of 2*cp: early chunks attend to little, late
chunks to much, so each rank gets one of each). Attention runs as flex attention: queries stay
local, keys and values are all-gathered, and a block mask maps local and gathered indices back
to global positions (causal, packed documents). Labels are pre-shifted by the data pipeline, so
they are split exactly like the inputs. ``fsdp2`` is required: it reduces gradients over
``dp_shard x cp``, the ranks that see different tokens (``cp`` declares that it splits the
sequence). Importing this package does not import torch.
"""

from __future__ import annotations

from posttune import hookimpl
from posttune.plugin import ConfigError, MeshDim, ModelTarget, ParallelPlan, RunConfig, Session

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

ORDER = 20  # after tp (10), before activation checkpointing (50) and fsdp2 (100)
#: between dp_shard (10) and tp (30); its ranks hold different positions of the same rows
MESH_DIM = MeshDim("cp", order=20, splits="sequence")


def apply(session: Session, target: ModelTarget) -> None:
    from posttune_cp.shard import install

    install(session, target)


def validate(config: RunConfig) -> None:
    if config.parallel.dims.get("cp", 1) <= 1:
        return
    device = config.train.device
    if device == "cpu" or (device == "auto" and not _cuda_available()):
        raise ConfigError("parallel.plans", "cp trains on GPUs only: torch has no CPU backward for flex "
                                            "attention; remove cp or run on CUDA devices")
    from posttune.plugin import model_kwargs

    if config.train.sample_prompts:
        raise ConfigError("train.sample_prompts", "cp cannot generate yet (one token at a time, split over the "
                                                  "sequence); drop the sample prompts (or cp)")
    kwargs = model_kwargs(config)
    if kwargs.get("sliding_window"):
        raise ConfigError("parallel.plans", "cp does not support sliding-window attention yet; remove cp")
    grows = growing_rope(kwargs, config.data.max_seq_len)
    if grows:
        raise ConfigError("parallel.plans", f"cp does not support {grows}: each rank holds part of a sequence and "
                                            "would choose its own frequencies; lower data.max_seq_len to that length, "
                                            "or remove cp")


#: RoPE variants whose frequencies follow a forward's longest position (posttune.modules.rope.GROWING)
GROWING_ROPE = ("dynamic", "longrope")


def growing_rope(kwargs: dict, max_seq_len: int) -> str | None:
    """The model's RoPE scaling (any of its build kwargs that is a RoPE mapping) when its frequencies change
    within ``max_seq_len`` positions: dynamic NTK past ``max_position_embeddings``, LongRoPE past its
    ``original_max_position_embeddings``; else None."""
    for value in kwargs.values():
        kind = value.get("rope_type") if isinstance(value, dict) else None
        if kind in GROWING_ROPE:
            after = (value.get("original_max_position_embeddings") if kind == "longrope" else None) or kwargs.get(
                "max_position_embeddings")
            if after is None or max_seq_len > after:
                return f"{kind} RoPE scaling past {after} positions (data.max_seq_len is {max_seq_len})"
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


PLAN = ParallelPlan(
    name="cp",
    apply=apply,
    mesh_dim=MESH_DIM,
    order=ORDER,
    requires=("fsdp2",),
    validate=validate,
    description="context parallelism: split sequences over cp (load-balanced), flex attention (GPU)",
    frozen="refuse",  # a frozen role's forward inside the sharded step is not wired (GPU-only, untested)
)


@hookimpl
def posttune_register_parallel_plans(register):
    register(PLAN)
