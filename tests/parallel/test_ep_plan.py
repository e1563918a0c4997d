"""posttune-ep before launch: the ``ep`` mesh dimension's place, what it refuses in one line (a degree
that does not divide the experts, a dense family, no fsdp2), and its memory estimate term."""

from __future__ import annotations

import subprocess
import sys

import pytest

import posttune_ep
import posttune_fsdp2
import posttune_llama
import posttune_qwen
import posttune_sft
from posttune.config import validate
from posttune.errors import ConfigError
from posttune.plan import resolve_plan
from posttune.plugins import get_registry

MOE = {"family": "qwen3_moe", "size": "tiny"}  # 8 experts


@pytest.fixture
def plugins(register_plugin):
    for module, dist in ((posttune_llama, "posttune-llama"), (posttune_qwen, "posttune-qwen"),
                         (posttune_sft, "posttune-sft"), (posttune_fsdp2, "posttune-fsdp2"),
                         (posttune_ep, "posttune-ep")):
        register_plugin(module, distribution=dist, version="0.1.0")


def plan_for(world: int, parallel: dict, model: dict = MOE):
    raw = {"model": model, "method": "sft", "tokenizer": {"path": "unused"},
           "data": {"train": {"path": "unused.jsonl"}}, "parallel": parallel}
    return resolve_plan(validate(raw), get_registry(), world_size=world)


def test_ep_sits_inside_dp_shard_and_splits_the_batch(plugins):
    plan = plan_for(8, {"plans": ["ep", "fsdp2"], "dims": {"ep": 4}})
    assert list(plan.mesh.items()) == [("dp_shard", 2), ("ep", 4)]
    assert plan.mesh_dims["ep"].splits == "batch"
    # the parallelize stage runs them by order: the experts are split before FSDP2 wraps them
    assert [p.descriptor.name for p in sorted(plan.parallel, key=lambda r: r.descriptor.order)] == ["ep", "fsdp2"]


def test_ep_must_divide_the_expert_count(plugins):
    plan_for(4, {"plans": ["fsdp2", "ep"], "dims": {"ep": 4}})
    with pytest.raises(ConfigError, match=r"^config: parallel\.dims\.ep: ep=3 does not divide the model's 8 experts"):
        plan_for(3, {"plans": ["fsdp2", "ep"], "dims": {"ep": 3}})
    with pytest.raises(ConfigError, match="ep=16 does not divide the model's 8 experts"):
        plan_for(16, {"plans": ["fsdp2", "ep"], "dims": {"dp_shard": 1}})  # an unsized ep takes the rest


def test_ep_on_a_dense_family_is_refused(plugins):
    with pytest.raises(ConfigError, match=r"^config: parallel\.plans: ep splits the experts of a mixture-of-experts "
                                          r"model; llama is dense"):
        plan_for(2, {"plans": ["fsdp2", "ep"], "dims": {"ep": 2}}, model={"family": "llama", "size": "tiny"})


def test_ep_requires_fsdp2(plugins):
    with pytest.raises(ConfigError, match=r"parallel\.plans: 'ep' requires 'fsdp2'"):
        plan_for(2, {"plans": ["ep"]})


def test_the_estimate_splits_every_weight_over_dp_shard_times_ep(plugins):
    from posttune.estimate import estimate

    alone = estimate(plan_for(1, {}))
    split = estimate(plan_for(8, {"plans": ["fsdp2", "ep"], "dims": {"ep": 4}}))
    assert split.models[0].weights_bytes == alone.models[0].weights_bytes // 8
    assert split.models[0].optimizer_bytes == alone.models[0].optimizer_bytes // 8


def test_importing_the_plugin_does_not_import_torch():
    code = "import sys, posttune_ep; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ep_splits_the_experts_before_tp_splits_the_attention(register_plugin, plugins):
    import posttune_tp

    register_plugin(posttune_tp, distribution="posttune-tp", version="0.1.0")
    plan = plan_for(8, {"plans": ["tp", "fsdp2", "ep"], "dims": {"ep": 2, "tp": 2}})
    assert list(plan.mesh.items()) == [("dp_shard", 2), ("ep", 2), ("tp", 2)]
    assert [p.descriptor.name for p in sorted(plan.parallel, key=lambda r: r.descriptor.order)] == ["ep", "tp", "fsdp2"]
    styles = posttune_qwen.QWEN3_MOE.tp_plan
    assert styles["layers.*.mlp"] == "replicated" and styles["layers.*.attn.q_norm"] == "per_head"
    assert not any(".mlp." in pattern for pattern in styles)
