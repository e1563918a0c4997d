"""Parallel plans before launch: options, mesh order, requires/conflicts and shape checks, each
refused as one line naming the field; and the plugins register without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import posttune_cp
import posttune_fsdp2
import posttune_llama
import posttune_generate
import posttune_lora
import posttune_loss_parallel
import posttune_sft
import posttune_tp
from posttune.config import validate
from posttune.errors import ConfigError
from posttune.plan import resolve_plan
from posttune.plugins import get_registry


@pytest.fixture
def plugins(register_plugin):
    for module, dist in ((posttune_llama, "posttune-llama"), (posttune_sft, "posttune-sft"),
                         (posttune_fsdp2, "posttune-fsdp2"), (posttune_tp, "posttune-tp"),
                         (posttune_loss_parallel, "posttune-loss-parallel"), (posttune_cp, "posttune-cp"),
                         (posttune_lora, "posttune-lora"), (posttune_generate, "posttune-generate")):
        register_plugin(module, distribution=dist, version="0.1.0")


def plan_for(world: int, parallel: dict, **sections):
    raw = {"model": {"family": "llama", "size": "tiny"}, "method": "sft", "tokenizer": {"path": "unused"},
           "data": {"train": {"path": "unused.jsonl"}}, "parallel": parallel, **sections}
    return resolve_plan(validate(raw), get_registry(), world_size=world)


def test_mesh_dims_are_ordered_outer_to_inner_whatever_the_listing(plugins):
    plan = plan_for(4, {"plans": ["tp", "fsdp2"], "dims": {"tp": 2}})
    assert list(plan.mesh.items()) == [("dp_shard", 2), ("tp", 2)]
    assert [p.descriptor.name for p in plan.parallel] == ["tp", "fsdp2"]


def test_the_plans_declare_data_outermost_then_sequence_then_weights(plugins):
    plan = plan_for(4, {"plans": ["tp", "cp", "fsdp2"], "dims": {"tp": 2, "cp": 1}})
    assert list(plan.mesh.items()) == [("dp_shard", 2), ("cp", 1), ("tp", 2)]
    assert [dim.splits for dim in plan.mesh_dims.values()] == ["batch", "sequence", "none"]


def test_loss_parallel_keeps_the_head_vocabulary_sharded_through_a_tp_option(plugins):
    styles = plan_for(2, {"plans": ["tp", "loss_parallel"]}).parallel_options["tp"].styles
    assert styles == {"output": "colwise_vocab_sharded"}
    assert plan_for(2, {"plans": ["tp"]}).parallel_options["tp"].styles == {}
    with pytest.raises(ConfigError, match=r"parallel\.options\.tp\.styles: plan 'loss_parallel' "
                                          r"\(posttune-loss-parallel 0\.1\.0\) needs"):
        plan_for(2, {"plans": ["tp", "loss_parallel"], "options": {"tp": {"styles": {"output": "colwise"}}}})


def test_fsdp2_materialises_parameters_on_the_cpu_with_cpu_offload(plugins):
    plan = posttune_fsdp2.PLAN
    assert plan.init_device(plan_for(2, {"plans": ["fsdp2"]}).parallel_options["fsdp2"]) is None
    offload = plan_for(2, {"plans": ["fsdp2"], "options": {"fsdp2": {"cpu_offload": True}}})
    assert plan.init_device(offload.parallel_options["fsdp2"]) == "cpu"


def test_plans_run_in_order_loss_parallel_then_tp_then_fsdp2(plugins):
    plan = plan_for(2, {"plans": ["fsdp2", "loss_parallel", "tp"], "dims": {"tp": 2}})
    order = [s.what for s in plan.steps if s.stage == "parallelize"]
    assert order == ["parallel plan 'loss_parallel'", "parallel plan 'tp'", "parallel plan 'fsdp2'"]


def test_fsdp2_options_are_validated_against_its_dataclass(plugins):
    plan = plan_for(2, {"plans": ["fsdp2"], "options": {"fsdp2": {"cpu_offload": True}}})
    options = plan.parallel_options["fsdp2"]
    assert options.cpu_offload is True and options.reshard_after_forward is True
    with pytest.raises(ConfigError, match=r"parallel\.options\.fsdp2\.reshard: unknown key"):
        plan_for(2, {"plans": ["fsdp2"], "options": {"fsdp2": {"reshard": False}}})
    with pytest.raises(ConfigError, match=r"parallel\.options\.fsdp2\.param_dtype: expected one of"):
        plan_for(2, {"plans": ["fsdp2"], "options": {"fsdp2": {"param_dtype": "int8"}}})


def test_options_for_an_unlisted_plan_or_a_plan_without_options_are_refused(plugins):
    with pytest.raises(ConfigError, match=r"parallel\.options\.tp: 'tp' is not in parallel\.plans"):
        plan_for(2, {"plans": ["fsdp2"], "options": {"tp": {}}})
    with pytest.raises(ConfigError, match=r"parallel\.options\.loss_parallel: plan 'loss_parallel' .* takes no "
                                          r"options"):
        plan_for(2, {"plans": ["tp", "loss_parallel"], "options": {"loss_parallel": {}}})
    with pytest.raises(ConfigError, match=r"parallel\.options\.tp\.sequence_paralel: unknown key"):
        plan_for(2, {"plans": ["tp"], "options": {"tp": {"sequence_paralel": False}}})


def test_options_are_checked_on_one_process_too(plugins):
    plan = plan_for(1, {"plans": ["fsdp2"], "options": {"fsdp2": {"mixed_precision": True}}})
    assert plan.parallel == [] and plan.parallel_options["fsdp2"].mixed_precision is True


def test_tp_degree_must_divide_the_head_counts(plugins):
    # tiny llama: 4 heads, 2 key/value heads
    plan_for(2, {"plans": ["tp"]})
    with pytest.raises(ConfigError, match=r"parallel\.dims\.tp: tp=4 does not divide the model's 2 key/value heads"):
        plan_for(4, {"plans": ["tp"]})
    with pytest.raises(ConfigError, match=r"tp=4 does not divide the model's 6 attention heads"):
        plan_for(4, {"plans": ["tp"]}, model={"family": "llama", "size": "tiny",
                                              "build_overrides": {"num_heads": 6, "num_kv_heads": 2}})


def test_tp_reads_head_counts_from_an_unsized_dim(plugins):
    with pytest.raises(ConfigError, match="tp=4 does not divide"):
        plan_for(8, {"plans": ["fsdp2", "tp"], "dims": {"dp_shard": 2}})


def test_loss_parallel_requires_tp(plugins):
    with pytest.raises(ConfigError, match=r"parallel\.plans: 'loss_parallel' requires 'tp'; add it to parallel\.plans"):
        plan_for(2, {"plans": ["fsdp2", "loss_parallel"]})


def test_dora_and_merged_saves_are_refused_with_sharding(plugins):
    with pytest.raises(ConfigError, match=r"adapter\.kind: dora is not supported with tp"):
        plan_for(2, {"plans": ["tp"]}, adapter={"kind": "dora"})
    with pytest.raises(ConfigError, match=r"checkpoint\.save_merged: not supported with fsdp2"):
        plan_for(2, {"plans": ["fsdp2"]}, adapter={}, checkpoint={"save_merged": True})


def test_sample_prompts_are_refused_where_generation_cannot_run(plugins):
    """``train.sample_prompts`` generate one token at a time: sequence parallelism cannot split that, and loss
    parallelism keeps the logits sharded; both crashed the ranks at the first sample before, now one line."""
    samples = {"train": {"sample_prompts": ["Reverse: ABC"]}}
    with pytest.raises(ConfigError, match=r"parallel\.options\.tp\.sequence_parallel: train\.sample_prompts are "
                                          r"generated one token at a time"):
        plan_for(2, {"plans": ["tp"]}, **samples)
    plan_for(2, {"plans": ["tp"], "options": {"tp": {"sequence_parallel": False}}}, **samples)
    with pytest.raises(ConfigError, match=r"train\.sample_prompts: generating them needs whole logits"):
        plan_for(2, {"plans": ["tp", "loss_parallel"], "options": {"tp": {"sequence_parallel": False}}}, **samples)
    plan_for(1, {"plans": ["tp", "loss_parallel"]}, **samples)  # one process: the plans are inactive


def test_techniques_that_need_whole_weights_are_refused_with_a_sharding_plan(plugins, register_plugin):
    """Before launch, what their apply refused once the model was built (a rank's error, after loading)."""
    import posttune_memory

    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")
    for plans, memory, words in (
            (["fsdp2"], ["optimizer_in_backward"], "optimizer_in_backward does not support a model sharded by fsdp2"),
            (["tp"], ["optimizer_in_backward"], "optimizer_in_backward does not support a model sharded by tp"),
            (["fsdp2"], ["chunked_cross_entropy"], "chunked_cross_entropy .* drop chunked_cross_entropy under fsdp2"),
            (["tp"], ["chunked_cross_entropy"], "chunked_cross_entropy .* use loss_parallel for a vocabulary-sharded"),
            (["tp"], ["compile"], "compile does not trace tp's layers yet")):
        train = {"max_grad_norm": None} if memory == ["optimizer_in_backward"] else {}
        with pytest.raises(ConfigError, match=rf"memory: {words}"):
            plan_for(2, {"plans": plans}, memory=memory, train=train)
        plan_for(1, {"plans": plans}, memory=memory, train=train)  # one process: nothing is sharded
    plan_for(2, {"plans": ["fsdp2"]}, memory=["compile"])


def test_world_size_must_fit_the_dims(plugins):
    with pytest.raises(ConfigError, match=r"parallel\.dims: dp_shard=2 x tp=2 does not fit the 2 processes"):
        plan_for(2, {"plans": ["fsdp2", "tp"], "dims": {"dp_shard": 2, "tp": 2}})


def test_importing_the_plugins_does_not_import_torch():
    code = ("import sys, posttune_fsdp2, posttune_tp, posttune_loss_parallel; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cp_refuses_a_batch_whose_documents_continue_a_shared_prefix():
    """Its flex mask keeps documents apart, so a shared prompt (DPO's share_prompt) would be lost."""
    import torch

    from posttune.errors import PosttuneError
    from posttune_cp.shard import refuse_shared_prefixes

    documents = torch.tensor([[0, 0, 0, 1, 1, 2]])
    refuse_shared_prefixes(documents, torch.tensor([[0, 1, 2, 0, 1, 0]]))  # documents of their own: fine
    with pytest.raises(PosttuneError, match=r"^context parallelism: a document of this batch continues a shared"):
        refuse_shared_prefixes(documents, torch.tensor([[0, 1, 2, 2, 3, 0]]))


@pytest.mark.parametrize(("scaling", "max_seq_len", "refused"), [
    ({"rope_type": "dynamic", "factor": 2.0}, 128, "dynamic RoPE scaling past 64 positions (data.max_seq_len is 128)"),
    ({"rope_type": "longrope", "original_max_position_embeddings": 32, "short_factor": [1.0] * 8,
      "long_factor": [2.0] * 8}, 48, "longrope RoPE scaling past 32 positions (data.max_seq_len is 48)"),
    ({"rope_type": "dynamic", "factor": 2.0}, 64, None),  # within the context: the frequencies never change
    ({"rope_type": "linear", "factor": 2.0}, 128, None),
])
def test_cp_refuses_rope_whose_frequencies_follow_the_sequence_length(plugins, scaling, max_seq_len, refused):
    """Each cp rank holds part of a sequence: dynamic NTK and LongRoPE would choose frequencies by the rank's own
    longest position (measured: logits off by 2.4 and 9 against one process)."""
    model = {"family": "llama", "size": "tiny", "build_overrides": {"rope_scaling": scaling,
                                                                    "max_position_embeddings": 64}}
    sections = {"model": model, "train": {"device": "cuda"}}
    data = {"train": {"path": "unused.jsonl"}, "max_seq_len": max_seq_len}
    if refused is None:
        plan_for(2, {"plans": ["fsdp2", "cp"], "dims": {"cp": 2}}, data=data, **sections)
        return
    with pytest.raises(ConfigError) as caught:
        plan_for(2, {"plans": ["fsdp2", "cp"], "dims": {"cp": 2}}, data=data, **sections)
    assert str(caught.value) == (f"config: parallel.plans: cp does not support {refused}: each rank holds part of a "
                                 "sequence and would choose its own frequencies; lower data.max_seq_len to that "
                                 "length, or remove cp")


def test_cps_rope_variants_are_the_cores_growing_ones():
    from posttune.modules.rope import GROWING

    assert posttune_cp.GROWING_ROPE == GROWING


@pytest.mark.parametrize("options, model_dtype, expected", [
    ({}, "bf16", ("bfloat16", "float32")),  # the documented default: bf16 compute, gradients reduced in fp32
    ({"reduce_dtype": "bf16"}, "bf16", ("bfloat16", "bfloat16")),
    ({}, "fp32", (None, None)),  # an fp32 model: no policy, everything in fp32
    ({"mixed_precision": True}, "fp32", ("bfloat16", "float32")),
])
def test_fsdp2_mixed_precision_computes_and_reduces_in_the_dtypes_its_options_say(options, model_dtype, expected):
    from posttune_fsdp2.shard import mixed_precision

    policy = mixed_precision(posttune_fsdp2.FSDP2Options(**options), model_dtype)
    names = tuple(None if dtype is None else str(dtype).removeprefix("torch.")
                  for dtype in (policy.param_dtype, policy.reduce_dtype))
    assert names == expected
