"""Sync GRPO on 2 gloo ranks (FSDP2, and TP) trains exactly like one process (fp32, per step, 1e-5).

Each completion samples with a seed of its own (run seed, epoch, dataset row, sample index), so
the two ranks draw the completions the single process draws for the same prompts; advantages are
normalised within groups (a prompt's group lives on one rank) and the token normaliser is summed
over the ranks.
"""

from __future__ import annotations

import pytest

from conftest import metrics

pytestmark = pytest.mark.slow

TOL = 1e-5
GRPO = {"name": "grpo", "group_size": 4, "max_new_tokens": 6,
        "rewards": [{"name": "format", "options": {"pattern": ".*[AEIOU].*"}}]}
KEYS = ("loss", "grad_norm", "reward", "reward_std", "completion_length", "clip_fraction")


PARALLEL = {
    "fsdp2": dict(batch_size=2, parallel={"plans": ["fsdp2"]}),
    # one-token decoding steps cannot be split over the sequence: TP without sequence parallelism
    "tp": dict(batch_size=4, parallel={"plans": ["tp"], "options": {"tp": {"sequence_parallel": False}}}),
}


#: only the highest-entropy 30% of a micro-batch's completion tokens take the policy term: the share is taken over
#: both ranks' tokens, as one process takes it over all of them
HIGH_ENTROPY = {**GRPO, "top_entropy_quantile": 0.3}


@pytest.mark.parametrize("name", [*PARALLEL, "fsdp2_high_entropy"])
def test_sync_grpo_on_two_ranks_matches_one_process(runs, name):
    method, keys = (HIGH_ENTROPY, (*KEYS, "entropy", "entropy_selected")) if name.endswith("entropy") else (GRPO, KEYS)
    single = runs(f"grpo_single{'_high_entropy' if method is HIGH_ENTROPY else ''}", batch_size=4, method=method,
                  overrides=("train.lr=5e-3",))
    split = runs(f"grpo_{name}", nproc=2, method=method, overrides=("train.lr=5e-3",),
                 **PARALLEL[name.removesuffix("_high_entropy")])
    got, want = metrics(split), metrics(single)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert a["completion_tokens"] == b["completion_tokens"] and a["tokens"] == b["tokens"]
        for key in keys:
            assert abs(a[key] - b[key]) <= TOL * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    assert any(r["loss"] != 0 for r in want) and len({r["reward"] for r in want}) > 1  # a real run


def test_a_reward_model_role_sharded_on_two_ranks_scores_like_one_process(runs, tmp_path_factory):
    """GRPO's ``reward_model`` reward with the reward model a role that FSDP2 shards: the same rewards
    and updates as one process (every rank runs the same scoring forwards)."""
    import torch
    import transformers

    from posttune.testing.tiny import TINY

    rm = tmp_path_factory.mktemp("reward_model")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 384, "num_labels": 1, "pad_token_id": 4})
    transformers.LlamaForSequenceClassification(config).save_pretrained(rm)
    method = {**GRPO, "rewards": [{"name": "reward_model", "options": {"batch_size": 3}}]}
    common = dict(method=method, models={"reward": {"path": str(rm)}}, overrides=("train.lr=5e-3",))
    single = runs("grpo_rm_single", batch_size=4, **common)
    split = runs("grpo_rm_fsdp2", nproc=2, batch_size=2, parallel={"plans": ["fsdp2"]}, **common)
    got, want = metrics(split), metrics(single)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        for key in (*KEYS, "reward/reward_model"):
            assert abs(a[key] - b[key]) <= TOL * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    assert len({r["reward"] for r in want}) > 1 and all(r["reward"] == r["reward/reward_model"] for r in want)
