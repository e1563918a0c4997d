"""posttune-llama: the ``llama`` and ``mistral`` model families and their HF checkpoint converters.

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
from posttune_llama import config, hf
from posttune_llama.sizes import LLAMA_SIZES, MISTRAL_SIZES
from posttune_llama.tp_plan import TP_PLAN

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

#: Default adapter targets: every linear layer of every block.
LORA_TARGETS = DECODER_LINEAR_LAYERS


def build(**kwargs: Any) -> Any:
    """``posttune_llama.model.build``, imported on first use."""
    from posttune_llama.model import build as build_model

    return build_model(**kwargs)


LLAMA = ModelFamily(
    name="llama", architectures=("LlamaForCausalLM",),
    from_hf_config=partial(config.from_hf_config, family="llama"), build=build,
    to_hf_config=partial(config.to_hf_config, family="llama"), sizes=LLAMA_SIZES, tp_plan=TP_PLAN,
    lora_targets=LORA_TARGETS, description="Llama 2, 3, 3.1, 3.2, 3.3 (LlamaForCausalLM)",
)
MISTRAL = ModelFamily(
    name="mistral", architectures=("MistralForCausalLM",),
    from_hf_config=partial(config.from_hf_config, family="mistral"), build=build,
    to_hf_config=partial(config.to_hf_config, family="mistral"), sizes=MISTRAL_SIZES, tp_plan=TP_PLAN,
    lora_targets=LORA_TARGETS, description="Mistral 7B (MistralForCausalLM, sliding-window attention)",
)
CONVERTERS = tuple(
    CheckpointConverter(family=name, format="hf", to_native=hf.to_native, from_native=hf.from_native,
                        description=f"Hugging Face {name} safetensors names (no RoPE permutation needed)")
    for name in ("llama", "mistral")
)


@hookimpl
def posttune_register_model_families(register):
    register(LLAMA)
    register(MISTRAL)


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
