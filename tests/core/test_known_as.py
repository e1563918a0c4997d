"""A key of transformers' TrainingArguments or TRL's configs, written where a user bringing a recipe puts it, is
refused with the key it is here (``KNOWN_AS``), in the run config's sections and in a method's."""

from __future__ import annotations

import pytest

from posttune.config.schema import validate
from posttune.errors import ConfigError
from posttune.plan import resolve_plan
from posttune.plugins import new_plugin_set

RUN = {"model": {"family": "llama", "size": "tiny"}, "method": "sft", "data": {"train": {"path": "train.jsonl"}}}


@pytest.mark.parametrize(("config", "message"), [
    ({"train": {"learning_rate": 1e-4}}, "train.learning_rate: unknown key; learning_rate, as transformers or TRL "
                                         "names it, is train.lr here"),
    ({"per_device_train_batch_size": 4}, "per_device_train_batch_size: unknown key; per_device_train_batch_size, as "
                                         "transformers or TRL names it, is train.batch_size here"),
    ({"checkpoint": {"save_steps": 100}}, "checkpoint.save_steps: unknown key; save_steps, as transformers or TRL "
                                          "names it, is checkpoint.save_every here"),
    ({"train": {"lr_scheduler_type": "cosine"}}, "train.lr_scheduler_type: unknown key; lr_scheduler_type, as "
                                                 "transformers or TRL names it, is train.scheduler (cosine_with_min_lr"),
    ({"train": {"max_step": 4}}, "train.max_step: unknown key (did you mean"),  # other keys: as before
])
def test_a_transformers_key_in_the_run_config_names_its_place_here(config, message):
    with pytest.raises(ConfigError) as info:
        validate({**RUN, **config})
    assert str(info.value).startswith(f"config: {message}"), str(info.value)


@pytest.mark.parametrize(("method", "message"), [
    ({"name": "grpo", "num_generations": 8}, "method.num_generations: unknown key; num_generations, as transformers or "
                                             "TRL names it, is method.group_size here"),
    ({"name": "dpo", "precompute_ref_log_probs": True}, "method.precompute_ref_log_probs: unknown key; "
                                                        "precompute_ref_log_probs, as transformers or TRL names it, "
                                                        "is method.precompute_reference here"),
    ({"name": "sft", "max_seq_length": 512}, "method.max_seq_length: unknown key; max_seq_length, as transformers or "
                                             "TRL names it, is data.max_seq_len here"),
    ({"name": "dpo", "ref_model": "x"}, "method.ref_model: unknown key; ref_model, as transformers or TRL names it, "
                                        "is models.reference here"),
    ({"name": "grpo", "ray_options": {"tis_cap": 3.0}}, "method.ray_options.tis_cap: unknown key; moved: set "
                                                        "method.tis_cap"),
    ({"name": "kd", "lmbda": 0.5}, "method.lmbda: unknown key; lmbda, as transformers or TRL names it, is "
                                   "method.on_policy_fraction here"),
])
def test_a_trl_method_key_names_its_place_here(method, message):
    import posttune_dpo
    import posttune_grpo
    import posttune_kd
    import posttune_llama
    import posttune_sft

    plugins = new_plugin_set()
    for module in (posttune_llama, posttune_sft, posttune_dpo, posttune_grpo, posttune_kd):
        plugins.register(module, distribution=module.__name__.replace("_", "-"), version="0")
    with pytest.raises(ConfigError) as info:
        resolve_plan(validate({**RUN, "method": method}), plugins.registry)
    assert str(info.value).startswith(f"config: {message}"), str(info.value)
