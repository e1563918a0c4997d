"""posttune-llama: the ``llama`` and ``mistral`` model families and their HF checkpoint converters.

Both read and write Llama's own names (``posttune.plugin.decoder_keys``): HF stores q/k in the
rotate-half RoPE layout posttune keeps, so tensors pass unchanged; a tied checkpoint's missing
``lm_head.weight`` is the embedding. torch is imported only when ``build`` is first called.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from posttune.plugin import (DECODER_LINEAR_LAYERS, CheckpointConverter, ModelFamily, configs_in, decoder_keys,
                             registering)
from posttune_llama import config
from posttune_llama.model import build
from posttune_llama.sizes import LLAMA_SIZES, MISTRAL_SIZES
from posttune_llama.tp_plan import TP_PLAN

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"
LORA_TARGETS = DECODER_LINEAR_LAYERS  # every linear layer of every block
CONFIGS = Path(__file__).parent / "configs"


def _family(name: str, sizes: Any, description: str) -> ModelFamily:
    return ModelFamily(name=name, architectures=(config.ARCHITECTURES[name],), build=build,
                       from_hf_config=partial(config.from_hf_config, family=name),
                       to_hf_config=partial(config.to_hf_config, family=name), sizes=sizes, tp_plan=TP_PLAN,
                       lora_targets=LORA_TARGETS, description=description)


LLAMA = _family("llama", LLAMA_SIZES, "Llama 2, 3, 3.1, 3.2, 3.3 (LlamaForCausalLM)")
MISTRAL = _family("mistral", MISTRAL_SIZES, "Mistral 7B (MistralForCausalLM, sliding-window attention)")
#: one name map for both (an unknown tensor's error names the checkpoint's model_type)
KEYS = decoder_keys("llama")
CONVERTERS = tuple(CheckpointConverter(family=name, format="hf", to_native=KEYS.to_native,
                                       from_native=KEYS.from_native,
                                       description=f"Hugging Face {name} safetensors names "
                                                   "(no RoPE permutation needed)")
                   for name in ("llama", "mistral"))

posttune_register_model_families = registering((LLAMA, MISTRAL))
posttune_register_checkpoint_converters = registering(CONVERTERS)
posttune_register_configs = registering(partial(configs_in, CONFIGS))  # configs/*.yaml, by file name
