"""A key of transformers' TrainingArguments, TRL's, PEFT's, axolotl's or torchtune's configs, written where a user
bringing a recipe puts it, is refused with the key it is here (``KNOWN_AS``), in the run config's sections and in a
method's; so is a run-config key written in the wrong section (``ELSEWHERE``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from posttune.config.schema import validate
from posttune.errors import ConfigError
from posttune.plan import resolve_plan
from posttune.plugins import new_plugin_set

RUN = {"model": {"family": "llama", "size": "tiny"}, "method": "sft", "data": {"train": {"path": "train.jsonl"}}}


@pytest.mark.parametrize(("config", "message"), [
    ({"train": {"learning_rate": 1e-4}}, "train.learning_rate: unknown key; learning_rate is train.lr here"),
    ({"per_device_train_batch_size": 4}, "per_device_train_batch_size: unknown key; per_device_train_batch_size is "
                                         "train.batch_size (a method that generates counts prompts in it, where TRL "
                                         "counts completions: divide by the completions per prompt) here"),
    ({"checkpoint": {"save_steps": 100}},
     "checkpoint.save_steps: unknown key; save_steps is checkpoint.save_every here"),
    ({"train": {"lr_scheduler_type": "cosine"}}, "train.lr_scheduler_type: unknown key; lr_scheduler_type is "
                                                 "train.scheduler (cosine_with_min_lr"),
    ({"train": {"max_step": 4}}, "train.max_step: unknown key (did you mean"),  # other keys: as before
    # a run-config key in the wrong section, or at the top, is named where it belongs
    ({"max_steps": 3}, "max_steps: unknown key; max_steps is train.max_steps here"),
    ({"train": {"max_seq_len": 512}}, "train.max_seq_len: unknown key; max_seq_len is data.max_seq_len here"),
    ({"train": {"save_every": 50}}, "train.save_every: unknown key; save_every is checkpoint.save_every here"),
    # PEFT's and axolotl's keys (before: "did you mean 'rslora'?" for lora_r)
    ({"adapter": {"lora_r": 16}}, "adapter.lora_r: unknown key; lora_r is adapter.rank here"),
    ({"adapter": {"r": 16}}, "adapter.r: unknown key; r is adapter.rank here"),
    ({"adapter": {"use_dora": True}}, "adapter.use_dora: unknown key; use_dora is adapter.kind: dora here"),
    ({"sequence_len": 2048}, "sequence_len: unknown key; sequence_len is data.max_seq_len here"),
    ({"val_set_size": 0.05}, "val_set_size: unknown key; val_set_size is data.validation_split here"),
    # what a first-party plugin provides, with its distribution
    ({"gradient_checkpointing": True}, "gradient_checkpointing: unknown key; gradient_checkpointing is memory: "
                                       "[activation_checkpointing] (posttune-memory) here"),
    # torchtune's recipe keys, at the top, in a section and in a dataset
    ({"checkpointer": {"checkpoint_dir": "x"}}, "checkpointer: unknown key; checkpointer is model.path (its "
                                                "checkpoint_dir: the folder) and checkpoint.output_dir"),
    ({"clip_grad_norm": 1.0}, "clip_grad_norm: unknown key; clip_grad_norm is train.max_grad_norm here"),
    ({"train": {"compile": True}}, "train.compile: unknown key; compile is memory: [compile] (posttune-memory) here"),
    ({"enable_activation_checkpointing": True},
     "enable_activation_checkpointing: unknown key; enable_activation_checkpointing is memory: "
     "[activation_checkpointing]"),
    ({"model": {"path": "x", "lora_rank": 8}}, "model.lora_rank: unknown key; lora_rank is adapter.rank here"),
    ({"model": {"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b"}},
     "model._component_: unknown key; _component_ is model.path (a checkpoint's config.json names its family)"),
    ({"data": {"train": {"path": "x", "data_files": "d.json"}}},
     "data.train.data_files: unknown key; data_files is the dataset's path here"),
    ({"data": {"train": {"path": "x", "packed": True}}}, "data.train.packed: unknown key; packed is method.packing"),
    # a run-config key in a section the core nests (a dataset, a list's entry, a role's model) is still named
    ({"data": {"train": {"path": "x", "max_seq_len": 5}}},
     "data.train.max_seq_len: unknown key; max_seq_len is data.max_seq_len here"),
    ({"data": {"train": [{"path": "x", "lr": 1e-4}]}}, "data.train[0].lr: unknown key; lr is train.lr here"),
    ({"models": {"reference": {"path": "y", "lr": 1e-4}}}, "models.reference.lr: unknown key; lr is train.lr here"),
    ({"data": {"path": "x.jsonl"}}, "data.path: unknown key; path is data.train.path (a dataset: path, format, ...)"),
    ({"data": {"train": {"path": "x", "dataset_text_field": "body"}}},
     "data.train.dataset_text_field: unknown key; dataset_text_field is the dataset's column_map: {text: COLUMN}"),
    # axolotl's dataset entries and top-level keys; a setting with no counterpart says what stands in its place
    ({"data": {"train": {"path": "x", "type": "sharegpt"}}}, "data.train.type: unknown key; type is format (axolotl's "
                                                             "chat_template and sharegpt: chat) here"),
    ({"data": {"train": {"path": "x", "roles_to_train": ["gpt"]}}},
     "data.train.roles_to_train: unknown key; roles_to_train has no counterpart here (assistant turns train; a "
     "turn's weight: 0 mutes one, method.train_on_input trains every turn)"),
    ({"merge_lora": True}, "merge_lora: unknown key; merge_lora is checkpoint.save_merged here"),
    ({"load_in_8bit": True}, "load_in_8bit: unknown key; load_in_8bit has no counterpart here (no 8-bit base "
                             "weights); 4-bit: memory: [qlora_nf4]"),
    ({"checkpoint": {"resume": False}}, "checkpoint.resume: false means a fresh start here: write null"),
    # a value as transformers spells it: resume_from_checkpoint=True
    ({"checkpoint": {"resume": True}}, "checkpoint.resume: true means the newest checkpoint here: write latest (or a "
                                       "checkpoint's path)"),
])
def test_a_transformers_key_in_the_run_config_names_its_place_here(config, message):
    with pytest.raises(ConfigError) as info:
        validate({**RUN, **config})
    assert str(info.value).startswith(f"config: {message}"), str(info.value)


@pytest.mark.parametrize(("method", "message"), [
    ({"name": "grpo", "num_generations": 8}, "method.num_generations: unknown key; num_generations is "
                                             "method.group_size here"),
    ({"name": "dpo", "precompute_ref_log_probs": True}, "method.precompute_ref_log_probs: unknown key; "
                                                        "precompute_ref_log_probs is method.precompute_reference here"),
    ({"name": "sft", "max_seq_length": 512}, "method.max_seq_length: unknown key; max_seq_length is data.max_seq_len "
                                             "here"),
    ({"name": "dpo", "ref_model": "x"}, "method.ref_model: unknown key; ref_model is models.reference here"),
    # TRL's configs hold the training arguments too: written in the method's section, named where they are here
    ({"name": "dpo", "learning_rate": 5e-7}, "method.learning_rate: unknown key; learning_rate is train.lr here"),
    ({"name": "grpo", "max_steps": 10}, "method.max_steps: unknown key; max_steps is train.max_steps here"),
    ({"name": "grpo", "ray_options": {"tis_cap": 3.0}}, "method.ray_options.tis_cap: unknown key; moved: set "
                                                        "method.tis_cap"),
    ({"name": "kd", "lmbda": 0.5}, "method.lmbda: unknown key; lmbda is method.on_policy_fraction here"),
    ({"name": "grpo", "kl_coef": 0.1}, "method.kl_coef: unknown key; kl_coef is method.beta here"),
    ({"name": "ppo", "beta": 0.1}, "method.beta: unknown key; beta is method.kl_coef here"),
    ({"name": "ppo", "value_model_path": "v"}, "method.value_model_path: unknown key; value_model_path is "
                                               "models.value.path here"),
    # TRL's value for a setting posttune splits or names otherwise
    ({"name": "grpo", "loss_aggregation": "dr_grpo"}, "method.loss_aggregation: expected one of 'token', 'sequence', "
                                                      "'constant', got 'dr_grpo'; dr_grpo is constant here"),
    ({"name": "grpo", "baseline": "rloo"}, "method.baseline: expected one of 'mean', 'leave_one_out', got 'rloo'; "
                                           "rloo is leave_one_out here"),
])
def test_a_trl_method_key_names_its_place_here(method, message):
    import posttune_dpo
    import posttune_grpo
    import posttune_kd
    import posttune_llama
    import posttune_ppo
    import posttune_sft

    plugins = new_plugin_set()
    for module in (posttune_llama, posttune_sft, posttune_dpo, posttune_grpo, posttune_kd, posttune_ppo):
        plugins.register(module, distribution=module.__name__.replace("_", "-"), version="0")
    with pytest.raises(ConfigError) as info:
        resolve_plan(validate({**RUN, "method": method}), plugins.registry)
    assert str(info.value).startswith(f"config: {message}"), str(info.value)


def test_axolotls_adapter_qlora_names_what_it_is_here():
    """``adapter: qlora`` (axolotl's) is no adapter kind: the plan's refusal says what it is here."""
    import posttune_llama
    import posttune_lora
    import posttune_sft

    plugins = new_plugin_set()
    for module in (posttune_llama, posttune_sft, posttune_lora):
        plugins.register(module, distribution=module.__name__.replace("_", "-"), version="0")
    with pytest.raises(ConfigError) as info:
        resolve_plan(validate({**RUN, "adapter": "qlora"}), plugins.registry)
    assert str(info.value) == ("config: adapter.kind: no adapter kind 'qlora' is installed (installed: dora, lora); "
                               "qlora is kind: lora with memory: [qlora_nf4] (posttune-torchao) here")


@pytest.mark.parametrize(("value", "read"), [(True, "group"), (False, "none"), ("batch", "batch")])
def test_grpo_reads_trls_boolean_scale_rewards(value, read):
    """TRL's older scale_rewards was a bool: true scales by the group's standard deviation, false does not."""
    from posttune.config.typed import from_dict
    from posttune_grpo import GRPOConfig

    assert from_dict(GRPOConfig, {"scale_rewards": value}, "method").scale_rewards == read


def test_every_unknown_key_of_a_section_is_named_at_once():
    """A recipe brought from TRL has several such keys at the top: one error names them all, each with its place
    (or a near key), so a user does not fix them one run at a time."""
    with pytest.raises(ConfigError) as info:
        validate({**RUN, "learning_rate": 1e-4, "r": 16, "tokenzier": {}, "gradient_checkpointing": True})
    assert str(info.value) == (
        "config: learning_rate: unknown key; learning_rate is train.lr here (and 3 more unknown here: r is "
        "adapter.rank here; tokenzier (did you mean 'tokenizer'?); gradient_checkpointing is memory: "
        "[activation_checkpointing] (posttune-memory) here)")


def test_axolotls_adapter_lora_is_lora_with_the_defaults():
    assert validate({**RUN, "adapter": "lora"}).adapter == validate({**RUN, "adapter": {"kind": "lora"}}).adapter


def test_axolotls_dataset_type_names_the_format_that_reads_it():
    from posttune.errors import PosttuneError
    from posttune.plugins import get_registry

    with pytest.raises(PosttuneError, match=r"no dataset format 'sharegpt' is installed \(installed: .*\); sharegpt "
                                            r"is 'chat' here$"):
        get_registry().get("dataset_format", "sharegpt")


@dataclass(frozen=True)
class Entry:
    name: str
    weight: float = 1.0


@dataclass(frozen=True)
class Config:
    rewards: list[Entry] = field(default_factory=list)


def test_a_nested_entrys_unknown_key_is_its_own_not_a_misplaced_run_config_key():
    """A plugin's list entry (a reward of a third-party method, ``method.rewards[0]``) with a key that happens to
    be a run-config key's name (GRPO's ``timeout_s`` brought to a method whose entries have none) is that entry's
    unknown key, with the entry's keys: not ``timeout_s is parallel.timeout_s here``, which names a setting of
    another thing altogether. In the method's own config the run-config key is still named where it belongs."""
    from posttune.config.typed import from_dict

    with pytest.raises(ConfigError) as info:
        from_dict(Config, {"rewards": [{"name": "x", "timeout_s": 2}]}, "method")
    assert str(info.value) == "config: method.rewards[0].timeout_s: unknown key (keys: name, weight)"
    with pytest.raises(ConfigError) as info:
        from_dict(Config, {"timeout_s": 2}, "method")
    assert str(info.value) == "config: method.timeout_s: unknown key; timeout_s is parallel.timeout_s here"
