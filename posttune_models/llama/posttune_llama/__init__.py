"""posttune-llama: the ``llama``, ``mistral``, ``mixtral`` and ``smollm3`` model families and their HF
checkpoint converters.

SmolLM2 checkpoints are ``LlamaForCausalLM`` and load as ``llama``. SmolLM3 is its own family here
(not its own distribution): the same tensors, builder and TP plan as Llama, plus one build kwarg
(``no_rope_layers``: its NoPE layers), so a separate package would hold nothing but a name.

All four read and write Llama's own names (``posttune.plugin.decoder_keys``): HF stores q/k in the
rotate-half RoPE layout posttune keeps, so tensors pass unchanged; a tied checkpoint's missing
``lm_head.weight`` is the embedding. Mixtral's feed-forwards are mixtures of experts: each layer's
router (``block_sparse_moe.gate``) becomes ``mlp.router``, and its per-expert HF tensors
(``block_sparse_moe.experts.E.w1``/``w3``/``w2``: gate, up, down) stack into one parameter per
projection on load and split back on save (``posttune.plugin.ExpertKeys``). torch is imported only
when a family's ``build`` is first called.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from posttune.plugin import (DECODER_LINEAR_LAYERS, CheckpointConverter, ExpertKeys, ModelFamily, configs_in,
                             decoder_keys, registering)
from posttune_llama import config
from posttune_llama.model import build, build_mixtral
from posttune_llama.sizes import LLAMA_SIZES, MISTRAL_SIZES, MIXTRAL_SIZES, SMOLLM3_SIZES
from posttune_llama.tp_plan import MOE_TP_PLAN, TP_PLAN

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"
LORA_TARGETS = DECODER_LINEAR_LAYERS  # every linear layer of every block
#: Mixtral: the attention projections; the stacked experts are parameters, not linear layers, and are
#: trained in full or frozen, and the router is left as it is
MOE_LORA_TARGETS = tuple(target for target in DECODER_LINEAR_LAYERS if ".attn." in target)
CONFIGS = Path(__file__).parent / "configs"


def _family(name: str, sizes: Any, description: str, *, builder: Any = build, tp_plan: dict[str, str] = TP_PLAN,
            lora_targets: tuple[str, ...] = LORA_TARGETS) -> ModelFamily:
    return ModelFamily(name=name, architectures=(config.ARCHITECTURES[name],), build=builder,
                       from_hf_config=partial(config.from_hf_config, family=name),
                       to_hf_config=partial(config.to_hf_config, family=name), sizes=sizes, tp_plan=tp_plan,
                       lora_targets=lora_targets, description=description)


def _converter(name: str, keys: Any, what: str) -> CheckpointConverter:
    return CheckpointConverter(family=name, format="hf", to_native=keys.to_native, from_native=keys.from_native,
                               description=f"Hugging Face {name} safetensors names ({what})")


LLAMA = _family("llama", LLAMA_SIZES, "Llama 2, 3, 3.1, 3.2, 3.3 and SmolLM2 (LlamaForCausalLM)")
MISTRAL = _family("mistral", MISTRAL_SIZES, "Mistral 7B (MistralForCausalLM, sliding-window attention)")
MIXTRAL = _family("mixtral", MIXTRAL_SIZES, "Mixtral 8x7B, 8x22B (MixtralForCausalLM: Mistral's attention, "
                  "2 of 8 experts per token in every layer)", builder=build_mixtral, tp_plan=MOE_TP_PLAN,
                  lora_targets=MOE_LORA_TARGETS)
SMOLLM3 = _family("smollm3", SMOLLM3_SIZES, "SmolLM3 (SmolLM3ForCausalLM: Llama with no RoPE in every fourth layer)")
#: one name map for llama, mistral and smollm3 (an unknown tensor's error names the checkpoint's model_type)
KEYS = decoder_keys("llama")
MIXTRAL_KEYS = ExpertKeys(decoder_keys("mixtral", {"block_sparse_moe.gate": "mlp.router"}),
                          count_fields=("num_local_experts",), block="block_sparse_moe",
                          names={"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
CONVERTERS = (*(_converter(name, KEYS, "no RoPE permutation needed") for name in ("llama", "mistral", "smollm3")),
              _converter("mixtral", MIXTRAL_KEYS, "per-expert w1/w3/w2 stacked"))

posttune_register_model_families = registering((LLAMA, MISTRAL, MIXTRAL, SMOLLM3))
posttune_register_checkpoint_converters = registering(CONVERTERS)
posttune_register_configs = registering(partial(configs_in, CONFIGS))  # configs/*.yaml, by file name
