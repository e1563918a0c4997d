"""Adapters: LoRA and DoRA for any registered model family, saved in PEFT's format.

    from posttune.adapters import apply_adapters, init_adapters, save_peft_adapter

    names = apply_adapters(model, targets=family.lora_targets, rank=16, alpha=32, kind="dora")
    ...  # materialise + load base weights when built on the meta device, then:
    init_adapters(model)
    save_peft_adapter(model, "out/adapter")       # peft.PeftModel.from_pretrained loads it
    merge_adapters(model); posttune.save_model(model, "out/merged")

    lora.py         the adapted layer (LoRALinear), its math and its state-dict names
    inject.py       apply / init / merge / disable adapters by module-name pattern
    peft_format.py  adapter_config.json + adapter_model.safetensors, both ways
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
from posttune.adapters.lora import LoRALinear, head_weight
from posttune.adapters.peft_format import load_peft_adapter, save_peft_adapter
from posttune.checkpoint.keymap import base_key  # the unwrapped (checkpoint) name of an adapted key
from posttune.checkpoint.peft_config import adapter_base, tokenizer_source

__all__ = [
    "AdaptersOff", "LoRALinear", "adapter_base", "adapted_key", "adapted_modules", "adapter_state_dict",
    "adapters_disabled", "apply_adapters", "base_key", "head_weight", "init_adapters", "load_peft_adapter",
    "merge_adapters", "plain_state_dict", "save_peft_adapter", "tokenizer_source", "trainable_parameters",
]
