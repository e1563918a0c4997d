"""posttune-template: the example third-party plugin.

The module the entry point names is the plugin: it declares the plugin API it targets and
implements registration hooks. Keep imports light here: every `posttune` command imports this
module, so torch is imported only when a model is built or a loss computed (see model.py and
method.py), and `posttune plugins` stays fast.
"""

from __future__ import annotations

from pathlib import Path

from posttune import hookimpl
from posttune.plugin import BundledConfig, CheckpointConverter, Method, ModelFamily

from posttune_template import method, model, preference  # none imports torch at import time

POSTTUNE_PLUGIN_API = 2

CONFIGS = Path(__file__).parent / "configs"


@hookimpl
def posttune_register_model_families(register):
    register(ModelFamily(
        name="bigram",
        architectures=("PosttuneBigramForCausalLM",),
        from_hf_config=model.from_hf_config,
        build=model.build,
        to_hf_config=model.to_hf_config,
        sizes={"tiny": {"vocab_size": 64, "hidden_size": 16}},
        lora_targets=("proj",),
        description="toy bigram language model (example plugin)",
    ))


@hookimpl
def posttune_register_checkpoint_converters(register):
    # The bigram's checkpoint keys are its module names (``embed.weight``, ``proj.weight``): the
    # identity both ways. A real family maps HF names here (see posttune-llama's hf.py).
    register(CheckpointConverter("bigram", "hf", to_native=model.same_key, from_native=model.same_key,
                                 description="bigram tensors under their own names"))


@hookimpl
def posttune_register_methods(register):
    register(Method(
        name="toy_lm",
        config=method.ToyLMConfig,
        dataset_kind="conversation",
        data=method.data,
        loss=method.loss,
        description="next-token cross-entropy on labelled tokens (example plugin)",
    ))
    register(Method(
        name="toy_rank",
        config=preference.ToyRankConfig,
        dataset_kind="preference",
        data=preference.data,
        loss=preference.loss,
        setup=preference.setup,
        on_step_end=preference.on_step_end,
        state_dict=preference.state_dict,
        load_state_dict=preference.load_state_dict,
        validate=preference.validate,
        description="reference-free ranking of chosen over rejected responses (example plugin)",
    ))


@hookimpl
def posttune_register_configs(register):
    register(BundledConfig("template-bigram", CONFIGS / "template-bigram.yaml",
                           "toy bigram model trained with toy_lm on a chat dataset"))
