"""GRPO's ``reward_model`` reward: completions scored by a reward model role, as transformers scores them.

The reference is independent of posttune: transformers' tokenizer renders each prompt and its
completion with the chat template, and transformers' ``LlamaForSequenceClassification`` scores
the rendered ids; GRPO's per-completion ``reward_model`` values must equal those (1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import posttune_grpo
import posttune_llama
import posttune_generate
import posttune_lora
import posttune_rm
import pytest
import torch
import transformers
import yaml
from run_support import TOKENIZER, compose_run, grpo_config, prompt_rows

from posttune.testing.tiny import TINY

PAD = 4  # the demo tokenizer's pad id


@pytest.fixture
def grpo_rm(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")
    register_plugin(posttune_rm, distribution="posttune-rm", version="0.1.0")


def save_reward_model(path: Path, pad: int | None = PAD) -> None:
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 384, "num_labels": 1, "pad_token_id": pad})
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)


def rm_run(tmp_path: Path, pad: int | None = PAD, **method) -> dict:
    save_reward_model(tmp_path / "rm", pad)
    config = grpo_config(tmp_path, method={"rewards": [{"name": "reward_model", "options": {"batch_size": 3}}],
                                           "temperature": 1.0, **method}, train={"eval_every": 3})
    config["models"] = {"reward": {"path": str(tmp_path / "rm")}}
    config["data"]["validation"] = dict(config["data"]["train"])
    return config


# the tokenizer's pad id (4, its EOS too); none (transformers' default: a Llama 3 RM, scored at the last token,
# EOS included); one the tokenizer does not name: transformers pools by config.json's, so must posttune
@pytest.mark.parametrize("pad", [PAD, None, 5])
def test_completions_are_scored_as_transformers_scores_them(grpo_rm, tmp_path, pad):
    from posttune_grpo.method import batches

    session = compose_run(rm_run(tmp_path, pad))
    assert session.models["reward"].output.out_features == 1
    next(iter(batches(session)))
    rollouts = session.method_state.pending
    ours = rollouts.per_reward["reward_model"]
    assert torch.equal(rollouts.rewards, ours)  # the only reward, weight 1

    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    prompts = [row["prompt"] for row in prompt_rows(8)]
    expected = []
    for labels, row in zip(rollouts.labels, rollouts.rows.tolist(), strict=True):
        completion = tokenizer.decode(labels[labels != -100].tolist(), skip_special_tokens=True)
        messages = [{"role": "user", "content": prompts[row]}, {"role": "assistant", "content": completion}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        with torch.no_grad():
            expected.append(float(model(input_ids=torch.tensor([rendered])).logits[0, 0]))
    assert len(set(expected)) > 1  # completions told apart: equal scores would pass trivially
    torch.testing.assert_close(ours, torch.tensor(expected), atol=1e-5, rtol=0)


def test_a_grpo_run_with_a_reward_model_trains_and_logs_its_reward(grpo_rm, posttune_cli, tmp_path):
    config = rm_run(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in (Path(config["checkpoint"]["output_dir"]) / "metrics.jsonl").open()]
    assert len(records) == 3 and all(r["reward/reward_model"] == r["reward"] for r in records)
    assert records[-1]["val_reward/reward_model"] == records[-1]["val_reward"] != 0
    plan = posttune_cli("plan", str(path))
    assert plan.exit_code == 0 and "reward: frozen 'llama' model" in plan.stdout, plan.stdout


def test_a_reward_model_with_ray_generation_is_refused_in_one_line(grpo_rm, posttune_cli, tmp_path):
    config = rm_run(tmp_path, mode="async")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("validate", str(path))
    assert result.exit_code == 2 and "method.rewards[0].name" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_causal_lm_as_the_frozen_reward_model_is_refused(grpo_rm, posttune_cli, tmp_path):
    """Pointing `models.reward` at the SFT model, not the reward model's export: it has no trained score head,
    and the run would score completions with a random one."""
    config = rm_run(tmp_path)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "vocab_size": 384})).save_pretrained(
        tmp_path / "sft")
    config["models"]["reward"]["path"] = str(tmp_path / "sft")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("validate", str(path))
    assert (result.exit_code, result.stderr) == (2, f"posttune: error: config: models.reward.path: {tmp_path / 'sft'} "
                                                    "is a causal LM (LlamaForCausalLM), not a sequence classifier: a "
                                                    "frozen reward model scores with its trained head; point it at a "
                                                    "score model (a *ForSequenceClassification checkpoint)\n")


def test_the_reward_model_role_is_required(grpo_rm, posttune_cli, tmp_path):
    config = rm_run(tmp_path)
    del config["models"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("validate", str(path))
    assert result.exit_code == 2 and "reward" in result.stderr, result.stderr




def test_a_rows_tools_reach_the_reward_models_chat_template(tmp_path):
    """The conversation a reward model scores carries the row's ``tools`` (a JSON string here, as exports write
    them), as the policy's prompt did; placeholders and rows without tools render without."""
    from types import SimpleNamespace

    from posttune_grpo.model_reward import conversation_ids
    from posttune_grpo.rollouts import add_in_learner

    from posttune.tiny_tokenizer import save_tiny_tokenizer
    from posttune.tokenizer import load_tokenizer

    folder = save_tiny_tokenizer(tmp_path, template="chatml")
    ours, theirs = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    weather = {"type": "function", "function": {"name": "weather", "parameters": city}}
    prompts = {"prompts": ["Weather in Paris?", "Hello"], "fields": {"tools": [json.dumps([weather]), None]}}
    completions = [ours.encode(text, add_special_tokens=False) for text in ("sunny", "rain", "hi", "yo", "a", "b")]
    rendered = []

    def scorer(reward, row_prompts, texts, tools):
        rows = zip(row_prompts, texts, tools, strict=True)
        rendered.extend(conversation_ids(ours, prompt, text, tool) for prompt, text, tool in rows)
        return torch.ones(len(texts))

    reward = SimpleNamespace(name="reward_model", weight=1.0, in_learner=True)
    add_in_learner(ours, [reward], prompts, completions, 2, torch.tensor([1.0, 1, 1, 1, 0, 0]), torch.zeros(6), {},
                   scorer)  # the third group is a placeholder: scored with the first prompt, then zeroed
    texts = [ours.decode(c, skip_special_tokens=True) for c in completions]
    groups = [("Weather in Paris?", [weather]), ("Hello", None), ("Weather in Paris?", [weather])]
    for index, (ids, text) in enumerate(zip(rendered, texts, strict=True)):
        prompt, tools = groups[index // 2]
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
        assert ids == theirs.apply_chat_template(messages, tools=tools, return_dict=False)
    assert len(rendered[0]) > len(rendered[2]) + 20  # the tool's definition is in the first rendering


def test_a_reward_model_with_a_tokenizer_of_its_own_is_not_held_to_the_policys(grpo_rm, posttune_cli, tmp_path):
    """The reward model reads decoded completions through its own tokenizer (``ModelRole.own_tokenizer``): one
    whose ids name other tokens than the policy's (the chatml tiny tokenizer beside the demo's) is accepted, where
    a role reading the policy's ids would be refused (test_kd_training.py)."""
    from posttune.tiny_tokenizer import save_tiny_tokenizer

    config = rm_run(tmp_path)
    save_tiny_tokenizer(tmp_path / "rm", template="chatml")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("validate", str(path))
    assert result.exit_code == 0, result.stderr
