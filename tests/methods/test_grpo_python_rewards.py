"""Reward functions named by reference (``method.rewards: [my_rewards.py:brevity]``): TRL-style functions in the
user's own file, called by keyword, in the training process or isolated under a time limit, in a real run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml
from posttune.plugin import ConfigError
from run_support import grpo_config
from test_grpo_training import llama_grpo  # noqa: F401  (a fixture)

from posttune_grpo.scoring import RewardSpec, resolve_rewards, score

#: TRL's reward-function shape: keyword arguments, ``completions`` first, the rest in ``**kwargs``
REWARDS = '''
def brevity(completions, **kwargs):
    return [1.0 / (1 + len(text)) for text in completions]


def matches_answer(prompts, completions, answer, completion_ids, **kwargs):
    return [float(text.strip() == gold) + 0.0 * len(ids) for text, gold, ids in zip(completions, answer,
                                                                                   completion_ids)]


def trl_chat(completions, **kwargs):  # TRL's conversational example: completions as lists of messages
    return [float("<answer>" in completion[0]["content"]) for completion in completions]


def slow(completions, **kwargs):
    import time
    time.sleep(30)


async def async_brevity(completions, **kwargs):  # TRL awaits async reward functions
    return [1.0 / (1 + len(text)) for text in completions]


def scheduled(completions, trainer_state, **kwargs):  # TRL passes its TrainerState
    return [float(trainer_state.global_step > 10)] * len(completions)


def scheduled_or_not(completions, trainer_state=None, **kwargs):
    return [0.5] * len(completions)


def no_kwargs(completions):  # TRL passes prompts and completion_ids too: this cannot be called as it is
    return [0.0] * len(completions)


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def rewards_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
    return tmp_path / "my_rewards.py"


def test_functions_by_file_or_module_score_as_trl_calls_them(rewards_file):
    rewards = resolve_rewards([RewardSpec("my_rewards.py:brevity", weight=2.0),
                               RewardSpec("my_rewards:matches_answer")])
    assert [reward.name for reward in rewards] == ["brevity", "matches_answer"]
    scores = score(rewards, ["p", "p"], ["AB", " X "], {"answer": ["X", "X"]}, completion_ids=[[1, 2], [3]])
    assert scores.per_reward == {"brevity": [1 / 3, 1 / 4], "matches_answer": [0.0, 1.0]}
    assert scores.total == [pytest.approx(2 / 3), pytest.approx(2 / 4 + 1.0)]


def test_a_time_limit_isolates_the_function_in_worker_processes(rewards_file):
    rewards = resolve_rewards([RewardSpec("my_rewards.py:slow", timeout_s=0.5), RewardSpec("my_rewards.py:brevity",
                                                                                           timeout_s=5)])
    assert [reward.isolated for reward in rewards] == [True, True]
    scores = score(rewards, ["p"], ["AB"], {}, on_error="zero")
    assert scores.timeouts == {"slow": 1, "brevity": 0} and scores.per_reward["brevity"] == [1 / 3]


def _error(rewards: list, completions: list[str]) -> str:
    """The one-line error scoring ``completions`` (one prompt each) raises."""
    from posttune.plugin import PosttuneError

    with pytest.raises(PosttuneError) as failed:
        score(rewards, ["p"] * len(completions), completions, {})
    return str(failed.value)


@pytest.mark.parametrize("timeout_s", [None, 5])
def test_a_function_that_reads_trl_chat_messages_is_told_completions_are_text(rewards_file, timeout_s):
    """Indexing a string as TRL's messages fails on every completion: the error says what to read instead, not
    ``reward_errors: zero`` (which would score every completion 0 and train on nothing), in process and isolated."""
    message = _error(resolve_rewards([RewardSpec("my_rewards.py:trl_chat", timeout_s=timeout_s)]),
                     ["<answer>1</answer>"])
    assert "raised TypeError: string indices must be integers" in message
    assert message.endswith("completions are strings here, not TRL's chat messages [{'role': 'assistant', "
                            "'content': ...}]: read the text itself (docs/coming_from.md)")
    assert "reward_errors" not in message


@pytest.mark.parametrize("timeout_s", [None, 5])
def test_an_async_function_is_awaited(rewards_file, timeout_s):
    rewards = resolve_rewards([RewardSpec("my_rewards.py:async_brevity", timeout_s=timeout_s)])
    assert score(rewards, ["p", "p"], ["AB", "X"], {}).per_reward == {"async_brevity": [1 / 3, 1 / 2]}


def test_a_function_that_needs_trl_s_trainer_state_is_refused_before_launch(rewards_file):
    with pytest.raises(ConfigError) as error:
        resolve_rewards([RewardSpec("my_rewards.py:scheduled")])
    assert str(error.value) == ("config: method.rewards[0].name: scheduled requires 'trainer_state', which TRL "
                                "passes and posttune does not; give it a default (trainer_state=None) to run here")
    assert score(resolve_rewards([RewardSpec("my_rewards.py:scheduled_or_not")]), ["p"], ["A"], {}).total == [0.5]


def test_a_call_that_does_not_fit_says_how_rewards_are_called_and_all_failures_warn(rewards_file, capsys):
    """A signature that cannot take the call fails every completion alike: the error says how the function is
    called, not ``reward_errors: zero``; with ``zero`` anyway, a batch where it failed for every completion warns
    (once), since it then scores nothing to learn from."""
    rewards = resolve_rewards([RewardSpec("my_rewards.py:no_kwargs")])
    message = _error(rewards, ["A"])
    assert "raised TypeError: no_kwargs() got an unexpected keyword argument" in message
    assert message.endswith("it is called as fn(prompts=, completions=, completion_ids=, **the row's fields), by "
                            "keyword: take **kwargs for the fields it does not read")
    for _ in range(2):
        assert score(rewards, ["p", "p"], ["A", "B"], {}, on_error="zero").failures == {"no_kwargs": 2}
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("posttune: warning:")]
    assert warnings == ["posttune: warning: reward 'no_kwargs' (Python function my_rewards.py:no_kwargs) failed for "
                        "all 2 completions of a batch (scored 0, counted in reward_failures/no_kwargs); check it "
                        "against its first error with method.reward_errors: raise"]


@pytest.mark.parametrize(("name", "problem"), [
    ("missing.py:brevity", "method.rewards[0].name: no file {cwd}/missing.py"),
    ("no_such_module:brevity", "method.rewards[0].name: cannot import module 'no_such_module' "
                               "(ModuleNotFoundError: No module named 'no_such_module')"),
    ("my_rewards.py:nothing", "method.rewards[0].name: my_rewards.py has no function 'nothing'"),
    ("my_rewards.py:NOT_A_FUNCTION", "method.rewards[0].name: my_rewards.py has no function 'NOT_A_FUNCTION'"),
    ("my_rewards.py:", "method.rewards[0].name: 'my_rewards.py:' is not a Python function's reference: write "
                       "path/to/file.py:function or module:function"),
])
def test_a_bad_reference_is_one_line_before_launch(rewards_file, name, problem):
    with pytest.raises(ConfigError) as error:
        resolve_rewards([RewardSpec(name)])
    assert str(error.value) == "config: " + problem.format(cwd=rewards_file.parent)


def test_a_run_in_the_same_process_scores_with_the_function_as_it_is_then(rewards_file, monkeypatch):
    """A notebook's next cell: an edited file, or a function of the script (``__main__``) defined again, is what the
    next resolution scores with (a process-wide cache kept the first before); a resolved reward keeps its version."""
    import sys
    import types

    first = resolve_rewards([RewardSpec("my_rewards.py:brevity")])
    rewards_file.write_text(rewards_file.read_text().replace("1.0 / (1 + len(text))", "0.75"))
    assert score(resolve_rewards([RewardSpec("my_rewards.py:brevity")]), ["p"], ["AB"], {}).total == [0.75]
    assert score(first, ["p"], ["AB"], {}).total == [pytest.approx(1 / 3)]  # bound when resolved
    script = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", script)
    for value in (0.25, 0.5):
        exec(f"def score(completions, **kwargs):\n    return [{value}] * len(completions)\n", script.__dict__)
        assert score(resolve_rewards([RewardSpec("__main__:score")]), ["p"], ["AB"], {}).total == [value]
    with pytest.raises(ConfigError) as error:  # a worker process's __main__ is not the script
        resolve_rewards([RewardSpec("__main__:score", timeout_s=5)])
    assert str(error.value) == ("config: method.rewards[0].name: '__main__:score' is isolated by its time limit, so "
                                "it runs in worker processes, whose __main__ is not this script; put the function in "
                                "a file (file.py:function) or a module")


def test_a_script_function_is_refused_in_ray_modes_before_launch(llama_grpo, rewards_file, tmp_path,  # noqa: F811
                                                                  monkeypatch):
    """Ray's reward actors import a reference in their own process, whose __main__ is not the script."""
    import sys
    import types

    import posttune

    script = types.ModuleType("__main__")
    exec("def score(completions, **kwargs):\n    return [0.5] * len(completions)\n", script.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", script)
    config = grpo_config(tmp_path, method={"rewards": ["__main__:score"], "mode": "async"})
    with pytest.raises(ConfigError) as error:
        posttune.train(config)
    assert str(error.value) == ("config: method.rewards[0].name: '__main__:score' is a function of this script, "
                                "which Ray's reward actors cannot import; put it in a file (file.py:function) or a "
                                "module")


def test_options_and_two_functions_of_one_name_are_refused(rewards_file, tmp_path):
    with pytest.raises(ConfigError, match=r"method.rewards\[0\].options: the Python function 'my_rewards.py:brevity' "
                                          "takes no options"):
        resolve_rewards([RewardSpec("my_rewards.py:brevity", options={"x": 1})])
    (tmp_path / "other.py").write_text("def brevity(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ConfigError) as error:
        resolve_rewards([RewardSpec("my_rewards.py:brevity"), RewardSpec("other.py:brevity")])
    assert str(error.value) == ("config: method.rewards[1].name: 'other.py:brevity' is logged as reward/brevity, as "
                                "method.rewards[0] is; rename one of the functions")


def test_a_run_trains_on_a_function_from_a_file(llama_grpo, posttune_cli, rewards_file, tmp_path):  # noqa: F811
    """A lone reference in the rewards list, as TRL's reward_funcs: the run logs its reward under its name."""
    config = grpo_config(tmp_path / "run", method={"rewards": ["my_rewards.py:brevity",
                                                                {"name": "my_rewards.py:matches_answer",
                                                                 "timeout_s": 5}]},
                         train={"max_steps": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in (Path(config["checkpoint"]["output_dir"]) / "metrics.jsonl")
               .read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert 0 < record["reward/brevity"] <= 1 and record["reward/matches_answer"] >= 0


def test_a_ray_reward_actor_reads_references_from_the_learner_s_directory(rewards_file, tmp_path, monkeypatch):
    """A Ray worker may start in another directory: the actor's spec carries the learner's, and its rewards are
    read from there (RewardActor built here, without Ray)."""
    from run_support import TOKENIZER

    from posttune_grpo.ray_workers import RewardActor

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = {"tokenizer": TOKENIZER, "cwd": str(rewards_file.parent),
            "rewards": [{"name": "my_rewards.py:brevity", "weight": 1.0, "options": {}, "timeout_s": None,
                         "budget_s": None}]}
    actor = RewardActor(spec)
    assert [reward.name for reward in actor.rewards] == ["brevity"]
    assert actor.rewards[0](["p"], ["AB"]) == [1 / 3]


def test_a_resume_warns_when_a_reward_file_changed_since_the_checkpoint(llama_grpo, posttune_cli,  # noqa: F811
                                                                        rewards_file, tmp_path):
    """The checkpoint records the file's sha256: the same file resumes quietly, an edited one (a reward fixed
    mid-run) with one warning naming it; a module reference has no file to compare."""
    config = grpo_config(tmp_path / "run", method={"rewards": ["my_rewards.py:brevity", "my_rewards:matches_answer"]},
                         train={"max_steps": 1}, checkpoint={"save_every": 1})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert posttune_cli("train", str(path)).exit_code == 0
    same = posttune_cli("train", str(path), "train.max_steps=2", "checkpoint.resume=latest")
    assert same.exit_code == 0, same.stderr
    assert "warning: method.rewards" not in same.stderr
    rewards_file.write_text(rewards_file.read_text() + "\n# brevity: fixed\n")
    edited = posttune_cli("train", str(path), "train.max_steps=3", "checkpoint.resume=latest")
    assert edited.exit_code == 0, edited.stderr
    warnings = [line for line in edited.stderr.splitlines() if line.startswith("posttune: warning: method.rewards")]
    assert len(warnings) == 1
    assert warnings[0].startswith("posttune: warning: method.rewards: my_rewards.py has changed since the checkpoint "
                                  "was written (sha256 ")
    assert warnings[0].endswith("now): the resumed run scores with the file as it is now")


def test_a_resume_warns_only_for_files_that_changed_not_for_ones_added_since(capsys):
    """A reward file the checkpoint did not record (added to method.rewards since) has nothing to differ from: no
    warning, and no crash reading its missing digest; a changed one is one line naming it."""
    from posttune_grpo.python_rewards import warn_changed_files

    warn_changed_files({"old.py": "a" * 64}, {"old.py": "a" * 64, "new.py": "b" * 64})
    assert capsys.readouterr().err == ""
    warn_changed_files({"old.py": "a" * 64}, {"old.py": "c" * 64})
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("posttune: warning: method.rewards: old.py has changed since")
