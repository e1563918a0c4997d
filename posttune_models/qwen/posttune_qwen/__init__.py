"""posttune-qwen: the ``qwen2``, ``qwen3``, ``qwen2_moe`` and ``qwen3_moe`` model families and their HF
checkpoint converters.

Tensors keep Llama's names (``posttune.plugin.decoder_keys``) and pass unchanged (q/k are stored
in the rotate-half RoPE layout posttune keeps); Qwen3 adds per-head ``q_norm``/``k_norm``, which
the Qwen2 map refuses, so a checkpoint read as the wrong family fails on its first foreign tensor.
The MoE families stack each layer's per-expert HF tensors into one parameter on load and split them
on save (``posttune.plugin.ExpertKeys``).
Importing this package does not import torch: the builders are imported on their first call.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from posttune.plugin import (DECODER_LINEAR_LAYERS, CheckpointConverter, ExpertKeys, ModelFamily, configs_in,
                             decoder_keys, registering)
from posttune_qwen import config
from posttune_qwen.sizes import QWEN2_MOE_SIZES, QWEN2_SIZES, QWEN3_MOE_SIZES, QWEN3_SIZES
from posttune_qwen.tp_plan import TP_PLANS

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"
LORA_TARGETS = DECODER_LINEAR_LAYERS  # every linear layer of every block
CONFIGS = Path(__file__).parent / "configs"
QK_NORMS = {"self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
#: MoE layers' router and (qwen2_moe) shared expert; dense layers keep Llama's mlp names
MOE_MODULES = {"mlp.gate": "mlp.router", "mlp.shared_expert_gate": "mlp.shared_gate",
               **{f"mlp.shared_expert.{name}": f"mlp.shared_expert.{name}"
                  for name in ("gate_proj", "up_proj", "down_proj")}}
#: LoRA on the attention projections and (qwen2_moe) the shared expert: every default target must
#: match a linear layer, and the stacked experts are parameters, not linear layers (docs/moe.md)
ATTENTION = DECODER_LINEAR_LAYERS[:4]
MOE_LORA_TARGETS = {"qwen3_moe": ATTENTION,
                    "qwen2_moe": (*ATTENTION, *(f"layers.*.mlp.shared_expert.{name}"
                                                for name in ("gate_proj", "up_proj", "down_proj")))}


def _builder(name: str) -> Any:
    """``posttune_qwen.model.build_<name>``, imported on its first call."""
    def build(**kwargs: Any) -> Any:
        from posttune_qwen import model

        return getattr(model, f"build_{name}")(**kwargs)

    return build


def _qwen(name: str, sizes: Any, description: str) -> tuple[ModelFamily, CheckpointConverter]:
    moe = name.endswith("_moe")
    per_layer = {**(QK_NORMS if name.startswith("qwen3") else {}), **(MOE_MODULES if moe else {})}
    keys: Any = decoder_keys(name, per_layer)
    if moe:
        keys = ExpertKeys(keys, count_fields=("num_experts", "num_local_experts"))
    family = ModelFamily(name=name, architectures=(config.ARCHITECTURES[name],), build=_builder(name),
                         from_hf_config=partial(config.from_hf_config, family=name),
                         to_hf_config=partial(config.to_hf_config, family=name), sizes=sizes,
                         tp_plan=TP_PLANS[name], lora_targets=MOE_LORA_TARGETS.get(name, LORA_TARGETS),
                         description=description)
    what = "per-expert tensors stacked" if moe else "no RoPE permutation needed"
    return family, CheckpointConverter(family=name, format="hf", to_native=keys.to_native,
                                       from_native=keys.from_native,
                                       description=f"Hugging Face {name} safetensors names ({what})")


QWEN2, QWEN2_HF = _qwen("qwen2", QWEN2_SIZES, "Qwen2, Qwen2.5 (Qwen2ForCausalLM: q/k/v bias, optional sliding window)")
QWEN3, QWEN3_HF = _qwen("qwen3", QWEN3_SIZES, "Qwen3 dense (Qwen3ForCausalLM: per-head q/k RMSNorm)")
QWEN2_MOE, QWEN2_MOE_HF = _qwen("qwen2_moe", QWEN2_MOE_SIZES,
                                "Qwen1.5-MoE, Qwen2-MoE (Qwen2MoeForCausalLM: top-k experts and a gated shared expert)")
QWEN3_MOE, QWEN3_MOE_HF = _qwen("qwen3_moe", QWEN3_MOE_SIZES,
                                "Qwen3-MoE, e.g. Qwen3-30B-A3B (Qwen3MoeForCausalLM: top-k experts, q/k RMSNorm)")
CONVERTERS = (QWEN2_HF, QWEN3_HF, QWEN2_MOE_HF, QWEN3_MOE_HF)

posttune_register_model_families = registering((QWEN2, QWEN3, QWEN2_MOE, QWEN3_MOE))
posttune_register_checkpoint_converters = registering(CONVERTERS)
posttune_register_configs = registering(partial(configs_in, CONFIGS))  # configs/*.yaml, by file name
