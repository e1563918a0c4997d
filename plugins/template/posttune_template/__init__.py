"""posttune-template: the example third-party plugin.

The module the entry point names is the plugin: it declares the plugin API it targets and
implements registration hooks. Keep imports light here: every `posttune` command imports this
module, so torch is imported only when a model is built or a loss computed (see model.py and
method.py), and `posttune plugins` stays fast.
"""

from __future__ import annotations

from pathlib import Path

from posttune import hookimpl
from posttune.descriptors import BundledConfig, Method, ModelFamily

from posttune_template import method, model  # neither imports torch at import time

POSTTUNE_PLUGIN_API = 1

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
def posttune_register_methods(register):
    register(Method(
        name="toy_lm",
        config=method.ToyLMConfig,
        dataset_kind="sft",
        setup=method.setup,
        batches=method.batches,
        loss=method.loss,
        description="next-token cross-entropy on labelled tokens (example plugin)",
    ))


@hookimpl
def posttune_register_configs(register):
    register(BundledConfig("template-bigram", CONFIGS / "template-bigram.yaml",
                           "toy bigram model trained with toy_lm on a chat dataset"))
