"""PPO on 2 gloo ranks with FSDP2 trains exactly like one process (fp32, per step, 1e-5), every role
sharded: the policy and the value model (both trained, one optimizer; or the value head on the policy),
the reference and the reward model (frozen).

Each completion samples with its own seed (run seed, epoch, dataset row), so the ranks draw what the
single process draws for the same prompts; whitening takes its mean and variance over both ranks'
rows and the token normaliser is summed over the ranks, so the updates agree too.
"""

from __future__ import annotations

import pytest

from conftest import metrics, train, write_config

pytestmark = pytest.mark.slow

TOL = 1e-5
KEYS = ("loss", "grad_norm", "reward", "score", "kl", "policy_loss", "value_loss", "clip_fraction",
        "value_clip_fraction", "returns_mean", "value_mean", "completion_length")


@pytest.mark.parametrize("value_model", ["model", "head"])
def test_ppo_with_four_sharded_roles_on_two_ranks_matches_one_process(runs, tmp_path_factory, value_model):
    import torch
    import transformers

    from posttune.testing.tiny import TINY

    rm = tmp_path_factory.mktemp("ppo_reward_model")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 384, "num_labels": 1, "pad_token_id": 4})
    transformers.LlamaForSequenceClassification(config).save_pretrained(rm)
    method = {"name": "ppo", "max_new_tokens": 6, "ppo_epochs": 2, "kl_coef": 0.1, "value_model": value_model,
              "rewards": [{"name": "reward_model", "options": {"batch_size": 3}}]}
    common = dict(method=method, models={"reward": {"path": str(rm)}}, overrides=("train.lr=5e-3",))
    single = runs(f"ppo_{value_model}_single", batch_size=4, **common)
    split = runs(f"ppo_{value_model}_fsdp2", nproc=2, batch_size=2, parallel={"plans": ["fsdp2"]}, **common)
    got, want = metrics(split), metrics(single)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert a["completion_tokens"] == b["completion_tokens"] and a["tokens"] == b["tokens"]
        for key in (*KEYS, "reward/reward_model"):
            assert abs(a[key] - b[key]) <= TOL * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    # a real run: rewards differ between batches, the policy moved off the reference, the value model learns
    assert len({r["reward"] for r in want}) > 1 and any(r["kl"] != 0 for r in want)
    assert len({r["value_loss"] for r in want}) > 1
    # both trained models exported, gathered from the shards (a head on the policy: its own small file)
    assert (split / "model" / "model.safetensors").is_file()
    assert (split / "value" / ("model.safetensors" if value_model == "model" else "head.safetensors")).is_file()


@pytest.mark.parametrize("value_model", ["model", pytest.param("head", marks=pytest.mark.extended)])
def test_a_sharded_ppo_checkpoint_resumes_both_trained_models_exactly(tmp_path, value_model):
    """FSDP2 on 2 ranks writes DCP checkpoints holding the policy, the value model and their one optimizer
    (and each rank's pending experience); resuming step 2's checkpoint redoes steps 3-4 exactly."""
    method = {"name": "ppo", "max_new_tokens": 6, "ppo_epochs": 2, "num_mini_batches": 2, "value_model": value_model,
              "rewards": [{"name": "format", "options": {"pattern": ".*[AEIOU].*"}}]}
    path = write_config(tmp_path, batch_size=2, parallel={"plans": ["fsdp2"]}, method=method,
                        checkpoint={"save_every": 2, "keep_last": 2})
    train(path, "train.lr=5e-3", nproc=2)
    out = tmp_path / "out"
    first = metrics(out)
    step2 = out / "checkpoints" / "step-00000002"
    assert (step2 / "sharded").is_dir() and not (step2 / "model").exists()
    train(path, "train.lr=5e-3", f"checkpoint.resume={step2}", nproc=2)
    again = metrics(out)
    assert [r["step"] for r in again] == [1, 2, 3, 4] and len({r["value_loss"] for r in first}) > 1
    for a, b in zip(again, first):
        for key in ("loss", "grad_norm", "reward", "value_loss", "policy_loss"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
