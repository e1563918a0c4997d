"""Rollouts: one rank's prompts, each completed ``group_size`` times, scored, and cut into micro-batches.

``generate_rollouts`` makes them with a generation engine, the same code in the training process
(``generation: local``) and in Ray actors (``generation: ray``: an engine actor runs
``generate_completions``, a reward actor ``score_completions``): completion g of the prompt at dataset row r samples
with seed ``derive_seed(seed, epoch, r, g)``, so the same completions whoever generates them.

The tensors are laid out for the loss as every posttune method sees its data: each completion
is a row ``prompt + completion`` (right-padded), ``labels`` hold the completion tokens
pre-shifted (``labels[:, t]`` is the target of position t, -100 elsewhere), and every per-token
tensor (behaviour and reference log-probs) is aligned with ``labels``. A rank always holds
``batch_size * group_size`` rows: a missing prompt (the last, short share of an epoch) is a
placeholder row of weight 0, so every rank runs the same number of forward passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from posttune_grpo.loss import completion_sums, group_advantages
from posttune_grpo.scoring import score_batch
from posttune.plugin import IGNORE_INDEX, Session

PLACEHOLDER_ROW = -1  # the dataset row of a placeholder prompt (a rank's short share of an epoch's last batch)
#: the per-row tensors a Rollouts keeps (and a checkpoint saves); the rest is bookkeeping
ROW_TENSORS = ("input_ids", "labels", "behaviour_logps", "old_logps", "ref_logps", "is_weights", "advantages",
               "weights", "rewards", "lengths", "truncated", "rows", "versions", "equal", "kl")


@dataclass
class Rollouts:
    input_ids: torch.Tensor  # [N, S]
    labels: torch.Tensor  # [N, S], the completion tokens pre-shifted
    behaviour_logps: torch.Tensor  # [N, S], the sampler's log-probs of the completion tokens
    advantages: torch.Tensor  # [N]
    weights: torch.Tensor  # [N]: 1 trains, 0 left out (placeholder, or a filtered group)
    rewards: torch.Tensor  # [N], the weighted total
    lengths: torch.Tensor  # [N] completion tokens
    prompt_lengths: torch.Tensor  # [N] prompt tokens
    truncated: torch.Tensor  # [N] 1.0 where the completion hit max_new_tokens without stopping
    rows: torch.Tensor  # [N] the dataset row of each completion's prompt, -1 for a placeholder
    per_reward: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N] unweighted values
    old_logps: torch.Tensor | None = None  # [N, S] recomputed before the first update (num_iterations > 1)
    ref_logps: torch.Tensor | None = None  # [N, S] the reference's (beta > 0)
    versions: torch.Tensor | None = None  # [N] the policy version that generated each row (Ray actors)
    is_weights: torch.Tensor | None = None  # [N, S] truncated pi_old / pi_behaviour per token (Ray actors, TIS)
    equal: torch.Tensor | None = None  # [N] 1.0 where the row's group scored all alike (zero advantage)
    kl: torch.Tensor | None = None  # [N] sum_t(logp - ref) per completion, taken from its reward (kl_in_reward)
    seconds: float = 0.0  # generation time
    reward_failures: dict[str, int] = field(default_factory=dict)
    reward_timeouts: dict[str, int] = field(default_factory=dict)  # of the failures, isolated rewards' timeouts

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def micro_batches(self, size: int) -> list[dict[str, Any]]:
        """The rows in order, ``size`` at a time, as loss inputs (tensors only, plus metric sums)."""
        out = []
        for start in range(0, len(self), size):
            part = slice(start, start + size)
            batch: dict[str, Any] = {name: getattr(self, name)[part] for name in ROW_TENSORS
                                     if getattr(self, name) is not None}
            batch["per_reward"] = {name: values[part] for name, values in self.per_reward.items()}
            batch["prompt_lengths"] = self.prompt_lengths[part]  # a padding-free forward's documents
            # each real row's prompt and completion tokens (a shared prompt once per completion, as unshared)
            real = (self.weights[part] > 0).long()
            batch["num_tokens"] = ((self.prompt_lengths[part] + self.lengths[part]) * real).sum()
            out.append(batch)
        return out

    def state_dict(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["per_reward"] = dict(self.per_reward)
        state["reward_failures"] = dict(self.reward_failures)
        state["reward_timeouts"] = dict(self.reward_timeouts)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Rollouts:
        return cls(**state)


def build_rows(prompts: list[torch.Tensor], completions: list[list[int]], behaviour: list[torch.Tensor],
               pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, behaviour log-probs aligned with labels), each ``[N, S]``, right-padded."""
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    count = len(prompts)
    input_ids = torch.full((count, length), pad_id, dtype=torch.long)
    labels = torch.full((count, length), IGNORE_INDEX, dtype=torch.long)
    logps = torch.zeros((count, length), dtype=torch.float32)
    for row, (prompt, completion, logp) in enumerate(zip(prompts, completions, behaviour, strict=True)):
        start, end = len(prompt), len(prompt) + len(completion)
        input_ids[row, :start] = prompt.cpu()
        input_ids[row, start:end] = torch.tensor(completion, dtype=torch.long)
        # completion token j sits at position start + j and is the target of position start + j - 1
        labels[row, start - 1:end - 1] = torch.tensor(completion, dtype=torch.long)
        logps[row, start - 1:end - 1] = logp[: len(completion)].cpu()
    return input_ids, labels, logps


def rows_per_rank(session: Session) -> int:
    """Completions per generation batch on this rank: ``train.batch_size x group_size``."""
    return session.config.train.batch_size * session.method_config.group_size


def micro_batch_size(session: Session) -> int:
    return session.method_config.micro_batch_size or rows_per_rank(session)


def micro_batches_per_generation(session: Session) -> int:
    return session.method_config.num_iterations * (rows_per_rank(session) // micro_batch_size(session))


def rollout_spec(session: Session) -> dict[str, Any]:
    """The settings ``generate_rollouts`` reads, as plain data (what a Ray actor receives too)."""
    config = session.method_config
    return {
        "generation": generation_settings(config),
        "group_size": config.group_size, "batch_size": session.config.train.batch_size,
        "seed": session.config.train.seed, "scale_rewards": config.scale_rewards, "baseline": config.baseline,
        "filter_equal_rewards": config.filter_equal_rewards, "reward_errors": config.reward_errors,
    }


def generation_settings(config: Any) -> dict[str, Any]:
    """The method's sampling settings (``Sampling``'s fields but the stop tokens and pad id)."""
    return dict(max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_k=config.top_k,
                top_p=config.top_p, min_p=config.min_p)


def rollout_sampling(spec: dict[str, Any], tokenizer: Any) -> Any:
    """How rollouts are sampled: the method's settings, the tokenizer's end-of-turn ids as stop tokens."""
    from posttune.plugin import Sampling, pad_id

    return Sampling(**spec["generation"], stop_token_ids=tuple(tokenizer.eos_ids), pad_id=pad_id(tokenizer))


@torch.no_grad()
def generate_rollouts(engine: Any, tokenizer: Any, prompts: dict[str, Any], epoch: int, rewards: list[Any],
                      spec: dict[str, Any], *, batch_std: Callable[..., Any] | None = None,
                      in_learner: Callable[..., Any] | None = None) -> Rollouts:
    """Complete each prompt ``group_size`` times with ``engine``, score the completions, normalise within groups.

    ``batch_std(rewards, real)``: the standard deviation for ``scale_rewards: batch`` over every
    data-parallel rank (the training process's); without it, this batch's own. ``in_learner(reward,
    prompts, completions, tools) -> [n]``: the values of a reward the method scores itself (a reward model;
    ``tools``: each row's ``tools`` field, or None).
    """
    generated = generate_completions(engine, tokenizer, prompts, epoch, spec)
    return score_completions(tokenizer, rewards, prompts, generated, spec, batch_std=batch_std,
                             in_learner=in_learner)


@torch.no_grad()
def generate_completions(engine: Any, tokenizer: Any, prompts: dict[str, Any], epoch: int,
                         spec: dict[str, Any]) -> dict[str, Any]:
    """The ``group_size`` completions of each prompt and their behaviour log-probs, unscored (plain data:
    what a Ray engine actor hands to a reward actor)."""
    from posttune.plugin import derive_seed, pad_id

    count, group = spec["batch_size"], spec["group_size"]
    prompt_ids, rows = padded_prompts(prompts, count, pad_id(tokenizer))
    repeated = [ids for ids in prompt_ids for _ in range(group)]
    seeds = [derive_seed(spec["seed"], epoch, max(row, 0), g) for row in rows for g in range(group)]
    out = engine.generate(repeated, rollout_sampling(spec, tokenizer), seeds)
    return {"prompt_ids": repeated, "rows": rows, "completions": out.token_lists(),
            "logprobs": list(out.logprobs.float().cpu())}


def score_completions(tokenizer: Any, rewards: list[Any], prompts: dict[str, Any], generated: dict[str, Any],
                      spec: dict[str, Any], *, batch_std: Callable[..., Any] | None = None,
                      in_learner: Callable[..., Any] | None = None) -> Rollouts:
    """Score ``generate_completions``' output and normalise the rewards into advantages: the Rollouts."""
    from posttune.plugin import pad_id

    group, rows, completions = spec["group_size"], generated["rows"], generated["completions"]
    repeated = generated["prompt_ids"]
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    stops = set(tokenizer.eos_ids)
    truncated = torch.tensor([float(not c or c[-1] not in stops) for c in completions])
    input_ids, labels, behaviour_logps = build_rows(repeated, completions, generated["logprobs"], pad_id(tokenizer))
    real = torch.tensor([float(row >= 0) for row in rows for _ in range(group)])
    scores = score_batch(tokenizer, rewards, spec["reward_errors"], prompts, completions, real.tolist(), group)
    total = torch.tensor(scores.total, dtype=torch.float32)
    per_reward = {name: torch.tensor(values, dtype=torch.float32) for name, values in scores.per_reward.items()}
    total = add_in_learner(tokenizer, rewards, prompts, completions, group, real, total, per_reward, in_learner)
    advantages, weights, equal = advantages_of(total, real, spec, batch_std)
    return Rollouts(input_ids, labels, behaviour_logps, advantages, weights, total, lengths,
                    torch.tensor([len(ids) for ids in repeated]), truncated,
                    torch.tensor([row for row in rows for _ in range(group)], dtype=torch.long),
                    per_reward=per_reward,
                    reward_failures=dict(scores.failures), reward_timeouts=dict(scores.timeouts),
                    equal=equal)


def advantages_of(total: torch.Tensor, real: torch.Tensor, spec: dict[str, Any],
                  batch_std: Callable[..., Any] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages, training weights, whether each row's group tied) of the rewards ``total`` ``[N]``, by the
    spec's ``scale_rewards``, ``baseline`` and ``filter_equal_rewards``; ``real`` 0 for placeholders."""
    std = batch_std(total, real) if spec["scale_rewards"] == "batch" and batch_std is not None else None
    if spec["scale_rewards"] == "batch" and std is None:
        std = total[real > 0].std() if int(real.sum()) > 1 else torch.tensor(0.0)
    advantages, equal = group_advantages(total, spec["group_size"], spec["scale_rewards"], std, spec["baseline"])
    weights = real * (~equal).float() if spec["filter_equal_rewards"] else real
    return advantages, weights, equal.float()


def penalise_kl(rollouts: Rollouts, policy_logps: torch.Tensor, beta: float, spec: dict[str, Any],
                batch_std: Callable[..., Any] | None = None) -> None:
    """The KL penalty in the reward (``kl_in_reward``: RLOO's, as TRL's ``RLOOTrainer`` and verl's
    ``use_kl_in_reward``): each completion's reward less ``beta`` times its summed log-ratio to the reference,
    ``sum_t(logp_it - ref_it)`` (the plain k1 estimate of the completion's KL, which can be negative), and the
    advantages taken again from that. ``rewards`` keeps the scored reward, the one logged; ``kl`` the sums."""
    mask = (rollouts.labels != IGNORE_INDEX).to(policy_logps.dtype)
    real = (rollouts.rows >= 0).float()
    rollouts.kl = completion_sums(policy_logps - rollouts.ref_logps, mask).squeeze(1).float() * real
    penalised = rollouts.rewards - beta * rollouts.kl
    rollouts.advantages, rollouts.weights, rollouts.equal = advantages_of(penalised, real, spec, batch_std)


def add_in_learner(tokenizer: Any, rewards: list[Any], prompts: dict[str, Any], completions: list[list[int]],
                   group: int, real: torch.Tensor, total: torch.Tensor, per_reward: dict[str, torch.Tensor],
                   in_learner: Callable[..., Any] | None) -> torch.Tensor:
    """``total`` plus the rewards the method scores itself (a reward model), each put in ``per_reward``.

    Every row is scored, placeholders too (with a real prompt), so that each rank runs the same
    forwards; ``real`` then zeroes the placeholders.
    """
    scored = [r for r in rewards if r.in_learner]
    if not scored:
        return total
    raw = list(prompts["prompts"])
    tools = list(prompts.get("fields", {}).get("tools") or [None] * len(raw))  # the rows' tool definitions
    missing = len(completions) // group - len(raw)
    raw += [raw[0] if raw else ""] * missing
    tools += [tools[0] if tools else None] * missing
    row_prompts = [raw[i // group] for i in range(len(completions))]
    row_tools = [tools[i // group] for i in range(len(completions))]
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    for reward in scored:
        values = in_learner(reward, row_prompts, texts, row_tools) * real
        per_reward[reward.name] = values
        total = total + reward.weight * values
    return total


def padded_prompts(prompts: dict[str, Any], count: int, pad: int) -> tuple[list[torch.Tensor], list[int]]:
    """The batch's prompts plus placeholders up to ``count`` (a short last share of the epoch)."""
    ids = [torch.as_tensor(p, dtype=torch.long) for p in prompts["prompt_ids"]]
    rows = [int(row) for row in prompts["rows"]]
    while len(ids) < count:
        ids.append(ids[0] if ids else torch.tensor([pad], dtype=torch.long))
        rows.append(PLACEHOLDER_ROW)
    return ids, rows
