"""GRPO's built-in reward functions: `exact_answer`, `math_answer`, `format`, `length`.

A reward function is a `RewardFunction` descriptor: ``fn(prompts, completions, **fields)`` returns
one float per completion, or None where it cannot score one. ``prompts`` and ``completions`` are
equal-length lists of strings (a prompt repeated once per completion of its group). The keyword
arguments are:

- every field of the dataset row (e.g. ``answer``), each a list of the same length;
- ``completion_ids``: the completions' token ids (a list of token-id lists), which the GRPO
  method passes to every reward function, so length-based rewards count tokens, not characters;
- ``reward_options``: the validated options instance, for a reward whose descriptor has a
  ``config`` (a distinct name, so that a dataset column called ``options`` still arrives).

A reward function takes what it uses and ignores the rest (``**_``), so a dataset with more
columns, or a method that passes more, does not break it. An options dataclass refuses a bad
value in ``__post_init__`` by raising ``ConfigError(<field>, <problem>)``.

``math_answer`` and ``format`` are *isolated* (``RewardFunction(isolated=True)``): sympy can keep
one completion busy for minutes, and a user-written pattern can backtrack for ever on one, so
scoring.py runs them in worker processes under time limits. ``exact_answer`` and ``length`` run
in the training process: a string comparison and a token count, they cannot hang. How a run
combines rewards (weights, options, failures, limits) is scoring.py's.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posttune.plugin import ConfigError, PosttuneError, RewardFunction
from posttune_grpo.reward_workers import in_worker

# ---------------------------------------------------------------------------------------------
# math_answer
# ---------------------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Math delimiters after which math-verify's own extraction reads LaTeX: $..$ (an unescaped
# dollar), \(..\), \[..\], \boxed{..}.
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed")
# A word of prose: three letters or more, once LaTeX commands and \text{..} groups are removed.
_TEXT_GROUP = re.compile(r"\\(?:text\w*|mathrm|mbox|operatorname)\s*\{[^{}]*\}")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{3,}")


def math_answer(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any] | None = None,
                **_: Any) -> list[float | None]:
    """1.0 where a completion's final answer equals the row's ``answer`` (checked by math-verify),
    0.0 where it does not or states none, None where the gold answer cannot be parsed.

    The gold answer: the text after the last ``####`` (GSM8K's style), else the whole field. The
    completion's answer: the last ``<answer>...</answer>`` if it has one, else what math-verify
    finds in the whole completion (``\\boxed{}`` first, then "the answer is ...", then the last
    number or expression).
    """
    if answer is None:
        raise PosttuneError(needs_field("reward 'math_answer'", "answer"))
    mv = _math_verify()
    golds: dict[str, list] = {}  # a group shares its gold: parse it once
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        text = _gold_text(gold)
        if text not in golds:
            golds[text] = _parse_answer(mv, text)
        scores.append(_check(mv, golds[text], completion))
    return scores


def _math_verify() -> types.SimpleNamespace:
    """math-verify, imported on first use: importing the plugin stays fast."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as exc:
        raise PosttuneError(f"reward 'math_answer' needs math-verify ({exc}) — pip install math-verify") from None
    if in_worker():  # the pool's limit (timeout_s) is the only one, and a completion past it is counted
        timeout = None
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # not its "timeout is disabled" warning
    else:  # called directly: math-verify times out long parses with SIGALRM, which only a main thread may use
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
    # boxed answers first, as TRL's and open-r1's accuracy rewards do
    config = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return types.SimpleNamespace(parse=parse, verify=verify, config=config, timeout=timeout)


def _warm_math_answer() -> None:
    """A new worker's first score, before any completion's time limit runs: it imports math-verify
    and sympy's LaTeX parser (about half a second)."""
    math_answer(["warm-up"], ["\\boxed{1}"], answer=["1"])


def _gold_text(gold: Any) -> str:
    text = "" if gold is None else str(gold)
    return text.rsplit("####", 1)[-1].strip()


def _check(mv: types.SimpleNamespace, gold: list, completion: str) -> float | None:
    if not gold:
        return None
    tagged = _ANSWER_TAG.findall(completion)
    predicted = _parse_answer(mv, tagged[-1].strip()) if tagged else _parse(mv, completion)
    if not predicted:
        return 0.0
    return 1.0 if mv.verify(gold, predicted, timeout_seconds=mv.timeout) else 0.0


def _parse_answer(mv: types.SimpleNamespace, text: str) -> list:
    """A text that is only an answer (a gold answer, an <answer> tag's content).

    A bare expression ("\\frac{1}{2}", "2\\sqrt{2}", "(1, 2)", "25%") is read whole, as if boxed:
    math-verify finds LaTeX only inside delimiters, and would otherwise read "2\\sqrt{2}" as 2.
    Delimited math and prose ("18 dollars", "The answer is \\frac{1}{2}") go to math-verify's
    own extraction first, which finds the answer in them. Either way, the other reading is the
    fallback (a word answer such as "Monday" is read as boxed text).
    """
    if not text:
        return []
    boxed = f"\\boxed{{{text}}}"
    if _DELIMITED.search(text) or _is_prose(text):
        return _parse(mv, text) or _parse(mv, boxed)
    return _parse(mv, boxed) or _parse(mv, text)


def _is_prose(text: str) -> bool:
    return bool(_WORD.search(_COMMAND.sub(" ", _TEXT_GROUP.sub(" ", text))))


def _parse(mv: types.SimpleNamespace, text: str) -> list:
    # no_fallback: a match math-verify could not parse is no answer (not a string to compare)
    return mv.parse(text, extraction_config=mv.config, fallback_mode="no_fallback", parsing_timeout=mv.timeout)


# ---------------------------------------------------------------------------------------------
# format
# ---------------------------------------------------------------------------------------------

THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"


@dataclass(frozen=True)
class FormatOptions:
    """``pattern``: a regular expression the whole completion must match (dot matches newlines)."""

    pattern: str = THINK_ANSWER  # a regular expression the whole completion must match (dot matches newlines)

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern, re.DOTALL)
        except re.error as exc:
            raise ConfigError("pattern", f"not a valid regular expression ({exc}): {self.pattern!r}") from None


def format_reward(prompts: Sequence[str], completions: Sequence[str], *,
                  reward_options: FormatOptions = FormatOptions(), **_: Any) -> list[float | None]:
    """1.0 where the completion matches ``reward_options.pattern`` in full, else 0.0."""
    pattern = re.compile(reward_options.pattern, re.DOTALL)
    return [1.0 if pattern.fullmatch(completion) else 0.0 for completion in completions]


# ---------------------------------------------------------------------------------------------
# length
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthOptions:
    """DAPO's soft overlong punishment: no penalty up to ``max_length - buffer`` tokens, then
    falling linearly to ``-penalty`` at ``max_length``, and ``-penalty`` beyond."""

    max_length: int = 1024  # completion tokens from which the penalty is the whole -penalty
    buffer: int = 256  # tokens before max_length over which the penalty grows linearly from 0
    penalty: float = 1.0  # the largest penalty (the reward is -penalty beyond max_length)

    def __post_init__(self) -> None:
        for name in ("max_length", "buffer"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"expected a positive integer, got {getattr(self, name)}")
        if self.buffer > self.max_length:
            raise ConfigError("buffer", f"must be at most max_length ({self.max_length}), got {self.buffer}")
        if not (math.isfinite(self.penalty) and self.penalty > 0):
            raise ConfigError("penalty", f"expected a positive number, got {self.penalty}")


def length_reward(prompts: Sequence[str], completions: Sequence[str], *,
                  completion_ids: Sequence[Sequence[int]] | None = None,
                  reward_options: LengthOptions = LengthOptions(), **_: Any) -> list[float | None]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) on each completion's token count."""
    if completion_ids is None:
        raise PosttuneError("reward 'length' needs the completions' token ids (completion_ids), "
                            "which the GRPO method passes")
    return [_overlong(len(ids), reward_options) for ids in completion_ids]


def _overlong(tokens: int, options: LengthOptions) -> float:
    start = options.max_length - options.buffer
    if tokens <= start:
        return 0.0
    if tokens <= options.max_length:
        return -options.penalty * (tokens - start) / options.buffer
    return -options.penalty


def exact_answer(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any] | None = None,
                 **_: Any) -> list[float | None]:
    """1.0 where the completion, stripped of surrounding whitespace, is the row's ``answer`` exactly."""
    if answer is None:
        raise PosttuneError(needs_field("reward 'exact_answer'", "answer"))
    return [None if gold is None else float(completion.strip() == str(gold).strip())
            for completion, gold in zip(completions, answer, strict=True)]


REWARDS: tuple[RewardFunction, ...] = (
    RewardFunction("exact_answer", exact_answer,
                   "1 if the completion (stripped) is the row's `answer` exactly, else 0 (string tasks)"),
    RewardFunction("math_answer", math_answer,
                   "1 if the final answer equals the row's `answer` (math-verify; GSM8K '####' golds), else 0",
                   isolated=True),
    RewardFunction("format", format_reward,
                   "1 if the completion matches a regex in full (default: <think>..</think> <answer>..</answer>)",
                   config=FormatOptions, isolated=True),
    RewardFunction("length", length_reward,
                   "DAPO's soft overlong punishment on completion tokens: 0, then down to -penalty",
                   config=LengthOptions),
)

#: work a new worker does before its first completion of a reward, so that no completion's limit pays for it
WARM_UPS: dict[Callable[..., Any], Callable[[], None]] = {math_answer: _warm_math_answer}

#: the row fields a built-in reward cannot score without: checked in the first row of a local .jsonl
#: before launch, and named when a batch or a row lacks one (scoring.py), so that a dataset whose column
#: has another name is a one-line configuration error, not a run of zero rewards
ROW_FIELDS: dict[Callable[..., Any], tuple[str, ...]] = {exact_answer: ("answer",), math_answer: ("answer",)}


def needs_field(label: str, field: str, has: Sequence[str] | None = None) -> str:
    """The one line for a reward (``label``: "reward 'exact_answer'") given rows without a field it reads, and
    the fields they do have (``has``): the fix is a column_map, not ``reward_errors``."""
    article = "an" if field[:1] in "aeiou" else "a"
    rows = "" if has is None else f" (the rows have {', '.join(map(repr, has)) or 'no other field'})"
    return (f"{label} needs {article} '{field}' field in each dataset row{rows}; map your dataset's column to it "
            f"with data.train.column_map: {{{field}: <column>}}")
