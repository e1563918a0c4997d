"""posttune-tp: the ``tp`` parallel plan (``torch.distributed.tensor.parallel``).

The model family says how its modules split (``ModelFamily.tp_plan``: module-name pattern ->
``colwise`` / ``rowwise`` / ``sequence_parallel``); ``styles.py`` turns that into PyTorch's
parallel styles and applies them over the ``tp`` mesh dimension. Importing this package does
not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttune import hookimpl
from posttune.plugin import ConfigError, MeshDim, ModelTarget, ParallelPlan, RunConfig, Session

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

ORDER = 10  # before activation checkpointing (50) and FSDP2 (100)
#: innermost: the fastest links (within a node); every tp rank sees the same tokens
MESH_DIM = MeshDim("tp", order=30, splits="none")


@dataclass(frozen=True)
class TPOptions:
    """`parallel.options.tp`."""

    #: split the norms and the residual stream over the sequence between blocks (Megatron-LM's layout:
    #: less activation memory). Off, they are replicated, which one-token decoding steps need (generation:
    #: GRPO, on-policy distillation): a single new token cannot be split over the TP ranks.
    sequence_parallel: bool = True
    #: module-name pattern -> style, over the family's tp_plan (loss_parallel sets the head's to
    #: colwise_vocab_sharded: its logits stay split over the vocabulary)
    styles: dict[str, str] = field(default_factory=dict)


def apply(session: Session, target: ModelTarget) -> None:
    from posttune_tp.styles import apply_tp

    apply_tp(session, target)


def validate(config: RunConfig) -> None:
    """Every head count must split evenly over the TP degree, checked before launch."""
    degree = config.parallel.dims.get("tp", 1)
    if degree <= 1:
        return
    from posttune.plugin import model_kwargs

    kwargs = model_kwargs(config)
    heads = kwargs.get("num_heads")
    kv_heads = kwargs.get("num_kv_heads") or heads
    for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count is not None and count % degree:
            raise ConfigError("parallel.dims.tp", f"tp={degree} does not divide the model's {count} {name}; "
                                                  f"choose a tp degree that does")
    if config.adapter is not None and config.adapter.kind == "dora":
        raise ConfigError("adapter.kind", "dora is not supported with tp (its row norms need whole weights); "
                                          "use lora, or fsdp2 alone")
    if config.train.sample_prompts and config.parallel.options.get("tp", {}).get("sequence_parallel", True):
        raise ConfigError("parallel.options.tp.sequence_parallel", "train.sample_prompts are generated one token at "
                                                                   "a time, which sequence parallelism cannot split "
                                                                   "over the TP ranks; set it to false (or drop the "
                                                                   "sample prompts)")
    if config.adapter is not None and config.checkpoint.save_merged:
        raise ConfigError("checkpoint.save_merged", "not supported with tp (the model is sharded): save the "
                                                    "adapter and merge it on one process")


PLAN = ParallelPlan(
    name="tp",
    apply=apply,
    mesh_dim=MESH_DIM,
    order=ORDER,
    validate=validate,
    config=TPOptions,
    description="tensor parallelism: the family's TP plan (colwise/rowwise/sequence parallel) over tp",
)


@hookimpl
def posttune_register_parallel_plans(register):
    register(PLAN)
