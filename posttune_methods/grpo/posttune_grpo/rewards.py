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

`resolve_rewards` checks that list before launch (names, options, weights, time limits); `score`
runs the rewards on a batch of completions and sums them with their weights. An options dataclass
refuses a bad value in ``__post_init__`` by raising ``ConfigError(<field>, <problem>)``;
`resolve_rewards` reports it under the full path, e.g. ``method.rewards[1].options.pattern``.

An *isolated* reward (``RewardFunction(isolated=True)``: here ``math_answer``, whose sympy one
completion can keep busy for minutes, and ``format``, whose user-written pattern can backtrack
for ever on one) is scored one completion at a time in worker processes (reward_workers.py),
each completion under ``timeout_s`` seconds and the batch under ``budget_s``; a completion that
runs out of either is a failure of that reward, counted again as a timeout. ``exact_answer``
and ``length`` run in this process: a string comparison and a token count, they cannot hang.
"""

from __future__ import annotations

import logging
import math
import numbers
import pickle
import re
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from posttune.plugin import ConfigError, PosttuneError, RewardFunction, first_line, from_dict, lookup, provenance
from posttune_grpo.reward_workers import Call, RemoteError, in_worker, shared_pool

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
        raise PosttuneError("reward 'exact_answer' needs an 'answer' field in the dataset rows")
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

# ---------------------------------------------------------------------------------------------
# combining rewards
# ---------------------------------------------------------------------------------------------

RewardErrors = Literal["raise", "zero"]
_CONTINUE = "set method.reward_errors: zero to score such completions 0 and count them"
DEFAULT_TIMEOUT_S = 5.0  # math-verify's own default: GSM8K and MATH answers take milliseconds
BUDGET_PER_TIMEOUT = 6  # default budget_s: six completions' worth of timeout_s (30 s at the default)
#: work a new worker does before its first completion, so that no completion's limit pays for it
_WARM_UPS: dict[Callable[..., Any], Callable[[], None]] = {math_answer: _warm_math_answer}


@dataclass(frozen=True)
class RewardSpec:
    """One entry of ``method.rewards``: a registered reward's name, its weight and its options."""

    name: str  # a registered reward function (`posttune ls rewards`)
    weight: float = 1.0  # its weight in the summed reward
    options: dict = field(default_factory=dict)  # its settings, checked against its options dataclass
    timeout_s: float | None = None  # an isolated reward's limit per completion; default 5 s
    budget_s: float | None = None  # an isolated reward's limit per batch; default 6 x timeout_s


@dataclass(frozen=True)
class ResolvedReward:
    """A reward ready to score: its function, weight, validated options and where it came from."""

    name: str
    weight: float
    fn: Callable[..., list[float | None]]
    options: Any = None  # the descriptor's config instance, or None for a reward without config
    provider: str = ""  # "posttune-grpo 0.1.0", for error messages
    isolated: bool = False  # scored one completion at a time in worker processes, under the two limits
    timeout_s: float = DEFAULT_TIMEOUT_S
    budget_s: float = BUDGET_PER_TIMEOUT * DEFAULT_TIMEOUT_S

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields: Any) -> Any:
        if self.options is not None:
            fields["reward_options"] = self.options
        return self.fn(prompts, completions, **fields)


@dataclass(frozen=True)
class Scores:
    """What `score` returns. ``total``: the weighted sum per completion; ``per_reward``: each
    reward's unweighted values (0.0 where it failed); ``failures``: completions each reward
    failed on (None, an exception or a timeout, scored 0 with ``reward_errors: zero``);
    ``timeouts``: of those, the completions each isolated reward did not finish in time."""

    total: list[float]
    per_reward: dict[str, list[float]]
    failures: dict[str, int]
    timeouts: dict[str, int] = field(default_factory=dict)  # isolated rewards only


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
        options = None
    else:
        options = _options(reward.config, spec.options, f"{at}.options")
    if not reward.isolated:
        for name in ("timeout_s", "budget_s"):
            if getattr(spec, name) is not None:
                raise ConfigError(f"{at}.{name}", f"reward '{spec.name}' ({provider}) runs in the training process "
                                                  "(its plugin does not isolate it), so it has no time limit to set")
        return ResolvedReward(spec.name, float(spec.weight), reward.fn, options, provider)
    timeout_s, budget_s = _limits(spec, at)
    _check_portable(reward.fn, options, f"reward '{spec.name}' ({provider})", at)
    return ResolvedReward(spec.name, float(spec.weight), reward.fn, options, provider, True, timeout_s, budget_s)


def _limits(spec: RewardSpec, at: str) -> tuple[float, float]:
    """An isolated reward's ``(timeout_s, budget_s)``: positive seconds, the budget at least one timeout."""
    for name in ("timeout_s", "budget_s"):
        value = getattr(spec, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not (math.isfinite(value) and value > 0)):
            raise ConfigError(f"{at}.{name}", f"expected a positive number of seconds, got {value!r}")
    timeout_s = float(spec.timeout_s) if spec.timeout_s is not None else DEFAULT_TIMEOUT_S
    budget_s = float(spec.budget_s) if spec.budget_s is not None else BUDGET_PER_TIMEOUT * timeout_s
    if budget_s < timeout_s:
        raise ConfigError(f"{at}.budget_s", f"must be at least timeout_s ({timeout_s:g}), got {budget_s:g}")
    return timeout_s, budget_s


def _check_portable(fn: Callable[..., Any], options: Any, label: str, at: str) -> None:
    """A worker process receives the function by its importable name, and the options by value."""
    for what, value in (("function", fn), ("options", options)):
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise ConfigError(f"{at}.name", f"{label} is isolated, but its {what} cannot be sent to a worker "
                                            f"process ({type(exc).__name__}: {first_line(str(exc))}); its plugin "
                                            "must define it at module level") from None


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
    not a finite number, fails that completion (all of them, when it raises in this process); an
    isolated reward also fails a completion it does not finish within ``timeout_s``, or before
    its batch's ``budget_s`` runs out. With ``on_error`` ``"raise"`` a failure is a one-line
    PosttuneError naming the reward; with ``"zero"`` the completion scores 0 for it and is counted
    in ``failures`` (and a timeout in ``timeouts`` too). A result that is not one value per
    completion is always an error.
    """
    n = len(completions)
    kwargs = dict(fields)
    if completion_ids is not None:
        kwargs["completion_ids"] = completion_ids
    for name, values in [("prompts", prompts), *kwargs.items()]:
        if len(values) != n:
            raise ValueError(f"score: {name} holds {len(values)} values for {n} completions")
    warm_up = tuple(dict.fromkeys(_WARM_UPS[r.fn] for r in rewards if r.isolated and r.fn in _WARM_UPS))
    total = [0.0] * n
    per_reward: dict[str, list[float]] = {}
    failures: dict[str, int] = {}
    timeouts: dict[str, int] = {}
    for reward in rewards:
        values, failed, timed_out = _run(reward, prompts, completions, kwargs, on_error, warm_up)
        per_reward[reward.name], failures[reward.name] = values, failed
        if reward.isolated:
            timeouts[reward.name] = timed_out
        total = [t + reward.weight * v for t, v in zip(total, values, strict=True)]
    return Scores(total, per_reward, failures, timeouts)


def _run(reward: ResolvedReward, prompts: Sequence[str], completions: Sequence[str], kwargs: dict[str, Any],
         on_error: RewardErrors, warm_up: tuple[Callable[[], None], ...]) -> tuple[list[float], int, int]:
    """One reward's values with failures scored 0, how many failed, and how many of those timed out."""
    n = len(completions)
    label = f"reward '{reward.name}' ({reward.provider})"
    if reward.isolated:
        raw, problems = _in_workers(reward, label, prompts, completions, kwargs, warm_up)
    else:
        try:
            raw = reward(prompts, completions, **kwargs)
        except Exception as exc:  # a reward's bug or a bad row: the user chooses to stop or to go on
            if on_error == "raise":
                message = first_line(str(exc))
                raise PosttuneError(f"{label} raised {type(exc).__name__}: {message}; {_CONTINUE}") from exc
            return [0.0] * n, n, 0
        _check_length(raw, n, label)
        problems = [None] * n
    problems = [problem if problem is not None or _is_score(value) else _Failed("value", value)
                for value, problem in zip(raw, problems, strict=True)]
    failed = [j for j, problem in enumerate(problems) if problem is not None]
    if failed and on_error == "raise":
        j = failed[0]
        cause = problems[j].value if problems[j].kind == "error" else None
        raise PosttuneError(f"{label} {_what_failed(problems[j], reward)} for completion {j} ({len(failed)} of {n} "
                            f"in this batch); {_CONTINUE}") from cause
    timed_out = sum(problem is not None and problem.kind in ("timeout", "budget") for problem in problems)
    values = [0.0 if problem is not None else float(value) for value, problem in zip(raw, problems, strict=True)]
    return values, len(failed), timed_out


def _in_workers(reward: ResolvedReward, label: str, prompts: Sequence[str], completions: Sequence[str],
                kwargs: dict[str, Any], warm_up: tuple[Callable[[], None], ...]) -> tuple[list, list]:
    """An isolated reward's raw value per completion, and per completion what went wrong (None: nothing).

    Each completion is its own call, with its own slice of every field: the limit is per
    completion, and one that hangs costs only itself."""
    options = {} if reward.options is None else {"reward_options": reward.options}
    calls = [Call(reward.fn, (prompts[j:j + 1], completions[j:j + 1]),
                  {**{name: values[j:j + 1] for name, values in kwargs.items()}, **options})
             for j in range(len(completions))]
    outcomes = shared_pool(warm_up).run(calls, timeout_s=reward.timeout_s, budget_s=reward.budget_s)
    raw: list[Any] = [None] * len(calls)
    problems: list[_Failed | None] = [None] * len(calls)
    for j, outcome in enumerate(outcomes):
        if outcome.kind == "ok":
            _check_length(outcome.value, 1, label)
            raw[j] = outcome.value[0]
        else:
            problems[j] = _Failed(outcome.kind, outcome.value)
    return raw, problems


def _check_length(raw: Any, n: int, label: str) -> None:
    if not isinstance(raw, (list, tuple)) or len(raw) != n:
        got = f"{len(raw)} values" if isinstance(raw, (list, tuple)) else f"a {type(raw).__name__}"
        raise PosttuneError(f"{label} returned {got} for {n} completion{'s' if n != 1 else ''}; a reward function "
                            "returns one float (or None) per completion")


@dataclass(frozen=True)
class _Failed:
    """Why one completion failed: ``value`` (a result that is no score), ``error`` (the exception
    raised for it in a worker), ``timeout`` (past timeout_s) or ``budget`` (past budget_s)."""

    kind: Literal["value", "error", "timeout", "budget"]
    value: Any = None


def _what_failed(problem: _Failed, reward: ResolvedReward) -> str:
    """What a failed completion's reward did, for the one-line error: "returned None (cannot score)"."""
    if problem.kind == "value":
        return "returned None (cannot score)" if problem.value is None else \
            f"returned {problem.value!r}, not a finite number"
    if problem.kind == "error":
        error = problem.value
        kind = error.name if isinstance(error, RemoteError) else type(error).__name__
        return f"raised {kind}: {first_line(str(error))},"
    if problem.kind == "timeout":
        return f"took longer than timeout_s ({reward.timeout_s:g} s)"
    return f"ran out of budget_s ({reward.budget_s:g} s for the batch)"


def _is_score(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
