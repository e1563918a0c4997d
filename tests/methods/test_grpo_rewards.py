"""posttune-grpo's reward functions (math_answer, format, length) and how a run combines them.

The math_answer table pins what math-verify decides, borderline forms included: a row that
surprises a user documents the library's behaviour, it is not a bug to special-case.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from posttune.plugin import ConfigError, PosttuneError, RewardFunction, registered
from posttune_grpo import rewards as r
from reward_support import RewardPlugin
from posttune_grpo.rewards import REWARDS, FormatOptions, LengthOptions, format_reward, length_reward, math_answer
from posttune_grpo.scoring import RewardSpec, resolve_rewards, score


@pytest.fixture
def grpo_rewards(register_plugin):
    """posttune-grpo's rewards registered in the test's isolated plugin set."""
    register_plugin(RewardPlugin(*REWARDS), name="grpo", distribution="posttune-grpo", version="0.1.0")


@pytest.fixture
def toy_rewards(register_plugin, grpo_rewards):
    """Rewards that misbehave on purpose, next to the real ones."""

    def half(prompts, completions, **_):
        return [0.5] * len(completions)

    def none_for_empty(prompts, completions, **_):
        return [None if not c else 1.0 for c in completions]

    def broken(prompts, completions, **_):
        raise ValueError("no 'tests' field in this row\nsecond line of detail")

    def short(prompts, completions, **_):
        return [1.0]

    def text(prompts, completions, **_):
        return ["1.0" for _ in completions]

    def nan(prompts, completions, **_):
        return [float("nan") for _ in completions]

    def flag(prompts, completions, **_):  # a comparison's result, not a score: True is no 1.0 here
        return [c == "a" for c in completions]

    register_plugin(RewardPlugin(*(RewardFunction(fn.__name__, fn) for fn in (half, none_for_empty, broken,
                                                                               short, text, nan, flag))),
                    name="toys", distribution="toy-rewards", version="1.0")


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def resolved(*specs: RewardSpec):
    return resolve_rewards(list(specs))


# ---------------------------------------------------------------------------------------------
# math_answer
# ---------------------------------------------------------------------------------------------

GSM8K_GOLD = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
              "altogether in April and May.\n#### 72")

#: (completion, gold answer, score): what math-verify 0.9 decides, as math_answer feeds it
MATH_TABLE = [
    # plain numbers: the last number of the completion
    ("She sold 48 + 24 = 72 clips.", "72", 1.0),
    ("She sold 48 + 24 = 72 clips.", GSM8K_GOLD, 1.0),  # GSM8K: the gold after the last ####
    ("So the answer is 72.\n\nAnother example: 5", "72", 1.0),  # "answer is" beats the last number
    ("I first got 71, then 73.", "72", 0.0),
    ("\\boxed{72.0}", "72", 1.0),
    # \boxed{} and <answer> tags
    ("48 + 24 = 72, so the total is \\boxed{72}. Checking: 73 is wrong", GSM8K_GOLD, 1.0),
    ("<think>48 + 24</think>\n<answer>72</answer>", "72", 1.0),
    ("<think>72?</think><answer>71</answer> 72", "72", 0.0),  # the tag is the answer, not the last number
    ("<answer>The answer is \\frac{1}{2}</answer>", "0.5", 1.0),  # prose inside the tag
    # fractions, LaTeX, decimals
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("The answer is 0.5", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),
    ("\\boxed{1.5}", "\\frac{3}{2}", 1.0),
    ("1/3 is about 0.333", "\\frac{1}{3}", 0.0),  # borderline: floats compare rounded to 6 places
    ("\\boxed{0.3333333}", "1/3", 1.0),  # ... so 7 digits of 1/3 are equal to it
    # roots, constants, expressions
    ("<answer>2\\sqrt{2}</answer>", "\\sqrt{8}", 1.0),  # a bare LaTeX gold and tag are read whole
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{1.414}", "\\sqrt{2}", 0.0),  # borderline: an approximation to 3 places is not sqrt(2)
    ("\\boxed{1.41421356}", "\\sqrt{2}", 1.0),  # ... to 8 places it is (numeric comparison)
    ("\\boxed{x^2 + 1}", "1 + x^2", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    # negative numbers
    ("\\boxed{-3}", "-3", 1.0),
    ("so x = -3", "-3", 1.0),
    ("so x = 3", "-3", 0.0),
    # thousands separators
    ("The total is 1,000 dollars.", "1000", 1.0),
    ("\\boxed{1,000}", "#### 1000", 1.0),
    ("The total is 1 000.", "1,000", 1.0),
    ("\\boxed{1\\,000}", "1000", 0.0),  # borderline: a LaTeX thin space is read as 1 * 000
    # units and currency
    ("It costs $18.", "18", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("It costs 18 dollars.", "18", 1.0),
    ("\\boxed{18 \\text{ cm}}", "18", 1.0),
    ("<answer>18 cm</answer>", "18", 1.0),
    ("<answer>71</answer> no, <answer>72</answer>", "72", 1.0),  # the last <answer>, as the docstring says
    ("\\boxed{18 dollars}", "18", 0.0),  # borderline: a bare word inside \boxed{} is read as symbols
    # percentages: math-verify accepts 25% as 25 and as 0.25
    ("\\boxed{25\\%}", "0.25", 1.0),
    ("The answer is 25%.", "25", 1.0),
    ("The answer is 25.", "25%", 1.0),  # borderline: a missing percent sign is not wrong
    ("The answer is 0.25.", "25%", 1.0),
    # a trailing period inside the box
    ("\\boxed{72.}", "72", 0.0),  # borderline: "72." does not parse
    # text answers (math-verify reads words as products of symbols)
    ("\\boxed{\\text{Monday}}", "Monday", 1.0),
    # no answer in the completion: 0.0
    ("", "72", 0.0),
    ("I don't know.", "72", 0.0),
    ("<answer></answer>", "72", 0.0),
    # a gold answer that cannot be parsed: None
    ("72", "", None),
    ("72", "####", None),
    ("72", "\\frac{", None),
    ("72", None, None),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), MATH_TABLE)
def test_math_answer_table(completion, gold, expected):
    assert math_answer(["q"], [completion], answer=[gold]) == [expected]


def test_math_answer_in_worker_processes_scores_the_table_as_when_called_here(grpo_rewards):
    (isolated,) = resolved(RewardSpec("math_answer"))
    assert isolated.isolated
    completions, golds, expected = (list(column) for column in zip(*MATH_TABLE))
    result = score([isolated], ["q"] * len(completions), completions, {"answer": golds}, on_error="zero")
    assert result.per_reward["math_answer"] == [0.0 if value is None else value for value in expected]
    assert result.failures == {"math_answer": expected.count(None)} and result.timeouts == {"math_answer": 0}


@pytest.mark.parametrize(("completion", "gold", "expected"), [
    ("abc", "abc", 1.0), (" abc\n", "abc", 1.0), ("abc", " abc ", 1.0), ("ab c", "abc", 0.0), ("ABC", "abc", 0.0)])
def test_exact_answer_compares_the_stripped_texts(completion, gold, expected):
    """Whitespace around either side does not count (a completion ending in a newline is right), anything else
    does: the case, a space inside."""
    from posttune_grpo.rewards import exact_answer

    assert exact_answer(["q"], [completion], answer=[gold]) == [expected]


def test_math_answer_scores_a_group_against_its_gold():
    completions = ["\\boxed{72}", "72 clips", "<answer>70</answer>", "no idea"]
    assert math_answer(["q"] * 4, completions, answer=[GSM8K_GOLD] * 4, completion_ids=[[1]] * 4,
                       question=["..."] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_math_answer_works_off_the_main_thread():
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(math_answer, ["q"], ["\\boxed{\\frac{1}{2}}"], answer=["0.5"]).result()
    assert result == [1.0]


def test_math_answer_without_an_answer_field_says_which_field():
    with pytest.raises(PosttuneError, match="needs an 'answer' field"):
        math_answer(["q"], ["72"], solution=["72"])


def test_importing_the_rewards_imports_neither_torch_nor_math_verify():
    package_root = Path(r.__file__).resolve().parents[1]
    code = ("import sys; import posttune_grpo.rewards; "
            "print(sorted(m for m in ('torch', 'math_verify', 'sympy') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# format
# ---------------------------------------------------------------------------------------------


def test_format_default_wants_think_then_answer_tags():
    completions = [
        "<think>48 + 24\n= 72</think>\n<answer>72</answer>",
        "<think></think><answer></answer>",
        "<answer>72</answer>",
        "<think>x</think><answer>72</answer> and more",  # the whole completion must match
        "Sure! <think>x</think><answer>72</answer>",
    ]
    assert format_reward(["q"] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_format_with_a_custom_pattern(grpo_rewards):
    (fmt,) = resolved(RewardSpec("format", options={"pattern": r".*\\boxed\{.+\}\s*"}))
    assert fmt.options == FormatOptions(r".*\\boxed\{.+\}\s*")
    result = score([fmt], ["q"] * 3, ["so\n\\boxed{4}\n", "\\boxed{}", "4"], {})
    assert result.per_reward["format"] == [1.0, 0.0, 0.0]


def test_format_refuses_an_invalid_regex_before_scoring(grpo_rewards):
    with pytest.raises(ConfigError) as exc:
        resolved(RewardSpec("math_answer"), RewardSpec("format", options={"pattern": "<think>(.*</think>"}))
    assert one_line(exc).startswith("config: method.rewards[1].options.pattern: not a valid regular expression")


# ---------------------------------------------------------------------------------------------
# length: DAPO's soft overlong punishment
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "expected"), [
    (0, 0.0), (768, 0.0),  # up to max_length - buffer: nothing
    (769, -1 / 256), (800, -0.125), (896, -0.5), (1023, -255 / 256),  # inside the buffer: linear
    (1024, -1.0), (1025, -1.0), (5000, -1.0),  # at and past max_length: the full penalty
])
def test_length_defaults(tokens, expected):
    assert length_reward(["q"], ["c"], completion_ids=[[7] * tokens]) == [expected]


def test_length_scales_with_its_options():
    options = LengthOptions(max_length=8, buffer=4, penalty=0.5)
    ids = [[1] * n for n in (3, 4, 5, 6, 8, 9)]
    assert length_reward(["q"] * 6, ["c"] * 6, completion_ids=ids, reward_options=options) == \
        [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


def test_length_counts_tokens_not_characters():
    assert length_reward(["q"], ["a long completion"], completion_ids=[[1, 2]],
                         reward_options=LengthOptions(max_length=3, buffer=1)) == [0.0]


def test_length_needs_completion_ids():
    with pytest.raises(PosttuneError, match="completion_ids"):
        length_reward(["q"], ["c"])


@pytest.mark.parametrize(("options", "message"), [
    ({"max_length": 0}, "method.rewards[0].options.max_length: expected a positive integer, got 0"),
    ({"buffer": 0}, "method.rewards[0].options.buffer: expected a positive integer, got 0"),
    ({"max_length": 100, "buffer": 200}, "method.rewards[0].options.buffer: must be at most max_length (100), got 200"),
    ({"penalty": -1}, "method.rewards[0].options.penalty: expected a positive number, got -1.0"),
    ({"penalty": 0}, "method.rewards[0].options.penalty: expected a positive number, got 0.0"),  # a no-op reward
    ({"max_length": "long"}, "method.rewards[0].options.max_length: expected an integer, got 'long'"),
    ({"buffer": True}, "method.rewards[0].options.buffer: expected an integer, got true"),
    ({"penalty": "1"}, "method.rewards[0].options.penalty: expected a number, got '1'"),
])
def test_length_refuses_bad_options(grpo_rewards, options, message):
    with pytest.raises(ConfigError) as exc:
        resolved(RewardSpec("length", options=options))
    assert one_line(exc) == f"config: {message}"


def test_length_buffer_may_be_all_of_max_length(grpo_rewards):
    """buffer == max_length is allowed ("at most max_length"): the penalty grows from the first token."""
    (length,) = resolved(RewardSpec("length", options={"max_length": 4, "buffer": 4, "penalty": 2}))
    tokens = [0, 1, 3, 4, 9]
    values = length(["q"] * 5, ["c"] * 5, completion_ids=[[7] * n for n in tokens])
    assert values == [-2 * min(n, 4) / 4 for n in tokens]  # -penalty * (tokens - 0) / buffer, capped at -penalty


def test_length_options_convert_yaml_numbers(grpo_rewards):
    (length,) = resolved(RewardSpec("length", options={"max_length": 512.0, "buffer": 64, "penalty": 2}))
    assert length.options == LengthOptions(512, 64, 2.0)


# ---------------------------------------------------------------------------------------------
# score: weights, per-reward values, failures
# ---------------------------------------------------------------------------------------------


def test_score_sums_weighted_rewards_and_keeps_each(grpo_rewards):
    rewards = resolved(RewardSpec("math_answer"), RewardSpec("format", weight=0.5),
                       RewardSpec("length", weight=2.0, options={"max_length": 8, "buffer": 4}))
    completions = ["<think>48+24</think><answer>72</answer>", "\\boxed{72}", "<think>hm</think><answer>7</answer>"]
    ids = [[1] * 3, [1] * 6, [1] * 9]
    result = score(rewards, ["q"] * 3, completions, {"answer": ["72"] * 3}, completion_ids=ids)
    assert result.per_reward == {"math_answer": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0],
                                 "length": [0.0, -0.5, -1.0]}
    assert result.total == [1.5, 0.0, -1.5]
    assert result.failures == {"math_answer": 0, "format": 0, "length": 0}


def test_score_batch_gives_each_completion_its_prompt_s_fields_and_leaves_placeholders_unscored(grpo_rewards):
    """A rollout batch: ``group`` completions per prompt, each scored against its own prompt's row; a placeholder
    (``real`` 0) scores 0 and is never shown to a reward, even when its text would be right."""
    from posttune_grpo.scoring import score_batch

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    texts, real = ["ab", "ab", "x", "cd"], [1, 0, 1, 1]
    golds = ["ab", "cd"]  # prompt j's answer; completion i belongs to prompt i // 2
    prompts = {"prompts": ["p0", "p1"], "fields": {"answer": golds}}
    result = score_batch(Chars(), resolved(RewardSpec("exact_answer")), "raise", prompts,
                         [[ord(c) for c in text] for text in texts], real, 2)
    expected = [float(bool(flag) and text == golds[i // 2]) for i, (text, flag) in enumerate(zip(texts, real))]
    assert result.total == result.per_reward["exact_answer"] == expected == [1.0, 0.0, 0.0, 1.0]
    assert result.failures == {"exact_answer": 0}


def test_score_passes_row_fields_and_ignores_unused_ones(grpo_rewards):
    rewards = resolved(RewardSpec("math_answer"))
    fields = {"answer": ["1/2", "3"], "question": ["a", "b"], "level": [1, 5]}
    assert score(rewards, ["a", "b"], ["\\boxed{0.5}", "\\boxed{4}"], fields).total == [1.0, 0.0]


def test_none_is_a_one_line_error_naming_the_reward(toy_rewards):
    rewards = resolved(RewardSpec("half"), RewardSpec("none_for_empty"))
    with pytest.raises(PosttuneError) as exc:
        score(rewards, ["q"] * 3, ["a", "", "c"], {})
    message = one_line(exc)
    assert message.startswith(f"reward 'none_for_empty' ({rewards[1].provider}) returned None (cannot score) "
                              "for completion 1 (1 of 3 in this batch)")
    assert message.endswith("set method.reward_errors: zero to score such completions 0 and count them")


def test_none_scores_zero_and_is_counted_with_reward_errors_zero(toy_rewards):
    rewards = resolved(RewardSpec("half"), RewardSpec("none_for_empty", weight=2.0))
    result = score(rewards, ["q"] * 3, ["a", "", "c"], {}, on_error="zero")
    assert result.per_reward["none_for_empty"] == [1.0, 0.0, 1.0]
    assert result.total == [2.5, 0.5, 2.5]
    assert result.failures == {"half": 0, "none_for_empty": 1}


def test_an_ungradable_gold_is_a_failure_of_math_answer(grpo_rewards):
    rewards = resolved(RewardSpec("math_answer"))
    with pytest.raises(PosttuneError, match=r"reward 'math_answer' \(.*\) returned None"):
        score(rewards, ["q"], ["72"], {"answer": ["####"]})
    assert score(rewards, ["q"], ["72"], {"answer": ["####"]}, on_error="zero").failures == {"math_answer": 1}


def test_a_raising_reward_is_a_one_line_error_naming_it(toy_rewards):
    rewards = resolved(RewardSpec("broken"))
    with pytest.raises(PosttuneError) as exc:
        score(rewards, ["q"] * 2, ["a", "b"], {})
    assert one_line(exc) == (f"reward 'broken' ({rewards[0].provider}) raised ValueError: no 'tests' field in "
                             "this row; set method.reward_errors: zero to score such completions 0 and count them")
    assert isinstance(exc.value.__cause__, ValueError)


def test_a_raising_reward_fails_every_completion_of_the_call_with_reward_errors_zero(toy_rewards):
    rewards = resolved(RewardSpec("half"), RewardSpec("broken"))
    result = score(rewards, ["q"] * 2, ["a", "b"], {}, on_error="zero")
    assert result.total == [0.5, 0.5]
    assert result.per_reward["broken"] == [0.0, 0.0]
    assert result.failures["broken"] == 2


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_result_of_the_wrong_length_is_refused(toy_rewards, on_error):
    rewards = resolved(RewardSpec("short"))
    with pytest.raises(PosttuneError) as exc:
        score(rewards, ["q"] * 3, ["a", "b", "c"], {}, on_error=on_error)
    assert "reward 'short' (" in one_line(exc)
    assert "returned 1 values for 3 completions" in str(exc.value)


@pytest.mark.parametrize(("name", "shown"), [("text", "'1.0', not a finite number"),
                                             ("nan", "nan, not a finite number"),
                                             ("flag", "True, not a finite number")])
def test_a_value_that_is_not_a_finite_number_is_refused(toy_rewards, name, shown):
    rewards = resolved(RewardSpec(name))
    with pytest.raises(PosttuneError) as exc:
        score(rewards, ["q"], ["a"], {})
    assert f"reward '{name}' ({rewards[0].provider}) returned {shown} for completion 0" in one_line(exc)
    assert score(rewards, ["q"], ["a"], {}, on_error="zero").failures == {name: 1}


def test_score_refuses_fields_of_another_length(grpo_rewards):
    with pytest.raises(ValueError, match="answer holds 1 values for 2 completions"):
        score(resolved(RewardSpec("math_answer")), ["q", "q"], ["1", "2"], {"answer": ["1"]})


def test_the_provider_is_the_installed_distribution(grpo_rewards):
    try:
        version = importlib.metadata.version("posttune-grpo")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("posttune-grpo is not installed (its module is named instead)")
    assert resolved(RewardSpec("math_answer"))[0].provider == f"posttune-grpo {version}"


# ---------------------------------------------------------------------------------------------
# resolve_rewards: every mistake in method.rewards is one line, before launch
# ---------------------------------------------------------------------------------------------


def test_the_rewards_are_registered(grpo_rewards):
    assert {"math_answer", "format", "length"} <= set(registered("reward_function"))


def test_resolve_keeps_order_weights_and_default_options(grpo_rewards):
    rewards = resolved(RewardSpec("length"), RewardSpec("math_answer", weight=2))
    assert [(x.name, x.weight, x.options) for x in rewards] == [("length", 1.0, LengthOptions()),
                                                                ("math_answer", 2.0, None)]


def test_an_unknown_name_lists_the_installed_ones_and_suggests_one(grpo_rewards):
    with pytest.raises(ConfigError) as exc:
        resolved(RewardSpec("format"), RewardSpec("math_anwser"))
    message = one_line(exc)
    assert message.startswith("config: method.rewards[1].name: no reward function 'math_anwser' is installed")
    assert "format, length, math_answer" in message
    assert message.endswith("(did you mean 'math_answer'?)")


def test_an_unknown_option_is_named_with_a_suggestion(grpo_rewards):
    with pytest.raises(ConfigError) as exc:
        resolved(RewardSpec("length", options={"max_len": 10}))
    assert one_line(exc) == "config: method.rewards[0].options.max_len: unknown key (did you mean 'max_length'?)"


def test_an_unknown_option_without_a_close_match_lists_the_options(grpo_rewards):
    with pytest.raises(ConfigError) as exc:
        resolved(RewardSpec("length", options={"tokens": 10}))
    assert one_line(exc) == ("config: method.rewards[0].options.tokens: unknown key "
                             "(keys: max_length, buffer, penalty)")


def test_options_for_a_reward_without_config_are_refused(grpo_rewards):
    with pytest.raises(ConfigError) as exc:
        resolved(RewardSpec("math_answer", options={"strict": True}))
    assert one_line(exc).startswith("config: method.rewards[0].options: reward 'math_answer' (")
    assert str(exc.value).endswith(") takes no options")


def test_a_reward_listed_twice_is_refused(grpo_rewards):
    with pytest.raises(ConfigError) as exc:
        resolved(RewardSpec("math_answer"), RewardSpec("format"), RewardSpec("math_answer", weight=2))
    assert one_line(exc) == ("config: method.rewards[2].name: 'math_answer' is already listed as "
                             "method.rewards[0]; list each reward once and set its weight")


def test_an_empty_list_is_refused(grpo_rewards):
    with pytest.raises(ConfigError) as exc:
        resolve_rewards([])
    assert one_line(exc).startswith("config: method.rewards: lists no reward")


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), "high", True])
def test_a_weight_must_be_a_finite_number(grpo_rewards, weight):
    with pytest.raises(ConfigError) as exc:
        resolved(RewardSpec("math_answer", weight=weight))
    assert one_line(exc).startswith("config: method.rewards[0].weight: expected a finite number")


def test_errors_name_the_path_the_caller_gives(grpo_rewards):
    with pytest.raises(ConfigError, match=r"^config: method\.eval_rewards\[0\]\.name: "):
        resolve_rewards([RewardSpec("nope")], where="method.eval_rewards")
