"""How a GRPO run scores completions: its rewards resolved, run (isolated ones in worker processes), summed.

A run lists its rewards under ``method.rewards`` (a list of `RewardSpec`):

    method:
      name: grpo
      rewards:
        - {name: math_answer}
        - {name: format, weight: 0.2}
        - {name: length, options: {max_length: 1024, buffer: 256}}
      reward_errors: raise        # or zero: score a completion 0 when its reward fails, and count it

`resolve_rewards` checks that list before launch (names, options, weights, time limits) and
reports a bad option under its full path, e.g. ``method.rewards[1].options.pattern``;
`check_row_fields` checks that a local dataset's first row has the fields the built-in rewards
read (``answer``), so a column of another name is refused before launch, not at step 1; `score`
runs the rewards on a batch of completions and sums them with their weights; `score_batch` does
it for a rollout batch (decoding, each completion's row fields, placeholders left out).

An *isolated* reward (``RewardFunction(isolated=True)``) is scored one completion at a time in
worker processes (reward_workers.py), each completion under ``timeout_s`` seconds and the batch
under ``budget_s``; a completion that runs out of either is a failure of that reward, counted
again as a timeout. The reward functions themselves are rewards.py's (or a plugin's).
"""

from __future__ import annotations

import math
import numbers
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from posttune.plugin import (ConfigError, PosttuneError, RewardFunction, dataset_sources, first_jsonl_row, first_line,
                             from_dict, lookup, provenance)
from posttune_grpo.model_reward import scored_in_learner
from posttune_grpo.python_rewards import is_reference, python_reward
from posttune_grpo.reward_workers import Call, RemoteError, shared_pool
from posttune_grpo.rewards import ROW_FIELDS, WARM_UPS, needs_field

RewardErrors = Literal["raise", "zero"]
_CONTINUE = "set method.reward_errors: zero to score such completions 0 and count them"
#: what Python says when code indexes a string as TRL's chat completions (``completion[0]["content"]``)
_STRING_INDEXED = "string indices must be integers"
_TEXT_NOT_MESSAGES = ("completions are strings here, not TRL's chat messages [{'role': 'assistant', 'content': ...}]: "
                      "read the text itself (docs/coming_from.md)")


#: what Python says when a call's arguments do not fit the function (every completion would fail alike)
_SIGNATURE = ("required positional argument", "required keyword-only argument", "unexpected keyword argument")
_CALLED_AS = ("it is called as fn(prompts=, completions=, completion_ids=, **the row's fields), by keyword: "
              "take **kwargs for the fields it does not read")


def _remedy(error: BaseException | None) -> str:
    """What the one-line error suggests: reading text where a reward indexes it as TRL's messages, or how it is
    called where its arguments do not fit (scoring such completions 0 would train on nothing), else
    ``reward_errors: zero``."""
    if _STRING_INDEXED in str(error):
        return _TEXT_NOT_MESSAGES
    if isinstance(error, TypeError) and any(text in str(error) for text in _SIGNATURE):
        return _CALLED_AS
    return _CONTINUE
DEFAULT_TIMEOUT_S = 5.0  # math-verify's own default: GSM8K and MATH answers take milliseconds
BUDGET_PER_TIMEOUT = 6  # default budget_s: six completions' worth of timeout_s (30 s at the default)


@dataclass(frozen=True)
class RewardSpec:
    """One entry of ``method.rewards``: a registered reward's name, its weight and its options; a lone name
    (``rewards: [exact_answer]``, as TRL's ``reward_funcs`` lists them) is the reward at weight 1."""

    FROM_STRING: ClassVar[str] = "name"

    name: str  # a registered reward function (`posttune ls rewards`), or a Python function: file.py:fn, module:fn
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
    in_learner: bool = False  # scored by the method with a model role, not by ``fn`` (model_reward.py)

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


def resolve_rewards(specs: Sequence[RewardSpec], *, where: str = "method.rewards",
                    cwd: str | None = None) -> list[ResolvedReward]:
    """Each spec's reward looked up, its options validated and its weight checked, before launch; ``cwd``: where
    a Python function's relative reference is read from (default: the working directory)."""
    if not specs:
        raise ConfigError(where, "lists no reward; name at least one, e.g. [{name: math_answer}]")
    first: dict[str, int] = {}
    logged: dict[str, int] = {}  # by the name a reward is logged under: a Python function's own
    resolved = []
    for i, spec in enumerate(specs):
        at = f"{where}[{i}]"
        if spec.name in first:
            raise ConfigError(f"{at}.name", f"'{spec.name}' is already listed as {where}[{first[spec.name]}]; "
                                            "list each reward once and set its weight")
        first[spec.name] = i
        reward = _resolve(spec, at, cwd)
        if reward.name in logged:  # two functions of one name from two files: their logs would mix
            raise ConfigError(f"{at}.name", f"'{spec.name}' is logged as reward/{reward.name}, as "
                                            f"{where}[{logged[reward.name]}] is; rename one of the functions")
        logged[reward.name] = i
        resolved.append(reward)
    return resolved


def check_rewards(config: Any, specs: Sequence[RewardSpec]) -> None:
    """A generating method's rewards before launch (GRPO's and PPO's validate): each resolved, the data's rows
    holding the fields they read, and ``checkpoint.best_metric`` one the evaluation logs."""
    rewards = resolve_rewards(specs)
    check_row_fields(config.data, rewards)
    _check_best_metric(config, rewards)


def _check_best_metric(config: Any, rewards: Sequence[ResolvedReward]) -> None:
    """``checkpoint.best_metric`` names what the evaluation logs (``evaluation.py``), checked before launch:
    found at the first evaluation instead, it would end the run before its first checkpoint."""
    metric = config.checkpoint.best_metric
    logged = ["val_reward", *(f"val_reward/{reward.name}" for reward in rewards), "val_completion_length"]
    if metric is not None and metric not in logged:
        raise ConfigError("checkpoint.best_metric", f"the evaluation logs no '{metric}' (it logs: {', '.join(logged)}; "
                                                    "the mean reward of greedy answers is val_reward)")


def _resolve(spec: RewardSpec, at: str, cwd: str | None = None) -> ResolvedReward:
    if is_reference(spec.name):
        return _resolve_python(spec, at, cwd)
    try:
        reward: RewardFunction = lookup("reward_function", spec.name)
    except PosttuneError as exc:
        raise ConfigError(f"{at}.name", str(exc)) from None
    _check_weight(spec, at)
    provider = provenance("reward_function", spec.name)
    if reward.config is None:
        if spec.options:
            raise ConfigError(f"{at}.options", f"reward '{spec.name}' ({provider}) takes no options")
        options = None
    else:
        options = from_dict(reward.config, spec.options, f"{at}.options")
    if not reward.isolated:
        for name in ("timeout_s", "budget_s"):
            if getattr(spec, name) is not None:
                raise ConfigError(f"{at}.{name}", f"reward '{spec.name}' ({provider}) runs in the training process "
                                                  "(its plugin does not isolate it), so it has no time limit to set")
        return ResolvedReward(spec.name, float(spec.weight), reward.fn, options, provider,
                              in_learner=reward.fn is scored_in_learner)
    timeout_s, budget_s = _limits(spec, at)
    _check_portable(reward.fn, options, f"reward '{spec.name}' ({provider})", at)
    return ResolvedReward(spec.name, float(spec.weight), reward.fn, options, provider, True, timeout_s, budget_s)


def _resolve_python(spec: RewardSpec, at: str, cwd: str | None) -> ResolvedReward:
    """A Python function named by reference (python_rewards.py): in the training process, or isolated when a time
    limit is set."""
    try:
        fn = python_reward(spec.name, cwd)
    except ValueError as exc:
        raise ConfigError(f"{at}.name", str(exc)) from None
    _check_weight(spec, at)
    if spec.options:
        raise ConfigError(f"{at}.options", f"the Python function '{spec.name}' takes no options (keep its settings "
                                           "in its own file)")
    provider = f"Python function {spec.name}"
    if spec.timeout_s is None and spec.budget_s is None:
        return ResolvedReward(fn.name, float(spec.weight), fn, None, provider)
    if spec.name.startswith("__main__:"):
        raise ConfigError(f"{at}.name", f"'{spec.name}' is isolated by its time limit, so it runs in worker "
                                        "processes, whose __main__ is not this script; put the function in a file "
                                        "(file.py:function) or a module")
    timeout_s, budget_s = _limits(spec, at)
    return ResolvedReward(fn.name, float(spec.weight), fn, None, provider, True, timeout_s, budget_s)


def _check_weight(spec: RewardSpec, at: str) -> None:
    if isinstance(spec.weight, bool) or not isinstance(spec.weight, numbers.Real) or not math.isfinite(spec.weight):
        raise ConfigError(f"{at}.weight", f"expected a finite number, got {spec.weight!r}")


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


def check_row_fields(data: Any, rewards: Sequence[ResolvedReward], *, where: str = "method.rewards") -> None:
    """Before launch: each local ``.jsonl`` dataset's first row (``column_map`` applied) has the fields the
    built-in rewards read (rewards.ROW_FIELDS). Without this a dataset whose column has another name passes
    ``validate`` and stops the run at its first step. Hub datasets and unreadable first lines are left to
    the run (and to the core's own check of the first row)."""
    sections = [(f"data.{split}", getattr(data, split, None)) for split in ("train", "validation")]
    for at, dataset in [source for split, section in sections if section is not None
                        for source in dataset_sources(section, split)]:
        row = first_jsonl_row(Path(dataset.path).expanduser(), f"{at}.path", strict=False)
        if row is None:
            continue
        for i, reward in enumerate(rewards):
            for name in ROW_FIELDS.get(reward.fn, ()):
                column = dataset.column_map.get(name, name)
                if row.get(column) is None:
                    raise ConfigError(f"{where}[{i}]", _first_row_lacks(reward.name, name, column, row, dataset.path,
                                                                        at))


def _first_row_lacks(reward: str, name: str, column: str, row: Mapping[str, Any], path: str, at: str) -> str:
    if column != name:
        lacks = f"no '{column}' (the column {at}.column_map maps to '{name}')"
    else:
        lacks = f"'{name}': null" if name in row else f"no '{name}'"
    return (f"reward '{reward}' reads each row's '{name}' field, and the first row of {path} has {lacks}; its fields: "
            f"{', '.join(map(repr, row)) or 'none'}; map the column that holds it with {at}.column_map: "
            f"{{{name}: <column>}}")


def score(rewards: Sequence[ResolvedReward], prompts: Sequence[str], completions: Sequence[str],
          fields: Mapping[str, Sequence[Any]], *, completion_ids: Sequence[Sequence[int]] | None = None,
          on_error: RewardErrors = "raise", rows: Sequence[int] | None = None) -> Scores:
    """Every reward on every completion, and their weighted sum.

    ``fields``: the rows' fields, each a list as long as ``completions``; ``completion_ids``, when
    given, is passed to every reward too. A reward that raises, or returns None or a value that is
    not a finite number, fails that completion (all of them, when it raises in this process); an
    isolated reward also fails a completion it does not finish within ``timeout_s``, or before
    its batch's ``budget_s`` runs out. With ``on_error`` ``"raise"`` a failure is a one-line
    PosttuneError naming the reward; with ``"zero"`` the completion scores 0 for it and is counted
    in ``failures`` (and a timeout in ``timeouts`` too). A result that is not one value per
    completion is always an error. ``rows``: each completion's dataset row, named in an error
    when that row lacks a field the reward reads (rewards.ROW_FIELDS).
    """
    n = len(completions)
    kwargs = dict(fields)
    if completion_ids is not None:
        kwargs["completion_ids"] = completion_ids
    for name, values in [("prompts", prompts), *kwargs.items()]:
        if len(values) != n:
            raise ValueError(f"score: {name} holds {len(values)} values for {n} completions")
    warm_up = tuple(dict.fromkeys(WARM_UPS[r.fn] for r in rewards if r.isolated and r.fn in WARM_UPS))
    total = [0.0] * n
    per_reward: dict[str, list[float]] = {}
    failures: dict[str, int] = {}
    timeouts: dict[str, int] = {}
    for reward in rewards:
        if reward.in_learner:  # added by the method after this (rollouts.score_completions)
            continue
        values, failed, timed_out = _run(reward, prompts, completions, kwargs, on_error, warm_up, rows)
        if n and failed == n:
            _warn_all_failed(reward, n)
        per_reward[reward.name], failures[reward.name] = values, failed
        if reward.isolated:
            timeouts[reward.name] = timed_out
        total = [t + reward.weight * v for t, v in zip(total, values, strict=True)]
    return Scores(total, per_reward, failures, timeouts)


_WARNED: set[str] = set()


def _warn_all_failed(reward: ResolvedReward, n: int) -> None:
    """Once per reward and process: every completion of a batch failed it (``reward_errors: zero`` scored them
    0), so it adds nothing to learn from; a reward whose call itself is wrong fails like this at every step."""
    if reward.name not in _WARNED:
        _WARNED.add(reward.name)
        print(f"posttune: warning: reward '{reward.name}' ({reward.provider}) failed for all {n} completions of a "
              f"batch (scored 0, counted in reward_failures/{reward.name}); check it against its first error with "
              "method.reward_errors: raise", file=sys.stderr)


def score_batch(tokenizer: Any, rewards: Sequence[ResolvedReward], on_error: RewardErrors, prompts: Mapping[str, Any],
                completions: Sequence[Sequence[int]], real: Sequence[float], group: int) -> Scores:
    """`score` on a rollout batch: ``completions`` (token ids) are ``group`` per prompt of ``prompts``
    (a prompt batch: ``prompts``, ``fields``), decoded, each with its prompt's fields. Completions
    whose ``real`` flag is 0 (placeholders) score 0 without any reward being called."""
    keep = [i for i, flag in enumerate(real) if flag]
    texts = [tokenizer.decode(completions[i], skip_special_tokens=True) for i in keep]
    source = [j for j in range(len(prompts["prompts"])) for _ in range(group)]
    fields = {name: [values[source[i]] for i in keep] for name, values in prompts["fields"].items()}
    rows = prompts.get("rows")
    scored = score(rewards, [prompts["prompts"][source[i]] for i in keep], texts, fields,
                   completion_ids=[completions[i] for i in keep], on_error=on_error,
                   rows=None if rows is None else [int(rows[source[i]]) for i in keep])
    total, per_reward = [0.0] * len(completions), {name: [0.0] * len(completions) for name in scored.per_reward}
    for position, i in enumerate(keep):
        total[i] = scored.total[position]
        for name, values in scored.per_reward.items():
            per_reward[name][i] = values[position]
    return Scores(total, per_reward, scored.failures, scored.timeouts)


def _run(reward: ResolvedReward, prompts: Sequence[str], completions: Sequence[str], kwargs: dict[str, Any],
         on_error: RewardErrors, warm_up: tuple[Callable[[], None], ...],
         rows: Sequence[int] | None = None) -> tuple[list[float], int, int]:
    """One reward's values with failures scored 0, how many failed, and how many of those timed out."""
    n = len(completions)
    label = f"reward '{reward.name}' ({reward.provider})"
    absent = [name for name in ROW_FIELDS.get(reward.fn, ()) if name not in kwargs]
    if absent:  # no row of the batch has the field: the dataset's configuration, not one completion
        if on_error == "raise":
            raise PosttuneError(needs_field(label, absent[0], [name for name in kwargs if name != "completion_ids"]))
        return [0.0] * n, n, 0
    if reward.isolated:
        raw, problems = _in_workers(reward, label, prompts, completions, kwargs, warm_up)
    else:
        try:
            raw = reward(prompts, completions, **kwargs)
        except Exception as exc:  # a reward's bug or a bad row: the user chooses to stop or to go on
            if on_error == "raise":
                message = first_line(str(exc))
                raise PosttuneError(f"{label} raised {type(exc).__name__}: {message}; {_remedy(exc)}") from exc
            return [0.0] * n, n, 0
        _check_length(raw, n, label)
        problems = [None] * n
    problems = [problem if problem is not None or _is_score(value) else _Failed("value", value)
                for value, problem in zip(raw, problems, strict=True)]
    failed = [j for j, problem in enumerate(problems) if problem is not None]
    if failed and on_error == "raise":
        j = failed[0]
        cause = problems[j].value if problems[j].kind == "error" else None
        row = _row_lacks(reward, kwargs, j, rows) if problems[j].kind == "value" else ""
        raise PosttuneError(f"{label} {_what_failed(problems[j], reward)} for completion {j} ({len(failed)} of {n} "
                            f"in this batch){row}; {_remedy(cause)}") from cause
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


def _row_lacks(reward: ResolvedReward, kwargs: Mapping[str, Sequence[Any]], j: int,
               rows: Sequence[int] | None) -> str:
    """": dataset row 5 has no 'answer'" when completion ``j``'s row lacks a field the reward reads, else ""."""
    missing = [name for name in ROW_FIELDS.get(reward.fn, ()) if kwargs[name][j] is None]
    if not missing:
        return ""
    row = "its dataset row" if rows is None else f"dataset row {rows[j]}"
    return f": {row} has no '{missing[0]}'"


def _is_score(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
