"""Built-in memory techniques, registered through the same hook as any plugin (docs/memory.md).

    memory: [activation_checkpointing, chunked_cross_entropy, optimizer_in_backward]
    memory_options: {activation_checkpointing: {every: 2}}

    checkpointing.py          activation_checkpointing: recompute decoder layers in backward
    offloading.py             activation_offloading: saved activations to pinned host memory (CUDA)
    optimizer_in_backward.py  optimizer_in_backward: step and free each gradient as it is produced
    linear_cross_entropy.py   chunked_cross_entropy: the loss without [batch, seq, vocab] logits

Importing this module does not import torch (``posttune plugins`` stays fast): each ``apply``
imports its technique when a run composes. Orders within ``parallelize`` interleave with
parallel plans (TP 10, FSDP2 100): layers are wrapped before FSDP2 shards them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttune.descriptors import MemoryTechnique
from posttune.errors import ConfigError
from posttune.plugins import PLUGIN_API, hookimpl

POSTTUNE_PLUGIN_API = PLUGIN_API

CHECKPOINTING_ORDER = 50  # after TP (10), before FSDP2 (100)
OFFLOADING_ORDER = 60  # wraps the checkpointed layers, still before FSDP2


@dataclass(frozen=True)
class CheckpointingConfig:
    every: int = 1  # checkpoint every k-th decoder layer (1: all of them)


@dataclass(frozen=True)
class ChunkedCrossEntropyConfig:
    chunk_size: int = 1024  # labelled tokens projected to the vocabulary at a time


def _checkpointing(session: Any, target: Any) -> None:
    from posttune.memory.checkpointing import apply

    apply(session, target)


def _offloading(session: Any, target: Any) -> None:
    from posttune.memory.offloading import apply

    apply(session, target)


def _optimizer_in_backward(session: Any, target: Any) -> None:
    from posttune.memory.optimizer_in_backward import apply

    apply(session, target)


def _chunked_cross_entropy(session: Any, target: Any) -> None:
    from posttune.memory.linear_cross_entropy import apply

    apply(session, target)


def validate_checkpointing(config: Any) -> None:
    every = config.memory_options.get("activation_checkpointing", {}).get("every", 1)
    if isinstance(every, int) and every < 1:
        raise ConfigError("memory_options.activation_checkpointing.every", f"expected a positive integer, got {every}")


def validate_offloading(config: Any) -> None:
    require_cuda(config, "activation_offloading", "it moves saved activations to pinned host memory on a CUDA stream")


def validate_optimizer_in_backward(config: Any) -> None:
    train = config.train
    if train.grad_accum_steps != 1:
        raise ConfigError("train.grad_accum_steps", f"optimizer_in_backward steps each parameter during backward, "
                                                    f"so gradients cannot accumulate; set it to 1 (got "
                                                    f"{train.grad_accum_steps})")
    if train.max_grad_norm is not None:
        raise ConfigError("train.max_grad_norm", "must be null with optimizer_in_backward: a parameter is stepped "
                                                 "before the global gradient norm is known")


def validate_chunked_cross_entropy(config: Any) -> None:
    size = config.memory_options.get("chunked_cross_entropy", {}).get("chunk_size", 1)
    if isinstance(size, int) and size < 1:
        raise ConfigError("memory_options.chunked_cross_entropy.chunk_size", f"expected a positive integer, got {size}")


def require_cuda(config: Any, technique: str, why: str) -> None:
    """Refuse a CUDA-only technique before launch when the run will not have a CUDA device."""
    device = config.train.device
    if device == "auto":
        import torch

        cuda = torch.cuda.is_available()
    else:
        cuda = device.startswith("cuda")
    if not cuda:
        shown = "no CUDA device is available" if device == "auto" else f"train.device is '{device}'"
        raise ConfigError("memory", f"'{technique}' needs a CUDA device ({why}); {shown}")


TECHNIQUES = (
    MemoryTechnique(
        name="activation_checkpointing", stage="parallelize", apply=_checkpointing, order=CHECKPOINTING_ORDER,
        saves="activations inside decoder layers: kept only at layer boundaries, recomputed in backward",
        validate=validate_checkpointing, config=CheckpointingConfig,
        description="recompute decoder layers in backward (all, or every k-th: memory_options.every)",
    ),
    MemoryTechnique(
        name="activation_offloading", stage="parallelize", apply=_offloading, order=OFFLOADING_ORDER,
        requires=("activation_checkpointing",),
        saves="the layer-boundary activations checkpointing keeps: moved to pinned host memory",
        validate=validate_offloading,
        description="saved activations to pinned CPU memory on a side CUDA stream (CUDA only; the head exempt)",
    ),
    MemoryTechnique(
        name="optimizer_in_backward", stage="optimizer", apply=_optimizer_in_backward,
        saves="the gradients: each is applied and freed as soon as backward produces it",
        validate=validate_optimizer_in_backward,
        description="one optimizer per parameter, stepped from its gradient hook (no accumulation, no clipping)",
    ),
    MemoryTechnique(
        name="chunked_cross_entropy", stage="loss", apply=_chunked_cross_entropy,
        conflicts=("loss_parallel",),
        saves="the [batch, seq, vocab] logits and their gradient: only one chunk of labelled tokens at a time",
        validate=validate_chunked_cross_entropy, config=ChunkedCrossEntropyConfig,
        description="linear cross-entropy: drop ignored tokens, project to the vocabulary chunk by chunk",
    ),
)


@hookimpl
def posttune_register_memory_techniques(register):
    for technique in TECHNIQUES:
        register(technique)
