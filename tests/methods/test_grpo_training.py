"""GRPO end to end on a tiny Llama: a run's metrics, REINFORCE equivalence on a real model, the
reference for KL, exact resume, and what is refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import posttune_grpo
import posttune_generate
import posttune_lora
import pytest
import torch
from posttune.plugin import RewardFunction, hookimpl
from run_support import check_bundled_config, compose_run, grpo_config, prompt_rows, write

VOWELS = set("AEIOU")


def vowel_share(prompts, completions, **_):
    """A reward a random model already earns unevenly: the share of capital vowels it writes."""
    return [sum(ch in VOWELS for ch in text) / max(len(text), 1) for text in completions]


def refuse(prompts, completions, **_):
    return [None for _ in completions]


def even_ties(prompts, completions, **_):
    """1 for every completion of a word of even length (its group ties); else each completion its own value."""
    return [1.0 if len(prompt.split()[-1]) % 2 == 0 else i / len(completions) for i, prompt in enumerate(prompts)]


class TestRewards:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_reward_functions(self, register):
        register(RewardFunction("vowel_share", vowel_share, "share of vowels (test)"))
        register(RewardFunction("refuse", refuse, "never scores (test)"))
        register(RewardFunction("even_ties", even_ties, "groups of even-length words tie (test)"))


@pytest.fixture
def llama_grpo(register_plugin):
    import posttune_llama
    import posttune_sft

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")
    register_plugin(TestRewards(), name="test_rewards", distribution="test-rewards", version="1")


def vowel_config(tmp_path: Path, **sections) -> dict:
    method = {"rewards": [{"name": "vowel_share"}], "temperature": 1.0, **sections.pop("method", {})}
    return grpo_config(tmp_path, method=method, **sections)


def records(config: dict) -> list[dict]:
    return [json.loads(line) for line in (Path(config["checkpoint"]["output_dir"]) / "metrics.jsonl")
            .read_text().splitlines()]


def test_a_run_generates_scores_and_logs_what_grpo_users_watch(llama_grpo, posttune_cli, tmp_path):
    config = vowel_config(tmp_path, train={"max_steps": 4, "eval_every": 2})
    config["data"]["validation"] = dict(config["data"]["train"])
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    steps = records(config)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # GRPO makes its own micro-batches (completions, micro_batch_size): no rows x accumulation product is claimed
    assert ("1 micro-batch(es) per step on each of 1 data-parallel rank(s), made by method 'grpo' (train.batch_size "
            "2 prompts x group_size 4 = 8 completions per rank a generation, trained in micro-batches of 8)"
            ) in result.stdout
    for key in ("reward", "reward_std", "reward/vowel_share", "completion_length", "completion_length_max",
                "truncated", "clip_fraction", "generation_tokens_per_s", "generation_s", "training_s",
                "completion_tokens"):
        assert key in steps[0], key
    assert 0.0 <= steps[0]["frac_reward_zero_std"] <= 1.0
    assert "kl" not in steps[0]  # beta 0: no reference, no KL
    assert steps[0]["reward_std"] > 0 and steps[0]["grad_norm"] > 0  # unequal rewards: a real gradient
    assert "val_reward" in steps[1] and "val_reward/vowel_share" in steps[1]
    assert all(r["completion_length_max"] <= 6 for r in steps)
    assert all(r["reward_failures/vowel_share"] == 0 for r in steps)  # an unbroken series: 0 when none failed


def test_every_step_reports_what_it_trained_on_a_repeated_iteration_too(llama_grpo, posttune_cli, tmp_path):
    """``num_iterations: 2``: each generation batch trains two steps. Every step logs each reward's failure count
    (an unbroken series), the longest completion it trained on and ``reward_std``, the sample standard deviation
    (Bessel-corrected, TRL's ``nanstd``) of the total rewards of the completions it trained on, which
    ``completions.jsonl`` lists for a generating step."""
    config = vowel_config(tmp_path, method={"num_iterations": 2, "log_completions": True}, train={"max_steps": 4})
    assert posttune_cli("train", str(write(tmp_path, config))).exit_code == 0
    steps = records(config)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    logged = [json.loads(line) for line in (Path(config["checkpoint"]["output_dir"]) / "completions.jsonl")
              .read_text().splitlines()]
    for step in steps:
        assert step["reward_failures/vowel_share"] == 0
        assert step["completion_length_max"] >= step["completion_length"] > 0
    for generated, repeated in ((steps[0], steps[1]), (steps[2], steps[3])):
        rewards = torch.tensor([row["reward"] for row in logged if row["step"] == generated["step"]])
        assert len(rewards) > 2 and float(rewards.std()) > 0
        assert generated["reward_std"] == pytest.approx(float(rewards.std(correction=1)), rel=1e-5)
        assert generated["reward_std"] != pytest.approx(float(rewards.std(correction=0)), rel=1e-4)
        # the second iteration trains on the same completions: the same figures
        for key in ("reward", "reward_std", "completion_length", "completion_length_max"):
            assert repeated[key] == pytest.approx(generated[key]), key
        assert "generation_tokens_per_s" in generated and "generation_tokens_per_s" not in repeated


def test_the_share_of_groups_that_teach_nothing_is_logged(llama_grpo, posttune_cli, tmp_path):
    """``frac_reward_zero_std``: the share of groups whose rewards are all equal (zero advantage, no gradient),
    against the words the step's prompts hold; when every group ties, it is 1 and the gradient is 0."""
    from posttune_grpo.method import batches

    config = vowel_config(tmp_path, method={"rewards": [{"name": "even_ties"}]}, train={"batch_size": 8})
    session = compose_run(config)
    batch = next(iter(batches(session)))
    words = [row["prompt"].split()[-1] for row in prompt_rows(8)]
    rows = session.method_state.pending.rows.view(-1, 4)[:, 0].tolist()  # one dataset row per group
    expected = sum(len(words[row]) % 2 == 0 for row in rows) / len(rows)
    assert 0 < expected < 1
    total, count = session.plan.method.descriptor.loss(session, batch).metrics["frac_reward_zero_std"]
    assert float(total / count) == pytest.approx(expected)

    config = vowel_config(tmp_path / "ties", method={"rewards": [{"name": "even_ties"}]},
                          data={"train": {"path": str(write_rows(tmp_path, ["ABCD", "XYZW"])), "format": "prompt"}})
    assert posttune_cli("train", str(write(tmp_path, config, "ties.yaml"))).exit_code == 0
    for step in records(config):
        assert step["frac_reward_zero_std"] == 1.0 and step["reward_std"] == 0.0 and step["grad_norm"] == 0.0


def write_rows(tmp_path: Path, words: list[str]) -> Path:
    path = tmp_path / "even.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Reverse: {w}", "answer": w[::-1]}) + "\n" for w in words))
    return path


@torch.no_grad()
def sequence_logps(model, rollouts) -> torch.Tensor:
    logits = model(rollouts.input_ids).float()
    mask = rollouts.labels != -100
    picked = logits.log_softmax(-1).gather(-1, rollouts.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * mask


def test_one_pass_without_kl_is_reinforce_with_group_normalised_advantages(llama_grpo, tmp_path):
    """The loss's gradient on a real model equals that of -sum_i A_i sum_t logp_it / tokens, computed with
    a plain forward pass (temperature 1, one micro-batch: the whole generation batch)."""
    from posttune_grpo.method import batches

    session = compose_run(vowel_config(tmp_path))
    batch = next(iter(batches(session)))
    rollouts = session.method_state.pending
    assert float(rollouts.advantages.abs().sum()) > 0
    out = session.plan.method.descriptor.loss(session, batch)
    (out.loss_sum / out.normaliser).backward()
    ours = {n: p.grad.clone() for n, p in session.model.named_parameters()}
    session.model.zero_grad(set_to_none=True)

    logits = session.model(rollouts.input_ids).float()
    mask = (rollouts.labels != -100).float()
    logps = logits.log_softmax(-1).gather(-1, rollouts.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    reinforce = -(rollouts.advantages.unsqueeze(1) * logps * mask).sum() / mask.sum()
    reinforce.backward()
    for name, param in session.model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, atol=1e-6, rtol=0, msg=name)


def test_behaviour_log_probs_equal_a_fresh_forward_pass(llama_grpo, tmp_path):
    from posttune_grpo.method import batches

    session = compose_run(vowel_config(tmp_path))
    next(iter(batches(session)))
    rollouts = session.method_state.pending
    mask = rollouts.labels != -100
    torch.testing.assert_close(rollouts.behaviour_logps[mask], sequence_logps(session.model, rollouts)[mask],
                               atol=1e-5, rtol=0)


def test_kl_needs_a_reference_which_lora_gets_by_disabling_adapters(llama_grpo, tmp_path, capsys):
    from posttune.adapters import AdaptersOff, save_adapter

    full = compose_run(vowel_config(tmp_path / "full", method={"beta": 0.04}))
    assert "reference" in full.models and not isinstance(full.models["reference"], AdaptersOff)
    lora = compose_run(vowel_config(tmp_path / "lora", method={"beta": 0.04}, adapter={"rank": 4, "alpha": 8}))
    assert isinstance(lora.models["reference"], AdaptersOff)
    assert "warning" not in capsys.readouterr().err
    # started from a saved adapter, the reference is still the base model: said, since the KL starts above 0
    saved = save_adapter(lora.model, tmp_path / "adapter")
    compose_run(vowel_config(tmp_path / "init", method={"beta": 0.04},
                             adapter={"rank": 4, "alpha": 8, "init_from": str(saved)}))
    assert ("posttune: warning: adapter.init_from: the reference model is the policy with its adapters off, "
            "model.path's weights without the adapter") in capsys.readouterr().err
    none = compose_run(vowel_config(tmp_path / "none"))
    assert none.models == {}


def test_kl_is_logged_and_zero_before_the_first_update(llama_grpo, posttune_cli, tmp_path):
    config = vowel_config(tmp_path, method={"beta": 0.04}, train={"max_steps": 3, "lr": 5e-3})
    assert posttune_cli("train", str(write(tmp_path, config))).exit_code == 0
    steps = records(config)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy is its reference at step 1
    assert steps[-1]["kl"] > 0


def test_a_synced_reference_makes_the_kl_zero_again_after_each_sync(llama_grpo, posttune_cli, tmp_path):
    """``sync_reference_every: 2, sync_reference_alpha: 1``: after steps 2 and 4 the reference becomes the policy, so
    steps 3 and 5 (one pass per generation: the policy scored is the synced one) measure a KL of 0; a fixed
    reference's KL grows instead."""
    def kls(name: str, **sync: float) -> list[float]:
        config = vowel_config(tmp_path / name, method={"beta": 0.04, **sync}, train={"max_steps": 5, "lr": 5e-3})
        result = posttune_cli("train", str(write(tmp_path / name, config)))
        assert result.exit_code == 0, result.stderr
        return [step["kl"] for step in records(config)]

    synced, fixed = kls("synced", sync_reference_every=2, sync_reference_alpha=1.0), kls("fixed")
    assert [synced[i] for i in (0, 2, 4)] == pytest.approx([0.0, 0.0, 0.0], abs=1e-7)
    assert synced[1] > 0 and synced[3] > 0 and min(fixed[1:]) > 0


def test_several_passes_and_micro_batches_make_several_steps_per_generation(llama_grpo, posttune_cli, tmp_path):
    """2 prompts x 4 completions, micro-batches of 4, 2 passes: 4 micro-batches, 2 per step -> 2 steps each."""
    config = vowel_config(tmp_path, method={"num_iterations": 2, "micro_batch_size": 4},
                          train={"max_steps": 4, "grad_accum_steps": 2})
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    steps = records(config)
    assert [r["generation_s"] > 0 for r in steps] == [True, False, True, False]  # one generation per 2 steps
    assert steps[0]["clip_fraction"] == 0.0  # the first pass: ratio 1


def test_a_reward_that_cannot_score_stops_the_run_in_one_line_unless_told_to_count(llama_grpo, posttune_cli,
                                                                                  tmp_path):
    config = vowel_config(tmp_path, method={"rewards": [{"name": "vowel_share"}, {"name": "refuse"}]})
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if "posttune: error:" in line]
    assert len(errors) == 1 and errors[0].endswith(
        "posttune: error: reward 'refuse' (test-rewards 1) returned None (cannot score) for completion 0 (8 of 8 in "
        "this batch); set method.reward_errors: zero to score such completions 0 and count them")
    config["method"]["reward_errors"] = "zero"
    assert posttune_cli("train", str(write(tmp_path, config, "zero.yaml"))).exit_code == 0


@pytest.mark.parametrize("sections, message", [
    ({"method": {"group_size": 1}}, "config: method.group_size: GRPO compares completions within a group: at least 2"),
    ({"method": {"micro_batch_size": 3}}, "config: method.micro_batch_size: must divide train.batch_size x "
                                          "group_size = 8 completions per rank, got 3"),
    ({"train": {"grad_accum_steps": 3}}, "config: train.grad_accum_steps: must divide the 1 micro-batches of each "
                                         "generation batch (num_iterations x completions / micro_batch_size), got 3"),
    ({"method": {"epsilon_high": 0.1}}, "config: method.epsilon_high: must be at least epsilon (0.2), got 0.1"),
    ({"method": {"rewards": [{"name": "math_answr"}]}}, "config: method.rewards[0].name: no reward function "
                                                       "'math_answr' is installed"),
    ({"method": {"rewards": []}}, "config: method.rewards: lists no reward"),
    ({"method": {"engine": "biltin"}}, "config: method.engine: no generation engine 'biltin' is installed "
                                       "(installed: builtin) (did you mean 'builtin'?)"),
    ({"data": {"train": {"path": "x.jsonl", "format": "chat"}}},
     "config: data.train.format: 'chat' gives conversation rows; method 'grpo' needs prompt rows"),
    ({"method": {"mode": "async", "generation": "local"}}, "config: method.generation: mode async overlaps "
                                                           "generation with training, which needs Ray actors"),
    ({"method": {"mode": "sync", "generation": "ray", "ray_options": {"max_staleness": 1}}},
     "config: method.ray_options.max_staleness: mode sync trains only on rollouts of the current weights (0), got 1"),
    ({"method": {"mode": "async", "ray_options": {"max_staleness": 2}}},
     "config: method.ray_options.max_staleness: mode async overlaps one batch (at most 1), got 2; use mode "
     "off_policy"),
    ({"method": {"mode": "off_policy", "ray_options": {"max_staleness": -1}}},
     "config: method.ray_options.max_staleness: expected an integer >= 0, got -1"),
    ({"method": {"mode": "async", "ray_options": {"sync_every": 3}}},
     "config: method.ray_options.sync_every: weights pushed every 3 steps lag up to 2 versions, more than "
     "max_staleness 1; use at most 2"),
    ({"method": {"mode": "async", "ray_options": {"actors": 0}}},
     "config: method.ray_options.actors: expected a positive integer, got 0"),
    ({"method": {"mode": "off_policy", "tis_cap": 0.5}},
     "config: method.tis_cap: expected a number >= 1 (or null), got 0.5"),
    ({"method": {"mode": "off_policy", "ray_options": {"tis_cap": 3.0}}},
     "config: method.ray_options.tis_cap: unknown key; moved: set method.tis_cap"),
    ({"method": {"sync_reference_every": 2}},
     "config: method.sync_reference_every: beta is 0: the run has no reference model to sync"),
    ({"method": {"beta": 0.04, "sync_reference_every": 2}, "adapter": {"rank": 4}},
     "config: method.sync_reference_every: with an adapter the reference shares the policy's base weights; a synced "
     "reference needs one of its own (full fine-tuning, as TRL)"),
    ({"method": {"sync_reference_alpha": 0.5}},
     "config: method.sync_reference_alpha: only sync_reference_every uses it"),
    ({"train": {"eval_every": 2}, "data": {"validation_split": 0.25},
      "checkpoint": {"best_metric": "val_loss", "save_every": 2}},
     "config: checkpoint.best_metric: the evaluation logs no 'val_loss' (it logs: val_reward, val_reward/vowel_share, "
     "val_completion_length; the mean reward of greedy answers is val_reward)"),
])
def test_impossible_grpo_runs_are_refused_by_validate(llama_grpo, posttune_cli, tmp_path, sections, message):
    config = vowel_config(tmp_path)
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"posttune: error: {message}")


NAMES = sorted(path.stem for path in posttune_grpo.CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", NAMES)
def test_bundled_configs_validate_and_show_their_command(llama_grpo, register_plugin, posttune_cli, name):
    import posttune_qwen

    register_plugin(posttune_qwen, distribution="posttune-qwen", version="0.1.0")
    check_bundled_config(posttune_cli, posttune_grpo.CONFIGS, name)


def test_the_bundled_configs_cover_the_cpu_example_and_gsm8k():
    assert {"grpo-tiny-reverse", "qwen2.5-1.5b-grpo-gsm8k", "qwen3-0.6b-grpo-gsm8k"} <= set(NAMES)


def test_lora_grpo_with_kl_trains_the_adapters_and_saves_a_peft_adapter(llama_grpo, posttune_cli, tmp_path):
    config = vowel_config(tmp_path, method={"beta": 0.04}, adapter={"rank": 4, "alpha": 8},
                          train={"max_steps": 3, "lr": 5e-3})
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    steps = records(config)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7) and steps[-1]["kl"] > 0  # the adapters moved it
    assert (Path(config["checkpoint"]["output_dir"]) / "adapter" / "adapter_config.json").is_file()


def test_a_finished_sync_run_leaves_no_reward_worker_behind(llama_grpo, posttune_cli, tmp_path, monkeypatch):
    """The isolated `format` reward scores in worker processes; the method's close (called by the core as the
    run ends) kills them, rather than leaving them to the interpreter's exit."""
    from posttune_grpo import reward_workers, scoring

    pools = []

    def recorded(*args):
        pools.append(reward_workers.shared_pool(*args))
        return pools[-1]

    monkeypatch.setattr(scoring, "shared_pool", recorded)
    config = vowel_config(tmp_path, method={"rewards": [{"name": "format", "options": {"pattern": ".*[AEIOU].*"}}]})
    assert posttune_cli("train", str(write(tmp_path, config))).exit_code == 0
    assert pools and pools[-1].started > 0  # workers did run
    assert all(pool.pids() == [] for pool in pools) and reward_workers._shared is None


def test_training_leaves_no_tensor_to_the_cyclic_collector(llama_grpo, tmp_path):
    """A tensor in a reference cycle outlives its step until Python's rare full collection: the KV cache's
    did, and the GRPO example's heap grew to twice its live size (docs/memory.md). Three steps of
    generation, scoring, training, evaluation and a checkpoint, with the cyclic collector off: nothing it
    would have to free holds a tensor."""
    import gc

    from posttune.config import validate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry
    from posttune.training import output_dir
    from posttune.training.compose import compose
    from posttune.training.trainer import train

    config = vowel_config(tmp_path, train={"max_steps": 3, "eval_every": 2},
                          checkpoint={"save_every": 2})
    config["data"]["validation"] = config["data"]["train"]
    plan = resolve_plan(validate(config), get_registry())
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with output_dir.claimed(plan.config, main=True):
            session = compose(plan)
            train(session)
        gc.collect()  # the session is alive: what is collected is what the steps left behind
        cyclic = [tuple(obj.shape) for obj in gc.garbage if isinstance(obj, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert cyclic == [] and session.step == 3


def test_log_completions_writes_each_step_s_first_completions_with_their_rewards(llama_grpo, posttune_cli,
                                                                                 tmp_path):
    """``log_completions: 4`` (one group of 4): each optimizer step appends its first 4 completions to
    completions.jsonl, as the rewards read them, with the reward they scored and the advantage the loss used."""
    config = vowel_config(tmp_path, method={"log_completions": 4}, train={"max_steps": 2})
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    out = Path(config["checkpoint"]["output_dir"])
    lines = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1] * 4 + [2] * 4
    for step in (lines[:4], lines[4:]):
        assert len({line["prompt"] for line in step}) == 1 and "Reverse" in step[0]["prompt"]  # one group
        for line in step:
            assert set(line) == {"step", "prompt", "completion", "reward", "reward/vowel_share", "advantage"}
            assert line["reward"] == pytest.approx(vowel_share([], [line["completion"]])[0])
            assert line["reward/vowel_share"] == line["reward"]
        assert abs(sum(line["advantage"] for line in step)) < 1e-5  # the group's advantages
        for a in step:
            for b in step:
                if a["reward"] > b["reward"]:
                    assert a["advantage"] > b["advantage"]


def test_log_completions_true_logs_every_completion_of_the_step(llama_grpo, posttune_cli, tmp_path):
    """TRL's spelling, ``log_completions: true``: all of a step's completions (2 prompts x 4); false: none."""
    config = vowel_config(tmp_path / "all", method={"log_completions": True}, train={"max_steps": 2})
    assert posttune_cli("train", str(write(tmp_path / "all", config))).exit_code == 0
    lines = [json.loads(line) for line in (Path(config["checkpoint"]["output_dir"]) / "completions.jsonl")
             .read_text().splitlines()]
    assert [line["step"] for line in lines] == [1] * 8 + [2] * 8
    config = vowel_config(tmp_path / "none", method={"log_completions": False}, train={"max_steps": 1})
    assert posttune_cli("train", str(write(tmp_path / "none", config))).exit_code == 0
    assert not (Path(config["checkpoint"]["output_dir"]) / "completions.jsonl").exists()
