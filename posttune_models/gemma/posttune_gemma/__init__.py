"""posttune-gemma: the ``gemma``, ``gemma2`` and ``gemma3`` model families and their HF checkpoint converters.

Importing this package does not import torch (``posttune plugins`` stays fast); the model is
built from core blocks only when ``build`` is called.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from posttune.plugin import DECODER_LINEAR_LAYERS, CheckpointConverter, ModelFamily, configs_in, registering
from posttune_gemma import config, hf
from posttune_gemma.model import build
from posttune_gemma.sizes import GEMMA2_SIZES, GEMMA3_SIZES, GEMMA_SIZES
from posttune_gemma.tp_plan import GEMMA2_TP_PLAN, GEMMA3_TP_PLAN, GEMMA_TP_PLAN

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"
LORA_TARGETS = DECODER_LINEAR_LAYERS  # every linear layer of every block
CONFIGS = Path(__file__).parent / "configs"


def _family(name: str, sizes: Any, tp_plan: Any, description: str) -> ModelFamily:
    return ModelFamily(
        name=name, architectures=(config.ARCHITECTURES[name],),
        from_hf_config=partial(config.from_hf_config, family=name), build=build,
        to_hf_config=partial(config.to_hf_config, family=name), sizes=sizes, tp_plan=tp_plan,
        lora_targets=LORA_TARGETS, description=description,
    )


GEMMA = _family("gemma", GEMMA_SIZES, GEMMA_TP_PLAN, "Gemma 2B, 7B (GemmaForCausalLM)")
GEMMA2 = _family("gemma2", GEMMA2_SIZES, GEMMA2_TP_PLAN,
                 "Gemma 2 (Gemma2ForCausalLM: soft-capping, alternating sliding-window layers)")
GEMMA3 = _family("gemma3", GEMMA3_SIZES, GEMMA3_TP_PLAN,
                 "Gemma 3 text (Gemma3ForCausalLM: q/k norms, local and global RoPE)")
FAMILIES = (GEMMA, GEMMA2, GEMMA3)
CONVERTERS = tuple(
    CheckpointConverter(family=family.name, format="hf", to_native=hf.KEYS[family.name].to_native,
                        from_native=hf.KEYS[family.name].from_native,
                        description=f"Hugging Face {family.name} safetensors names (no RoPE permutation needed)")
    for family in FAMILIES
)

posttune_register_model_families = registering(FAMILIES)
posttune_register_checkpoint_converters = registering(CONVERTERS)
posttune_register_configs = registering(partial(configs_in, CONFIGS))  # configs/*.yaml, by file name
