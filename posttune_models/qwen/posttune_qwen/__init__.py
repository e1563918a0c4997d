"""posttune-qwen: the ``qwen2`` and ``qwen3`` model families and their HF checkpoint converters.

Importing this package does not import torch (``posttune plugins`` stays fast); the model is
built from core blocks only when ``build`` is called.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from posttune import hookimpl
from posttune.plugin import configs_in
from posttune.plugin import DECODER_LINEAR_LAYERS, CheckpointConverter, ModelFamily
from posttune_qwen import config, hf
from posttune_qwen.sizes import QWEN2_SIZES, QWEN3_SIZES
from posttune_qwen.tp_plan import TP_PLAN

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

#: Default adapter targets: every linear layer of every block.
LORA_TARGETS = DECODER_LINEAR_LAYERS


def build_qwen2(**kwargs: Any) -> Any:
    """``posttune_qwen.model.build_qwen2``, imported on first use."""
    from posttune_qwen.model import build_qwen2 as build

    return build(**kwargs)


def build_qwen3(**kwargs: Any) -> Any:
    """``posttune_qwen.model.build_qwen3``, imported on first use."""
    from posttune_qwen.model import build_qwen3 as build

    return build(**kwargs)


QWEN2 = ModelFamily(
    name="qwen2", architectures=("Qwen2ForCausalLM",),
    from_hf_config=partial(config.from_hf_config, family="qwen2"), build=build_qwen2,
    to_hf_config=partial(config.to_hf_config, family="qwen2"), sizes=QWEN2_SIZES, tp_plan=TP_PLAN,
    lora_targets=LORA_TARGETS, description="Qwen2, Qwen2.5 (Qwen2ForCausalLM: q/k/v bias, optional sliding window)",
)
QWEN3 = ModelFamily(
    name="qwen3", architectures=("Qwen3ForCausalLM",),
    from_hf_config=partial(config.from_hf_config, family="qwen3"), build=build_qwen3,
    to_hf_config=partial(config.to_hf_config, family="qwen3"), sizes=QWEN3_SIZES, tp_plan=TP_PLAN,
    lora_targets=LORA_TARGETS, description="Qwen3 dense (Qwen3ForCausalLM: per-head q/k RMSNorm)",
)
CONVERTERS = tuple(
    CheckpointConverter(family=name, format="hf", to_native=to_native, from_native=from_native,
                        description=f"Hugging Face {name} safetensors names (no RoPE permutation needed)")
    for name in ("qwen2", "qwen3")
    for to_native, from_native in [hf.converters(name)]
)


@hookimpl
def posttune_register_model_families(register):
    register(QWEN2)
    register(QWEN3)


@hookimpl
def posttune_register_checkpoint_converters(register):
    for converter in CONVERTERS:
        register(converter)


CONFIGS = Path(__file__).parent / "configs"


@hookimpl
def posttune_register_configs(register):
    """Every YAML in configs/, named by its file name; the description is its `description:` line."""
    for bundled in configs_in(CONFIGS):
        register(bundled)
