"""The public plugin surface: everything a posttune plugin may use from the core, in one module.

    from posttune.plugin import Method, LossOutput, hookimpl, build_loader, token_logps

A plugin (first-party or third-party) imports from here, from ``posttune.modules`` (model
building blocks) and, in its tests, from ``posttune.testing``; nothing else in the core is
public, and a test keeps the first-party plugins to that rule. docs/plugins.md documents each
name by group; docs/architecture.md shows where each is used in a run.

Names that need torch are imported on first use, so a plugin's ``__init__`` can import
descriptors and ``hookimpl`` from here and `posttune plugins` stays fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from posttune.config.bundled import configs_in
from posttune.config.data_checks import first_jsonl_row
from posttune.config.requires import device_for, require_cuda
from posttune.config.mixture import dataset_sources
from posttune.config.schema import DatasetConfig, RunConfig
from posttune.config.typed import from_dict
from posttune.checkpoint.peft_config import ADAPTER_CONFIG, read_adapter_config, warn_of_other_base
from posttune.cli.options import check_causal, dtype_argument
from posttune.descriptors import (
    DECODER_LINEAR_LAYERS,
    DECODER_TP_PLAN,
    AdapterKind,
    BundledConfig,
    CheckpointConverter,
    Command,
    DatasetFormat,
    EnginePolicy,
    GenerationEngine,
    LossOutput,
    MemoryTechnique,
    MeshDim,
    Method,
    MetricLogger,
    ModelFamily,
    ModelRole,
    ParallelPlan,
    QuantizedFormat,
    RewardFunction,
    TrackerRun,
)
from posttune.engines import complete, resolve_engine, start_engine
from posttune.errors import ConfigError, PosttuneError, did_you_mean, first_line
from posttune.estimate import Estimate, heap_bytes, layer_bytes_per_token, logits_bytes, unique_parameters
from posttune.plan import model_kwargs
from posttune.plugins import hookimpl
from posttune.session import LossKernel, ModelTarget, Session
from posttune.tracking import flat_config, scalar_metrics

#: name -> the core module it lives in, imported when the name is first used (these need torch)
_LAZY: dict[str, str] = {
    # data toolkit: rows -> samples -> batches, resumable and sharded (docs/architecture.md, "Data")
    **dict.fromkeys([
        "IGNORE_INDEX", "BatchLoader", "PairMaker", "PreferencePair", "PromptRow", "SampleMaker", "as_messages",
        "build_loader", "dataset_format", "make_loader", "pad_id", "packed_batch", "padded_batch", "flat_batch",
        "pair_batch", "pair_loader", "pair_tokens", "prompt_loader", "rows_as_documents", "documents_as_rows",
        "shuffled",
    ], "posttune.data"),
    "row_tools": "posttune.chat_messages",  # a row's `tools` (a list of definitions or its JSON string), checked
    "RENDER_VARIABLES": "posttune.chat_template",  # what a render sets itself: no chat_template_kwargs may
    # losses that honour the loss-stage technique (chunked) and final-logit soft-caps
    **dict.fromkeys(["token_cross_entropy", "token_logps", "sequence_logps", "labelled_logits", "in_label_shape"],
                    "posttune.losses"),
    # what every generation engine shares: settings and their ranges, the result, the context, the seeding
    **dict.fromkeys(["Completions", "Sampling", "SamplingError", "check_new_tokens", "check_sampling",
                     "context_length", "derive_seed", "seed_tensor", "uniform_noise"], "posttune.generation"),
    # models, checkpoints, tokenizers
    **dict.fromkeys(["load_model", "save_model", "build_model", "load_tokenizer"], "posttune.api"),
    "check_fits": "posttune.tokenizer",  # a tokenizer's ids within a model's embedding rows, or one line
    "save_tiny_tokenizer": "posttune.tiny_tokenizer",  # a real tokenizer of 384 ids, for demos and tests
    "LayeredKeyMap": "posttune.checkpoint.keymap",
    "Join": "posttune.checkpoint.convert",
    # the Hugging Face names and config.json fields of posttune.modules' decoder, for Llama-like families
    **dict.fromkeys(["ExpertKeys", "decoder_hf_config", "decoder_keys", "decoder_kwargs"],
                    "posttune.checkpoint.hf_decoder"),
    # a score model's value per row, as transformers pools, the pad id a loaded one pools by, and its head's
    # native and Hugging Face names (an adapter's folder saves a score head whole beside the adapter)
    **dict.fromkeys(["HF_SCORE", "SCORE_HEAD", "score_labels", "score_pad_id", "sequence_scores"],
                    "posttune.checkpoint.score_head"),
    # safetensors files streamed one tensor at a time, each checked against the header
    **dict.fromkeys(["Planned", "iter_tensors", "write_file"], "posttune.checkpoint.safetensors_io"),
    "pairs": "posttune.checkpoint.convert",  # a converter's answer as (key or Join, tensor) pairs
    "hf_tensors": "posttune.checkpoint.hf_save",  # a native state dict under HF names, for an engine's copy
    **dict.fromkeys(["copy_into", "tie_groups"], "posttune.checkpoint.materialize"),
    # adapters: the layer protocol an adapter kind implements, and what the core does with any kind
    **dict.fromkeys(["AdaptedLinear", "adapter_base", "adapted_modules", "apply_adapters", "load_adapter",
                     "merge_adapters", "plain_state_dict", "save_adapter", "tokenizer_source"], "posttune.adapters"),
    # each linear layer's Hugging Face module name (and the joins of fused ones), through the family's converter
    **dict.fromkeys(["Fused", "family_io", "hf_modules"], "posttune.checkpoint.module_names"),
    # optimisation and heads: the head's effective (weight, bias), an adapter folded in, for chunked losses
    "build_scheduler": "posttune.training.optim",
    "head_weight": "posttune.adapters",
    "train_briefly": "posttune.training.warm_start",
    # distributed helpers (one process: the same calls, no communication)
    **dict.fromkeys([
        "all_reduce_max", "all_reduce_sum", "data_rank", "full_value", "is_dtensor", "padded_sequence",
        "paired_shards", "splits_sequence", "step_context", "sum_over_token_ranks", "to_device", "token_group",
        "token_mesh", "world_size",
    ], "posttune.training.distributed"),
}

__all__ = [
    "ADAPTER_CONFIG", "DECODER_LINEAR_LAYERS", "DECODER_TP_PLAN", "AdapterKind", "BundledConfig", "CheckpointConverter",
    "Command", "ConfigError", "DatasetConfig", "DatasetFormat", "EnginePolicy", "Estimate", "GenerationEngine",
    "LossKernel", "LossOutput", "MemoryTechnique", "MeshDim", "Method", "MetricLogger", "ModelFamily",
    "ModelRole", "ModelTarget", "ParallelPlan", "PosttuneError", "QuantizedFormat", "RewardFunction", "RunConfig",
    "Session", "TrackerRun", "check_causal", "complete", "configs_in", "dataset_sources", "device_for", "did_you_mean",
    "dtype_argument", "first_jsonl_row", "first_line", "flat_config", "from_dict", "heap_bytes",
    "hookimpl", "layer_bytes_per_token", "logits_bytes", "lookup", "model_kwargs", "provenance", "read_adapter_config",
    "registered",
    "registering", "require_cuda", "resolve_engine", "scalar_metrics", "start_engine", "unique_parameters",
    "warn_of_other_base",
    *sorted(_LAZY),
]


def lookup(kind: str, name: str) -> Any:
    """The descriptor an installed plugin registered as ``name`` (kinds: ``model_family``, ``method``,
    ``parallel_plan``, ``memory_technique``, ``dataset_format``, ``reward_function``, ``metric_logger``,
    ``config``, ``command``, ``checkpoint_converter``, ``quantized_format``, ``generation_engine``,
    ``adapter_kind``); an
    unknown name raises a one-line PosttuneError."""
    from posttune.plugins import get_registry

    return get_registry().get(kind, name)


def provenance(kind: str, name: str) -> str:
    """Who registered ``name``: ``"distribution version"`` (for messages); unknown names raise as ``lookup``."""
    from posttune.plugins import get_registry

    return str(get_registry().lookup(kind, name).provenance)


def registered(kind: str) -> list[str]:
    """The names registered for ``kind`` by the installed plugins, sorted."""
    from posttune.plugins import get_registry

    return get_registry().names(kind)


def registering(descriptors: Iterable[Any] | Callable[[], Iterable[Any]]) -> Callable[[Any], None]:
    """A registration hook that registers each of ``descriptors`` (or of what calling it returns, when
    the hook runs), for a plugin module to bind under the hook's name, so that every distribution
    does not repeat the same loop: ``posttune_register_model_families = registering(FAMILIES)``."""
    @hookimpl
    def register_each(register: Any) -> None:
        for descriptor in descriptors() if callable(descriptors) else descriptors:
            register(descriptor)

    return register_each


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'posttune.plugin' has no attribute '{name}'")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
