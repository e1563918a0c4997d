"""GRPO's reward functions (`math_answer`, `format`, `length`), and how a run combines rewards.

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
columns, or a method that passes more, does not break it.

A run lists its rewards under ``method.rewards`` (a list of `RewardSpec`):

    method:
      name: grpo
      rewards:
        - {name: math_answer}
        - {name: format, weight: 0.2}
        - {name: length, options: {max_length: 1024, buffer: 256}}
      reward_errors: raise        # or zero: score a completion 0 when its reward fails, and count it

`resolve_rewards` checks that list before launch (names, options, weights); `score` runs the
rewards on a batch of completions and sums them with their weights. An options dataclass refuses
a bad value in ``__post_init__`` by raising ``ConfigError(<field>, <problem>)``;
`resolve_rewards` reports it under the full path, e.g. ``method.rewards[1].options.pattern``.
"""

from __future__ import annotations

import math
import numbers
import re
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from posttune.plugin import ConfigError, PosttuneError, RewardFunction, first_line, from_dict, lookup, provenance

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
        raise PosttuneError("reward 'math_answer' needs an 'answer' field in each dataset row "
                            "(map your dataset's column to it with column_map)")
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
    # math-verify times out long parses with SIGALRM, which only the main thread may use
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    # boxed answers first, as TRL's and open-r1's accuracy rewards do
    config = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return types.SimpleNamespace(parse=parse, verify=verify, config=config, timeout=timeout)


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
        raise PosttuneError("reward 'exact_answer' needs an 'answer' field in the dataset rows")
    return [None if gold is None else float(completion.strip() == str(gold).strip())
            for completion, gold in zip(completions, answer, strict=True)]


REWARDS: tuple[RewardFunction, ...] = (
    RewardFunction("exact_answer", exact_answer,
                   "1 if the completion (stripped) is the row's `answer` exactly, else 0 (string tasks)"),
    RewardFunction("math_answer", math_answer,
                   "1 if the final answer equals the row's `answer` (math-verify; GSM8K '####' golds), else 0"),
    RewardFunction("format", format_reward,
                   "1 if the completion matches a regex in full (default: <think>..</think> <answer>..</answer>)",
                   config=FormatOptions),
    RewardFunction("length", length_reward,
                   "DAPO's soft overlong punishment on completion tokens: 0, then down to -penalty",
                   config=LengthOptions),
)

# ---------------------------------------------------------------------------------------------
# combining rewards
# ---------------------------------------------------------------------------------------------

RewardErrors = Literal["raise", "zero"]
_CONTINUE = "set method.reward_errors: zero to score such completions 0 and count them"


@dataclass(frozen=True)
class RewardSpec:
    """One entry of ``method.rewards``: a registered reward's name, its weight and its options."""

    name: str  # a registered reward function (`posttune ls rewards`)
    weight: float = 1.0  # its weight in the summed reward
    options: dict = field(default_factory=dict)  # its settings, checked against its options dataclass


@dataclass(frozen=True)
class ResolvedReward:
    """A reward ready to score: its function, weight, validated options and where it came from."""

    name: str
    weight: float
    fn: Callable[..., list[float | None]]
    options: Any = None  # the descriptor's config instance, or None for a reward without config
    provider: str = ""  # "posttune-grpo 0.1.0", for error messages

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields: Any) -> Any:
        if self.options is not None:
            fields["reward_options"] = self.options
        return self.fn(prompts, completions, **fields)


@dataclass(frozen=True)
class Scores:
    """What `score` returns. ``total``: the weighted sum per completion; ``per_reward``: each
    reward's unweighted values (0.0 where it failed); ``failures``: completions each reward
    failed on (None or an exception, scored 0 with ``reward_errors: zero``)."""

    total: list[float]
    per_reward: dict[str, list[float]]
    failures: dict[str, int]


def resolve_rewards(specs: Sequence[RewardSpec], *, where: str = "method.rewards") -> list[ResolvedReward]:
    """Each spec's reward looked up, its options validated and its weight checked, before launch."""
    if not specs:
        raise ConfigError(where, "lists no reward; name at least one, e.g. [{name: math_answer}]")
    first: dict[str, int] = {}
    resolved = []
    for i, spec in enumerate(specs):
        at = f"{where}[{i}]"
        if spec.name in first:
            raise ConfigError(f"{at}.name", f"'{spec.name}' is already listed as {where}[{first[spec.name]}]; "
                                            "list each reward once and set its weight")
        first[spec.name] = i
        resolved.append(_resolve(spec, at))
    return resolved


def _resolve(spec: RewardSpec, at: str) -> ResolvedReward:
    try:
        reward: RewardFunction = lookup("reward_function", spec.name)
    except PosttuneError as exc:
        raise ConfigError(f"{at}.name", str(exc)) from None
    if isinstance(spec.weight, bool) or not isinstance(spec.weight, numbers.Real) or not math.isfinite(spec.weight):
        raise ConfigError(f"{at}.weight", f"expected a finite number, got {spec.weight!r}")
    provider = provenance("reward_function", spec.name)
    if reward.config is None:
        if spec.options:
            raise ConfigError(f"{at}.options", f"reward '{spec.name}' ({provider}) takes no options")
        return ResolvedReward(spec.name, float(spec.weight), reward.fn, None, provider)
    return ResolvedReward(spec.name, float(spec.weight), reward.fn, _options(reward.config, spec.options,
                                                                             f"{at}.options"), provider)


def _options(config: type, data: Any, path: str) -> Any:
    """``config`` built from ``data`` by the core's checker (unknown keys, types); a bad value its
    own ``__post_init__`` refuses is reported under ``path`` too."""
    try:
        return from_dict(config, data, path)
    except ConfigError as exc:
        if exc.path == path or exc.path.startswith(f"{path}.") or exc.path.startswith(f"{path}["):
            raise
        raise ConfigError(f"{path}.{exc.path}" if exc.path else path, exc.problem) from None


def score(rewards: Sequence[ResolvedReward], prompts: Sequence[str], completions: Sequence[str],
          fields: Mapping[str, Sequence[Any]], *, completion_ids: Sequence[Sequence[int]] | None = None,
          on_error: RewardErrors = "raise") -> Scores:
    """Every reward on every completion, and their weighted sum.

    ``fields``: the rows' fields, each a list as long as ``completions``; ``completion_ids``, when
    given, is passed to every reward too. A reward that raises, or returns None or a value that is
    not a finite number, fails that completion (all of them, when it raises): with ``on_error``
    ``"raise"`` that is a one-line PosttuneError naming the reward; with ``"zero"`` the completion
    scores 0 for it and is counted in ``failures``. A result that is not one value per completion
    is always an error.
    """
    n = len(completions)
    kwargs = dict(fields)
    if completion_ids is not None:
        kwargs["completion_ids"] = completion_ids
    for name, values in [("prompts", prompts), *kwargs.items()]:
        if len(values) != n:
            raise ValueError(f"score: {name} holds {len(values)} values for {n} completions")
    total = [0.0] * n
    per_reward: dict[str, list[float]] = {}
    failures: dict[str, int] = {}
    for reward in rewards:
        values, failed = _run(reward, prompts, completions, kwargs, on_error)
        per_reward[reward.name], failures[reward.name] = values, failed
        total = [t + reward.weight * v for t, v in zip(total, values, strict=True)]
    return Scores(total, per_reward, failures)


def _run(reward: ResolvedReward, prompts: Sequence[str], completions: Sequence[str],
         kwargs: dict[str, Any], on_error: RewardErrors) -> tuple[list[float], int]:
    """One reward's values with failures scored 0, and how many failed."""
    n = len(completions)
    label = f"reward '{reward.name}' ({reward.provider})"
    try:
        raw = reward(prompts, completions, **kwargs)
    except Exception as exc:  # a reward's bug or a bad row: the user chooses to stop or to go on
        if on_error == "raise":
            message = first_line(str(exc))
            raise PosttuneError(f"{label} raised {type(exc).__name__}: {message}; {_CONTINUE}") from exc
        return [0.0] * n, n
    if not isinstance(raw, (list, tuple)) or len(raw) != n:
        got = f"{len(raw)} values" if isinstance(raw, (list, tuple)) else f"a {type(raw).__name__}"
        raise PosttuneError(f"{label} returned {got} for {n} completions; a reward function returns "
                            "one float (or None) per completion")
    bad = [j for j, v in enumerate(raw) if not _is_score(v)]
    if bad and on_error == "raise":
        j = bad[0]
        what = "None (cannot score)" if raw[j] is None else f"{raw[j]!r}, not a finite number"
        raise PosttuneError(f"{label} returned {what} for completion {j} ({len(bad)} of {n} in this batch); "
                            f"{_CONTINUE}")
    failed = set(bad)
    return [0.0 if j in failed else float(v) for j, v in enumerate(raw)], len(bad)


def _is_score(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
