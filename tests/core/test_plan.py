"""Plan resolution: names to plugins, requires/conflicts, mesh dimensions, composition order."""

from __future__ import annotations

import json
import pytest

from posttune.config import validate
from posttune.errors import PosttuneError
from posttune.plan import resolve_plan


@pytest.fixture
def registry(fake_plugin):
    return fake_plugin


def config(**sections):
    raw = {"model": {"family": "fam", "size": "tiny"}, "method": "fsft",
           "data": {"train": {"path": "d.jsonl", "format": "chat"}}}
    raw.update(sections)
    return validate(raw)


def test_plan_lists_each_stage_with_its_provider_in_composition_order(registry):
    plan = resolve_plan(config(parallel={"plans": ["fsdp", "tensor"], "dims": {"tp": 2}},
                               memory=["ckpt", "opt_bwd"], adapter={"kind": "fadapt", "rank": 4}), registry,
                       world_size=4)
    stages = [step.stage for step in plan.steps]
    assert stages == ["distributed", "build", "adapt", "parallelize", "parallelize", "parallelize", "load",
                      "data", "optimizer", "optimizer", "method", "train"]
    parallel = [step.what for step in plan.steps if step.stage == "parallelize"]
    assert parallel == ["parallel plan 'tensor'", "memory technique 'ckpt'", "parallel plan 'fsdp'"]
    assert plan.mesh == {"dp_shard": 2, "tp": 2}
    assert plan.steps[1].provider == "posttune-fake 9.9"
    assert "fadapt rank 4 on q, v" in plan.steps[2].what and plan.steps[2].provider == "posttune-fake 9.9"


def test_one_process_runs_the_same_config_with_plans_inactive(registry):
    plan = resolve_plan(config(parallel={"plans": ["fsdp", "tensor"], "dims": {"tp": 2}}), registry, world_size=1)
    assert plan.parallel == [] and plan.mesh == {"dp_shard": 1, "tp": 1}
    assert plan.steps[0].what == "1 process(es), mesh dp_shard=1, tp=1; parallel.plans fsdp, tensor inactive on one " \
                                 "process"  # said (a plan author's plan printed nothing on one process)


def test_the_optimizer_line_names_the_schedule_and_its_warmup(registry):
    plan = resolve_plan(config(train={"scheduler": "cosine", "warmup_ratio": 0.1}), registry)
    assert [step.what for step in plan.steps if step.stage == "optimizer"] == [
        "optimizer adamw, lr 2e-05, schedule cosine, warmup 0.1 of the steps"]


@pytest.mark.parametrize("sections, world, message", [
    ({"parallel": {"plans": ["fsdp", "tensor"], "dims": {"tp": 3}}}, 4,
     "config: parallel.dims: tp=3 does not fit the 4 processes launched"),
    ({"parallel": {"plans": ["fsdp", "tensor"], "dims": {"tp": 2, "dp_shard": 1}}}, 4,
     "config: parallel.dims: dp_shard=1 x tp=2 does not fit the 4 processes launched"),
    ({"parallel": {"plans": ["fsdp", "tensor"]}}, 4,
     "config: parallel.dims: dp_shard and tp are both unsized; give all but one a degree"),
    ({"parallel": {"plans": ["fsdp"], "dims": {"tp": 2}}}, 2,
     "config: parallel.dims.tp: no active plan owns mesh dimension 'tp' (owned: dp_shard (fsdp))"),
    ({"parallel": {"plans": ["lossp"]}}, 2,
     "config: parallel.plans: 'lossp' requires 'tensor'; add it to parallel.plans"),
    ({"memory": ["ckpt", "offload", "opt_bwd"]}, 1,
     "config: memory: 'opt_bwd' (posttune-fake 9.9) conflicts with 'offload' (posttune-fake 9.9); remove one"),
    ({"memory": ["ckpt", "ckpt"]}, 1, "config: memory: 'ckpt' is listed twice"),
    ({"memory": ["offload"]}, 1, "config: memory: 'offload' requires 'ckpt'; add it to memory"),
    ({"memory": ["opt_bwd"], "train": {"grad_accum_steps": 4}}, 1,
     "config: train.grad_accum_steps: opt_bwd cannot accumulate gradients; set it to 1"),
    # the fakes alone: the core registers no technique
    ({"memory": ["chunked"]}, 1, "config: memory[0]: no memory technique 'chunked' is installed "
                                 "(installed: ckpt, offload, opt_bwd) (did you mean 'chunked_cross_entropy'?) — pip "
                                 "install posttune-memory"),  # a name cut short: the one it begins
    ({"memory": ["chunked_cross_entropy"]}, 1, "config: memory[0]: no memory technique 'chunked_cross_entropy' is "
                                               "installed (installed: ckpt, offload, opt_bwd) — pip install "
                                               "posttune-memory"),
    ({"parallel": {"plans": ["fsdp2"]}}, 2, "config: parallel.plans[0]: no parallel plan 'fsdp2' is installed "
                                            "(installed: fsdp, lossp, tensor) — pip install posttune-fsdp2"),
    ({"method": "sft"}, 1, "config: method: no method 'sft' is installed (installed: fdpo, fsft) "
                           "— pip install posttune-sft"),
    ({"method": {"name": "fdpo", "beta": "high"}}, 1, "config: method.beta: expected a number, got 'high'"),
    ({"method": {"name": "fdpo", "betta": 1}}, 1, "config: method.betta: unknown key (did you mean 'beta'?)"),
    ({"method": "fdpo"}, 1,
     "config: data.train.format: 'chat' gives conversation rows; method 'fdpo' needs preference rows"),
    ({"data": None}, 1, "config: data: required: method 'fsft' trains on a dataset"),
    ({"data": {"train": {"path": "x", "format": "alpacca"}}}, 1,
     "config: data.train.format: no dataset format 'alpacca' is installed (installed: alpaca, chat, completion, "
     "preference, preference_text, prompt, text) (did you mean 'alpaca'?)"),
    ({"model": {"family": "fam", "size": "huge"}}, 1,
     "config: model.size: family 'fam' has no size 'huge' (sizes: tiny)"),
    ({"model": {"family": "qwen3", "size": "0.6b"}}, 1,
     "config: model.family: no model family 'qwen3' is installed (installed: fam) — pip install posttune-qwen"),
    ({"requires": ["posttune-fake-not-installed"]}, 1,
     "config requires posttune-fake-not-installed, which is not installed — pip install 'posttune-fake-not-installed'"),
])
def test_impossible_plans_are_refused_in_one_line(registry, sections, world, message):
    with pytest.raises(PosttuneError) as error:
        resolve_plan(config(**sections), registry, world_size=world)
    assert str(error.value) == message


def test_family_is_found_from_the_checkpoints_architectures(registry, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FamForCausalLM"]}))
    plan = resolve_plan(config(model={"path": str(tmp_path)}), registry)
    assert plan.family.descriptor.name == "fam"
    assert plan.converter.descriptor.name == "fam:hf"


def test_unread_architecture_lists_installed_families_and_the_install_line(registry, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"]}))
    with pytest.raises(PosttuneError) as error:
        resolve_plan(config(model={"path": str(tmp_path)}), registry)
    assert str(error.value) == (f"{tmp_path}: no installed model family reads architecture Gemma2ForCausalLM "
                                "(installed: fam (FamForCausalLM)) — pip install posttune-gemma")


def test_checkpoint_folder_without_config_json_is_refused(registry, tmp_path):
    with pytest.raises(PosttuneError, match=r"not a Hugging Face checkpoint \(no config.json\)"):
        resolve_plan(config(model={"path": str(tmp_path)}), registry)
    with pytest.raises(PosttuneError, match="no such checkpoint directory"):
        resolve_plan(config(model={"path": str(tmp_path / "missing")}), registry)
