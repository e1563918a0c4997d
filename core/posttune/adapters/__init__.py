"""Adapters, whatever their kind: the layer protocol and what the core does with any adapted model.

    from posttune.adapters import apply_adapters, init_adapters, save_adapter, load_adapter

    names = apply_adapters(model, targets=family.lora_targets, wrap=wrapper(config.adapter))
    ...  # materialise + load base weights when built on the meta device, then:
    init_adapters(model)
    save_adapter(model, "out/adapter")            # the folder the kind writes (LoRA/DoRA: PEFT's format)
    merge_adapters(model); posttune.save_model(model, "out/merged")

    layer.py    AdaptedLinear: the wrapped linear under ``base``, the kind's update, its effective weight
    inject.py   apply / init / merge / disable adapters by module-name pattern
    kinds.py    the registered kinds (``adapter.kind``): wrap, save with the layers' kind, load with the folder's
"""

from __future__ import annotations

from posttune.adapters.inject import (
    AdaptersOff,
    adapted_key,
    adapted_modules,
    adapter_state_dict,
    adapters_disabled,
    apply_adapters,
    init_adapters,
    merge_adapters,
    plain_state_dict,
    trainable_parameters,
)
from posttune.adapters.kinds import adapter_kind, load_adapter, save_adapter, wrapper
from posttune.adapters.layer import AdaptedLinear, head_weight
from posttune.checkpoint.keymap import base_key  # the unwrapped (checkpoint) name of an adapted key
from posttune.checkpoint.peft_config import adapter_base, tokenizer_source

__all__ = [
    "AdaptedLinear", "AdaptersOff", "adapter_base", "adapter_kind", "adapted_key", "adapted_modules",
    "adapter_state_dict", "adapters_disabled", "apply_adapters", "base_key", "head_weight", "init_adapters",
    "load_adapter", "merge_adapters", "plain_state_dict", "save_adapter", "tokenizer_source", "trainable_parameters",
    "wrapper",
]
