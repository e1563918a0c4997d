"""posttune-phi3: the ``phi3`` model family (Phi-3, Phi-3.5, Phi-4, Phi-4-mini) and its HF checkpoint converter.

transformers' ``Phi3ForCausalLM`` fuses each layer's query/key/value projection into one
``qkv_proj`` and the MLP's gate and up projections into one ``gate_up_proj``. Natively they stay
separate modules (``attn.{q,k,v}_proj``, ``mlp.{gate,up}_proj``), so the tensor-parallel plan,
LoRA targets and every technique treat Phi-3 as they treat Llama; the converter splits the fused
tensors on load and joins them on save (``posttune_phi3.keys``). A LoRA adapter on the separate
projections is written to PEFT as one fused adapter (docs/models.md, "Fused projections").
Importing this package does not import torch.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from posttune.plugin import (DECODER_LINEAR_LAYERS, DECODER_TP_PLAN, CheckpointConverter, ModelFamily, configs_in,
                             registering)
from posttune_phi3 import config
from posttune_phi3.keys import FusedKeys
from posttune_phi3.sizes import PHI3_SIZES

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"
CONFIGS = Path(__file__).parent / "configs"


def build(**kwargs: Any) -> Any:
    """``posttune_phi3.model.build``, imported (with torch) on the first call."""
    from posttune_phi3 import model

    return model.build(**kwargs)


PHI3 = ModelFamily(name="phi3", architectures=(config.ARCHITECTURE,), build=build,
                   from_hf_config=config.from_hf_config, to_hf_config=config.to_hf_config, sizes=PHI3_SIZES,
                   tp_plan=dict(DECODER_TP_PLAN), lora_targets=DECODER_LINEAR_LAYERS,
                   description="Phi-3, Phi-3.5, Phi-4, Phi-4-mini (Phi3ForCausalLM: fused qkv/gate_up, "
                               "partial rotary, LongRoPE)")
KEYS = FusedKeys()
PHI3_HF = CheckpointConverter(family="phi3", format="hf", to_native=KEYS.to_native, from_native=KEYS.from_native,
                              description="Hugging Face phi3 safetensors names (qkv_proj and gate_up_proj "
                                          "split on load, joined on save)")

posttune_register_model_families = registering((PHI3,))
posttune_register_checkpoint_converters = registering((PHI3_HF,))
posttune_register_configs = registering(partial(configs_in, CONFIGS))  # configs/*.yaml, by file name
