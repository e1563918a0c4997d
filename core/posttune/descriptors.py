"""What plugins register: one frozen dataclass per kind of contribution.

Descriptors hold plain data and callables. The core never subclasses them and never looks a
model, method or plan up by anything but its registered name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch is imported lazily so that `posttune plugins` starts fast
    import torch

    from posttune.config.schema import RunConfig

Session = Any  # the composed training session; typed for real by the trainer

#: Composition stages in the order `posttune train` runs them (DESIGN §4). Memory techniques
#: name the stage they act at; within ``parallelize`` they interleave with parallel plans by
#: ``order`` (activation checkpointing must wrap layers before FSDP2 shards them).
STAGES: tuple[str, ...] = (
    "build",  # model on the meta device
    "adapt",  # adapters (LoRA/DoRA) injected
    "quantize",  # frozen weights quantised (QLoRA NF4, QAT fake-quant)
    "parallelize",  # TP / loss-parallel / CP, activation checkpointing, compile, FSDP2
    "load",  # weights materialised and streamed in
    "optimizer",  # optimizer and LR schedule built (optimizer-in-backward, low-bit optimizers)
    "loss",  # the loss computation (chunked cross-entropy)
)
Stage = Literal["build", "adapt", "quantize", "parallelize", "load", "optimizer", "loss"]

#: Dataset kinds: what rows must become for a method to consume them.
DatasetKind = Literal["sft", "preference", "prompt"]

Validator = Callable[["RunConfig"], None]
"""Called before launch with the whole validated config; raises ConfigError to refuse it."""


#: Adapter targets covering every linear layer of the core decoder blocks (fnmatch patterns over
#: native module names): the default QLoRA found necessary to match full fine-tuning. Families
#: assembled from ``posttune.modules`` pass it as ``ModelFamily.lora_targets``.
DECODER_LINEAR_LAYERS: tuple[str, ...] = tuple(
    f"layers.*.{name}" for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
)


#: Tensor-parallel styles for the core decoder blocks (fnmatch patterns over native names), as
#: torchtitan's Llama plan: q/k/v and gate/up split their output features ("colwise"), o/down
#: their input features ("rowwise") so each block needs one reduction; norms run
#: sequence-parallel between blocks; the embedding is split by vocabulary rows and the head by
#: vocabulary columns (which suits tied weights: both split the vocab dim). Families assembled
#: from ``posttune.modules`` pass it (or extend it) as ``ModelFamily.tp_plan``.
DECODER_TP_PLAN: dict[str, str] = {
    "embed": "rowwise",
    "layers.*.attn_norm": "sequence_parallel",
    "layers.*.attn.q_proj": "colwise",
    "layers.*.attn.k_proj": "colwise",
    "layers.*.attn.v_proj": "colwise",
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.mlp_norm": "sequence_parallel",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "norm": "sequence_parallel",
    "output": "colwise",
}


@dataclass(frozen=True)
class ModelFamily:
    """A model architecture: how to read its HF config and build it from core blocks."""

    name: str
    architectures: tuple[str, ...]  # HF `architectures` entries this family reads
    from_hf_config: Callable[[Mapping[str, Any]], dict[str, Any]]  # config.json -> build kwargs
    build: Callable[..., torch.nn.Module]  # build(**kwargs) -> module returning logits
    to_hf_config: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None  # build kwargs -> config.json
    sizes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # named build kwargs
    tp_plan: Mapping[str, str] = field(default_factory=dict)  # module-name pattern -> style
    lora_targets: tuple[str, ...] = ()  # default module-name patterns for adapters
    tokenizer_defaults: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class CheckpointConverter:
    """Maps one family's tensors between a checkpoint format and posttune's native names.

    ``to_native(key, tensor, hf_config)`` returns ``(native_key, tensor)``, or None for a
    tensor the native model does not keep (e.g. cached rotary frequencies);
    ``from_native`` is its inverse.
    """

    family: str
    format: str
    to_native: Callable[[str, torch.Tensor, Mapping[str, Any]], tuple[str, torch.Tensor] | None]
    from_native: Callable[[str, torch.Tensor, Mapping[str, Any]], tuple[str, torch.Tensor]]
    description: str = ""

    @property
    def name(self) -> str:
        return f"{self.family}:{self.format}"


@dataclass(frozen=True)
class LossOutput:
    """What ``Method.loss`` returns: a summed loss, the tokens it covers, and metrics to log.

    The trainer divides by the token count summed over micro-batches and ranks, so a method
    never normalises by itself.
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor | int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """A post-training algorithm. The core owns the loop; the method owns data and loss."""

    name: str
    config: type  # dataclass validated from the config's `method:` section
    dataset_kind: DatasetKind
    setup: Callable[[Session], None]
    batches: Callable[[Session], Iterator[Any]]
    loss: Callable[[Session, Any], LossOutput]
    validate: Validator | None = None
    description: str = ""


@dataclass(frozen=True)
class ParallelPlan:
    """A way to split the model over devices, applied at the ``parallelize`` stage by ``order``."""

    name: str
    apply: Callable[[Session], None]
    mesh_dim: str | None = None  # the DeviceMesh dimension this plan owns, e.g. "tp"
    order: int = 0  # lower runs first: TP/loss-parallel/CP before FSDP2
    requires: tuple[str, ...] = ()  # other plans that must be active
    conflicts: tuple[str, ...] = ()  # plans or memory techniques it cannot run with
    validate: Validator | None = None  # sees ``parallel.dims`` resolved against the world size
    description: str = ""
    config: type | None = None  # dataclass validated from `parallel.options.<name>`; the instance
    #                             is ``session.plan.parallel_options[name]`` when the plan runs


@dataclass(frozen=True)
class MemoryTechnique:
    """A switch that trades compute or precision for memory, applied at one stage."""

    name: str
    stage: Stage
    apply: Callable[[Session], None]
    order: int = 0  # within the stage; compared with ParallelPlan.order in ``parallelize``
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    saves: str = ""  # what memory it saves, shown by `posttune ls memory`
    validate: Validator | None = None
    description: str = ""
    config: type | None = None  # dataclass validated from `memory_options.<name>`; the instance
    #                             is ``session.plan.memory_options[name]`` when the technique runs


@dataclass(frozen=True)
class DatasetFormat:
    """Turns one dataset row into what a method of ``kind`` consumes (e.g. chat messages).

    ``transform`` raises KeyError or ValueError for a bad row; the data pipeline turns that
    into an error naming the row index and the field.
    """

    name: str
    kind: DatasetKind
    transform: Callable[[Mapping[str, Any]], Any]
    columns: tuple[str, ...] = ()  # the fields a row needs, for documentation and errors
    description: str = ""


@dataclass(frozen=True)
class RewardFunction:
    """Scores completions for GRPO: ``fn(prompts, completions, **row_fields) -> list[float]``."""

    name: str
    fn: Callable[..., list[float]]
    description: str = ""


@dataclass(frozen=True)
class BundledConfig:
    """A YAML recipe shipped as package data, listed by `posttune ls configs`."""

    name: str
    path: Path
    description: str = ""


@dataclass(frozen=True)
class Command:
    """An extra `posttune` subcommand. ``run`` returns the exit status."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
