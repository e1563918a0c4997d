"""posttune-qwen: the ``qwen2`` and ``qwen3`` model families and their HF checkpoint converters.

Tensors keep Llama's names (``posttune.plugin.decoder_keys``) and pass unchanged (q/k are stored
in the rotate-half RoPE layout posttune keeps); Qwen3 adds per-head ``q_norm``/``k_norm``, which
the Qwen2 map refuses, so a checkpoint read as the wrong family fails on its first foreign tensor.
Importing this package does not import torch: the builders are imported on their first call.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from posttune.plugin import (DECODER_LINEAR_LAYERS, CheckpointConverter, ModelFamily, configs_in, decoder_keys,
                             registering)
from posttune_qwen import config
from posttune_qwen.sizes import QWEN2_SIZES, QWEN3_SIZES
from posttune_qwen.tp_plan import TP_PLAN

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"
LORA_TARGETS = DECODER_LINEAR_LAYERS  # every linear layer of every block
CONFIGS = Path(__file__).parent / "configs"
QK_NORMS = {"self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}


def _builder(name: str) -> Any:
    """``posttune_qwen.model.build_<name>``, imported on its first call."""
    def build(**kwargs: Any) -> Any:
        from posttune_qwen import model

        return getattr(model, f"build_{name}")(**kwargs)

    return build


def _qwen(name: str, sizes: Any, description: str) -> tuple[ModelFamily, CheckpointConverter]:
    keys = decoder_keys(name, QK_NORMS if name == "qwen3" else None)
    family = ModelFamily(name=name, architectures=(config.ARCHITECTURES[name],), build=_builder(name),
                         from_hf_config=partial(config.from_hf_config, family=name),
                         to_hf_config=partial(config.to_hf_config, family=name), sizes=sizes, tp_plan=TP_PLAN,
                         lora_targets=LORA_TARGETS, description=description)
    return family, CheckpointConverter(family=name, format="hf", to_native=keys.to_native,
                                       from_native=keys.from_native,
                                       description=f"Hugging Face {name} safetensors names "
                                                   "(no RoPE permutation needed)")


QWEN2, QWEN2_HF = _qwen("qwen2", QWEN2_SIZES, "Qwen2, Qwen2.5 (Qwen2ForCausalLM: q/k/v bias, optional sliding window)")
QWEN3, QWEN3_HF = _qwen("qwen3", QWEN3_SIZES, "Qwen3 dense (Qwen3ForCausalLM: per-head q/k RMSNorm)")
CONVERTERS = (QWEN2_HF, QWEN3_HF)

posttune_register_model_families = registering((QWEN2, QWEN3))
posttune_register_checkpoint_converters = registering(CONVERTERS)
posttune_register_configs = registering(partial(configs_in, CONFIGS))  # configs/*.yaml, by file name
