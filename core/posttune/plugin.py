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
from typing import Any

from posttune.checkpoint.hf_config_check import refuse_unbuildable
from posttune.config.bundled import configs_in
from posttune.config.schema import DatasetConfig, RunConfig
from posttune.config.typed import from_dict
from posttune.descriptors import (
    DECODER_LINEAR_LAYERS,
    DECODER_TP_PLAN,
    ROLES,
    STAGES,
    BundledConfig,
    CheckpointConverter,
    Command,
    DatasetFormat,
    LossOutput,
    MemoryTechnique,
    Method,
    MetricLogger,
    ModelFamily,
    ModelRole,
    ParallelPlan,
    QuantizedFormat,
    RewardFunction,
    TrackerRun,
)
from posttune.errors import ConfigError, PosttuneError, did_you_mean, first_line
from posttune.memory import require_cuda
from posttune.plan import model_kwargs
from posttune.plugins import PLUGIN_API, hookimpl
from posttune.session import LossKernel, ModelTarget, Session
from posttune.tracking import flat_config, scalar_metrics

#: name -> the core module it lives in, imported when the name is first used (these need torch)
_LAZY: dict[str, str] = {
    # data toolkit: rows -> samples -> batches, resumable and sharded (docs/architecture.md, "Data")
    **dict.fromkeys([
        "IGNORE_INDEX", "BatchLoader", "PairMaker", "PreferencePair", "PromptMaker", "PromptRow", "PromptSample",
        "Sample", "SampleMaker", "SampleStore", "SkipCounts", "as_messages", "build_loader", "check_columns",
        "dataset_format", "load_rows", "make_loader", "pack", "pad_id", "packed_batch", "padded_batch", "flat_batch",
        "pair_batch", "preference_pair", "prompt_batch", "prompt_loader", "prompt_row", "rename", "shift_labels",
    ], "posttune.data"),
    # losses that honour the loss-stage technique (chunked) and final-logit soft-caps
    **dict.fromkeys(["token_cross_entropy", "token_logps", "sequence_logps"], "posttune.losses"),
    # generation with a KV cache: batched, seeded per row, the same forward count on every rank
    **dict.fromkeys(["Completions", "derive_seed", "filter_logits", "generate", "generate_batch", "next_token"],
                    "posttune.generation"),
    # models, checkpoints, tokenizers
    **dict.fromkeys(["load_model", "save_model", "build_model", "load_tokenizer"], "posttune.api"),
    "LayeredKeyMap": "posttune.checkpoint.keymap",
    "tie_groups": "posttune.checkpoint.materialize",
    # adapters
    **dict.fromkeys(["LoRALinear", "AdaptersOff", "active_model", "adapter_base", "adapters_disabled",
                     "adapted_modules", "load_peft_adapter", "merge_adapters"], "posttune.adapters"),
    # optimisation and heads: the head's effective (weight, bias), LoRA/DoRA folded in, for chunked losses
    "build_scheduler": "posttune.training.optim",
    "head_weight": "posttune.memory.linear_cross_entropy",
    "train_briefly": "posttune.training.warm_start",
    # distributed helpers (one process: the same calls, no communication)
    **dict.fromkeys([
        "TOKEN_DIMS", "all_reduce_max", "all_reduce_sum", "data_rank", "flattened", "full_state_dict", "full_value",
        "is_dtensor", "is_main", "is_sharded", "padded_sequence", "rank", "step_context", "sum_over_token_ranks",
        "to_device", "token_group", "world_size",
    ], "posttune.training.distributed"),
}

__all__ = [
    "DECODER_LINEAR_LAYERS", "DECODER_TP_PLAN", "PLUGIN_API", "ROLES", "STAGES", "BundledConfig",
    "CheckpointConverter", "Command", "ConfigError", "DatasetConfig", "DatasetFormat", "LossKernel", "LossOutput",
    "MemoryTechnique", "Method", "MetricLogger", "ModelFamily", "ModelRole", "ModelTarget", "ParallelPlan",
    "PosttuneError", "QuantizedFormat", "RewardFunction", "RunConfig", "Session", "TrackerRun", "configs_in",
    "did_you_mean", "first_line", "flat_config", "from_dict", "hookimpl", "lookup", "model_kwargs", "provenance",
    "refuse_unbuildable", "registered", "require_cuda", "scalar_metrics", *sorted(_LAZY),
]


def lookup(kind: str, name: str) -> Any:
    """The descriptor an installed plugin registered as ``name`` (kinds: ``model_family``, ``method``,
    ``parallel_plan``, ``memory_technique``, ``dataset_format``, ``reward_function``, ``metric_logger``,
    ``config``, ``command``, ``checkpoint_converter``, ``quantized_format``); an unknown name raises a
    one-line PosttuneError."""
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


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'posttune.plugin' has no attribute '{name}'")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
