"""The row fields the built-in rewards read (``answer``): a dataset whose column has another name is refused
by ``validate`` naming the reward, the field, the file and the column_map that fixes it; at run time, a
batch without the field says the same (not ``reward_errors: zero``), and a row without it is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import posttune_grpo
import posttune_llama
import posttune_generate
import posttune_lora
import posttune_ppo
import pytest
import yaml
from posttune.plugin import PosttuneError
from reward_support import RewardPlugin
from run_support import grpo_config, prompt_rows

from posttune_grpo.rewards import REWARDS, exact_answer, math_answer
from posttune_grpo.scoring import RewardSpec, resolve_rewards, score

CONTINUE = "set method.reward_errors: zero"


@pytest.fixture
def llama_grpo(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")


@pytest.fixture
def grpo_rewards(register_plugin):
    register_plugin(RewardPlugin(*REWARDS), name="grpo", distribution="posttune-grpo", version="0.1.0")


def solution_rows(count: int) -> list[dict]:
    """Rows whose answer is in a column called ``solution``."""
    return [{"prompt": row["prompt"], "solution": row["answer"]} for row in prompt_rows(count)]


def with_rows(config: dict, rows: list[dict], name: str = "train.jsonl") -> dict:
    """``config`` reading ``rows`` from ``name`` beside its default data file."""
    path = Path(config["data"]["train"]["path"]).with_name(name)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config["data"]["train"]["path"] = str(path)
    return config


def cli(posttune_cli, tmp_path: Path, command: str, config: dict):
    path = tmp_path / f"{command}.yaml"
    path.write_text(yaml.safe_dump(config))
    return posttune_cli(command, str(path))


def error_line(result) -> str:
    errors = [line for line in result.stderr.splitlines() if "posttune: error:" in line]
    assert result.exit_code == 2 and len(errors) == 1, result.stderr
    return errors[0].split("posttune: error: ", 1)[1]


# ---------------------------------------------------------------------------------------------
# before launch: validate peeks at the first row of a local .jsonl
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rewards, index, name", [
    ([{"name": "exact_answer"}], 0, "exact_answer"),
    ([{"name": "format", "weight": 0.2}, {"name": "math_answer"}], 1, "math_answer"),
    (["format", "math_answer"], 1, "math_answer"),  # lone names, as TRL's reward_funcs lists them: weight 1
])
def test_validate_refuses_a_first_row_without_the_answer_field(llama_grpo, posttune_cli, tmp_path, rewards, index,
                                                                name):
    config = with_rows(grpo_config(tmp_path, method={"rewards": rewards}), solution_rows(8))
    path = config["data"]["train"]["path"]
    assert error_line(cli(posttune_cli, tmp_path, "validate", config)) == (
        f"config: method.rewards[{index}]: reward '{name}' reads each row's 'answer' field, and the first row of "
        f"{path} has no 'answer'; its fields: 'prompt', 'solution'; map the column that holds it with "
        "data.train.column_map: {answer: <column>}")


def test_the_column_map_the_error_suggests_makes_the_config_valid(llama_grpo, posttune_cli, tmp_path):
    config = with_rows(grpo_config(tmp_path), solution_rows(8))
    config["data"]["train"]["column_map"] = {"answer": "solution"}
    result = cli(posttune_cli, tmp_path, "validate", config)
    assert result.exit_code == 0, result.stderr


def test_validate_names_a_mapped_column_the_first_row_lacks(llama_grpo, posttune_cli, tmp_path):
    config = with_rows(grpo_config(tmp_path), solution_rows(8))
    config["data"]["train"]["column_map"] = {"answer": "soln"}
    assert "has no 'soln' (the column data.train.column_map maps to 'answer')" in error_line(
        cli(posttune_cli, tmp_path, "validate", config))


def test_validate_refuses_a_null_answer_and_checks_the_validation_data_too(llama_grpo, posttune_cli, tmp_path):
    config = grpo_config(tmp_path)
    validation = tmp_path / "validation.jsonl"
    validation.write_text(json.dumps({"prompt": "Reverse: ABC", "answer": None}) + "\n")
    config["data"]["validation"] = {"path": str(validation), "format": "prompt"}
    message = error_line(cli(posttune_cli, tmp_path, "validate", config))
    assert message.startswith(f"config: method.rewards[0]: reward 'exact_answer' reads each row's 'answer' field, "
                              f"and the first row of {validation} has 'answer': null;")
    assert message.endswith("data.validation.column_map: {answer: <column>}")


def test_ppo_validate_refuses_it_too(register_plugin, posttune_cli, tmp_path):
    for plugin, distribution in ((posttune_llama, "posttune-llama"), (posttune_grpo, "posttune-grpo"),
                                 (posttune_ppo, "posttune-ppo")):
        register_plugin(plugin, distribution=distribution, version="0.1.0")
    config = with_rows(grpo_config(tmp_path, method={"name": "ppo", "group_size": 1}), solution_rows(8))
    assert error_line(cli(posttune_cli, tmp_path, "validate", config)).startswith(
        "config: method.rewards[0]: reward 'exact_answer' reads each row's 'answer' field")


# ---------------------------------------------------------------------------------------------
# at run time: data validate cannot peek at (here a .json file), and a row without the field
# ---------------------------------------------------------------------------------------------


def test_a_run_whose_rows_lack_the_field_suggests_the_column_map_not_reward_errors(llama_grpo, posttune_cli,
                                                                                  tmp_path):
    config = with_rows(grpo_config(tmp_path, train={"max_steps": 1}), solution_rows(8), "train.json")
    assert cli(posttune_cli, tmp_path, "validate", config).exit_code == 0  # only a .jsonl's first row is read
    assert error_line(cli(posttune_cli, tmp_path, "train", config)) == (
        "reward 'exact_answer' (posttune-grpo 0.1.0) needs an 'answer' field in each dataset row (the rows have "
        "'solution'); map your dataset's column to it with data.train.column_map: {answer: <column>}")


def test_a_row_without_the_field_mid_run_is_named_with_the_field(llama_grpo, posttune_cli, tmp_path):
    rows = prompt_rows(2)
    del rows[1]["answer"]
    config = with_rows(grpo_config(tmp_path, train={"max_steps": 1}), rows)
    message = error_line(cli(posttune_cli, tmp_path, "train", config))
    assert re.fullmatch(r"reward 'exact_answer' \(posttune-grpo 0\.1\.0\) returned None \(cannot score\) for "
                        r"completion [04] \(4 of 8 in this batch\): dataset row 1 has no 'answer'; "
                        + re.escape(CONTINUE) + ".*", message), message


# ---------------------------------------------------------------------------------------------
# score, and the reward functions called directly
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["exact_answer", "math_answer"])
def test_score_without_the_field_is_a_configuration_error_or_counted_with_zero(grpo_rewards, name):
    rewards = resolve_rewards([RewardSpec(name)])
    with pytest.raises(PosttuneError) as exc:
        score(rewards, ["q"] * 2, ["a", "b"], {"solution": ["a", "b"]})
    message = str(exc.value)
    assert "data.train.column_map: {answer: <column>}" in message and "reward_errors" not in message
    result = score(rewards, ["q"] * 2, ["a", "b"], {"solution": ["a", "b"]}, on_error="zero")
    assert result.total == [0.0, 0.0] and result.failures == {name: 2}


def test_score_names_the_row_that_lacks_the_field(grpo_rewards):
    rewards = resolve_rewards([RewardSpec("exact_answer")])
    with pytest.raises(PosttuneError, match=r"for completion 1 \(1 of 2 in this batch\): dataset row 7 has no "
                                            r"'answer'; set method\.reward_errors: zero"):
        score(rewards, ["q"] * 2, ["a", "b"], {"answer": ["a", None]}, rows=[3, 7])


@pytest.mark.parametrize("fn", [exact_answer, math_answer])
def test_the_rewards_called_without_the_field_suggest_the_column_map(fn):
    with pytest.raises(PosttuneError) as exc:
        fn(["q"], ["72"], solution=["72"])
    assert str(exc.value) == (f"reward '{fn.__name__}' needs an 'answer' field in each dataset row; map your "
                              "dataset's column to it with data.train.column_map: {answer: <column>}")
