"""GRPO as a posttune method (plugin API 2): prompts in, rollouts generated and scored, a clipped loss.

    for each batch of prompts (``data``: the core's prompt loader):
        generate group_size completions per prompt      (the policy, seeded per completion)
        score them with the configured rewards          (rewards.py)
        advantages within each group                    (loss.py)
        for each of num_iterations passes:
            for each micro-batch: yield it              (the trainer calls ``loss`` and steps)

``batches`` is this loop; ``loss`` the clipped policy loss with optional KL to the reference.
A checkpoint can fall between two micro-batches of one generation batch: the rollouts not yet
trained on are the method's state (``state_dict``), so a resumed run trains on exactly them
before it draws the next prompts. Each completion's sampling seed derives from (run seed, epoch,
dataset row, sample index): the same completions whatever rank or batch generates them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from posttune.plugin import LossOutput, token_logps
from posttune_grpo.loss import aggregate, group_advantages, policy_loss
from posttune_grpo.rollouts import Rollouts, build_rows

REFERENCE = "reference"
PLACEHOLDER_ROW = -1


@dataclass
class GRPOState:
    """What GRPO keeps between calls: rollouts being trained on, and timings for the step's log."""

    rewards: list[Any] = field(default_factory=list)  # the resolved reward functions
    pending: Rollouts | None = None  # the generation batch being trained on
    cursor: int = 0  # micro-batches of ``pending`` already handed out (over all iterations)
    generation_seconds: float = 0.0  # since the last optimizer step
    generated_tokens: int = 0
    step_started: float = field(default_factory=time.perf_counter)
    dropped_stale: int = 0  # async mode: rollouts older than max_staleness, not trained on
    pool: Any = None  # async mode: the Ray actors (posttune_grpo.async_ray.ActorPool)
    rollout_wait_s: float = 0.0  # async mode: the learner's wait for rollouts since the last step
    rollouts_ready_when_asked: int = 0  # async mode: finished batches when the learner last asked
    versions_trained: list[int] = field(default_factory=list)  # async mode: policy versions trained on this step
    longest: int = 0  # the longest completion generated since the last optimizer step
    reward_failures: dict[str, int] = field(default_factory=dict)  # scored 0 (reward_errors: zero), this step
    reward_timeouts: dict[str, int] = field(default_factory=dict)  # of those, isolated rewards' timeouts


# ---- data -----------------------------------------------------------------------------------------

class RolloutLoader:
    """The prompt loader, with ``len()`` counting the micro-batches GRPO makes of each prompt batch."""

    def __init__(self, prompts: Any, micro_batches_per_prompt_batch: int):
        self.prompts = prompts
        self.per_batch = micro_batches_per_prompt_batch

    def __iter__(self) -> Any:
        return iter(self.prompts)

    def __len__(self) -> int:
        return len(self.prompts) * self.per_batch

    def set_epoch(self, epoch: int) -> None:
        self.prompts.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state)

    @property
    def epoch(self) -> int:
        return self.prompts.epoch


def data(session: Any, dataset: Any, split: str) -> Any:
    from posttune.plugin import prompt_loader

    prompts = prompt_loader(session, dataset, split)
    if split != "train":
        return prompts
    return RolloutLoader(prompts, micro_batches_per_generation(session))


def rows_per_rank(session: Any) -> int:
    return session.config.train.batch_size * session.method_config.group_size


def micro_batch_size(session: Any) -> int:
    return session.method_config.micro_batch_size or rows_per_rank(session)


def micro_batches_per_generation(session: Any) -> int:
    return session.method_config.num_iterations * (rows_per_rank(session) // micro_batch_size(session))


# ---- rollouts -----------------------------------------------------------------------------------

def batches(session: Any) -> Any:
    """One epoch of micro-batches: the pending rollouts' rest first (after a resume), then new ones."""
    state: GRPOState = session.method_state
    if state.pending is not None:
        yield from _train_on(session, state)
    for prompts in session.train_data:
        state.pending, state.cursor = make_rollouts(session, prompts), 0
        yield from _train_on(session, state)


def _train_on(session: Any, state: GRPOState) -> Any:
    pieces = state.pending.micro_batches(micro_batch_size(session))
    total = session.method_config.num_iterations * len(pieces)
    while state.cursor < total:
        piece = pieces[state.cursor % len(pieces)]
        state.cursor += 1  # before yielding: a checkpoint taken now must not train on this one again
        yield piece
    state.pending = None


def make_rollouts(session: Any, prompts: dict[str, Any]) -> Rollouts:
    """Generate, score and normalise one rank's batch of prompts (padded to ``batch_size`` prompts)."""
    state = session.method_state
    started = time.perf_counter()
    session.model.eval()
    rollouts = generate_rollouts(session.model, session.tokenizer, prompts, session.epoch, state.rewards,
                                 rollout_spec(session), batch_std=lambda total, real: _batch_std(session, total, real),
                                 engine=session.generation_engine)
    _score_with_models(session, rollouts)
    session.model.train()
    rollouts.seconds = time.perf_counter() - started
    count_rollouts(state, rollouts)
    return rollouts


def count_rollouts(state: GRPOState, rollouts: Rollouts) -> None:
    """Add a batch of rollouts to the generation figures the next step record reports (sync and async)."""
    real = (rollouts.rows >= 0).long()
    state.generation_seconds += rollouts.seconds
    state.generated_tokens += int((rollouts.lengths * real).sum())
    state.longest = max(state.longest, int((rollouts.lengths * real).max()))
    for name, count in rollouts.reward_failures.items():
        state.reward_failures[name] = state.reward_failures.get(name, 0) + count
    for name, count in rollouts.reward_timeouts.items():
        state.reward_timeouts[name] = state.reward_timeouts.get(name, 0) + count


def rollout_spec(session: Any) -> dict[str, Any]:
    """The settings ``generate_rollouts`` reads (also what an async actor receives)."""
    config = session.method_config
    return {
        "generation": dict(max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_k=config.top_k,
                           top_p=config.top_p, min_p=config.min_p),
        "group_size": config.group_size, "batch_size": session.config.train.batch_size,
        "seed": session.config.train.seed, "scale_rewards": config.scale_rewards,
        "filter_equal_rewards": config.filter_equal_rewards, "reward_errors": config.reward_errors,
    }


@torch.no_grad()
def generate_rollouts(model: Any, tokenizer: Any, prompts: dict[str, Any], epoch: int, rewards: list[Any],
                      spec: dict[str, Any], *, batch_std: Any = None, engine: Any = None) -> Rollouts:
    """Complete each prompt ``group_size`` times, score the completions, normalise within groups.

    Shared by the sync learner and the async actors. Completion g of the prompt at dataset row r
    samples with seed ``derive_seed(seed, epoch, r, g)``: the same whoever generates it. ``engine``
    (``session.generation_engine``) replaces the core's ``generate_batch``, with its signature.
    """
    from posttune.plugin import derive_seed, generate_batch

    generate_batch = engine or generate_batch
    count, group = spec["batch_size"], spec["group_size"]
    pad = _pad_id(tokenizer)
    prompt_ids, rows = padded_prompts(prompts, count, pad)
    repeated = [ids for ids in prompt_ids for _ in range(group)]
    seeds = [derive_seed(spec["seed"], epoch, max(row, 0), g) for row in rows for g in range(group)]
    out = generate_batch(model, repeated, **spec["generation"], seeds=seeds, stop_token_ids=tokenizer.eos_ids,
                         pad_id=pad)
    completions = out.token_lists()
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    stops = set(tokenizer.eos_ids)
    truncated = torch.tensor([float(not c or c[-1] not in stops) for c in completions])
    input_ids, labels, behaviour_logps = build_rows(repeated, completions, list(out.logprobs.float().cpu()), pad)
    real = torch.tensor([float(row >= 0) for row in rows for _ in range(group)])
    scores = _score(tokenizer, rewards, spec["reward_errors"], prompts, completions, real, group)
    total = torch.tensor(scores.total, dtype=torch.float32)
    std = batch_std(total, real) if spec["scale_rewards"] == "batch" and batch_std is not None else None
    if spec["scale_rewards"] == "batch" and std is None:
        std = total[real > 0].std() if int(real.sum()) > 1 else torch.tensor(0.0)
    advantages, equal = group_advantages(total, group, spec["scale_rewards"], std)
    weights = real * (~equal).float() if spec["filter_equal_rewards"] else real
    return Rollouts(input_ids, labels, behaviour_logps, advantages, weights, total, lengths,
                    torch.tensor([len(ids) for ids in repeated]), truncated,
                    torch.tensor([row for row in rows for _ in range(group)], dtype=torch.long),
                    per_reward={name: torch.tensor(values, dtype=torch.float32)
                                for name, values in scores.per_reward.items()},
                    reward_failures=dict(scores.failures), reward_timeouts=dict(scores.timeouts),
                    equal=equal.float())


def padded_prompts(prompts: dict[str, Any], count: int, pad: int) -> tuple[list[torch.Tensor], list[int]]:
    """The batch's prompts plus placeholders up to ``count`` (a short last share of the epoch)."""
    ids = [torch.as_tensor(p, dtype=torch.long) for p in prompts["prompt_ids"]]
    rows = [int(row) for row in prompts["rows"]]
    while len(ids) < count:
        ids.append(ids[0] if ids else torch.tensor([pad], dtype=torch.long))
        rows.append(PLACEHOLDER_ROW)
    return ids, rows


def _score(tokenizer: Any, rewards: list[Any], on_error: str, prompts: dict[str, Any],
           completions: list[list[int]], real: torch.Tensor, group: int) -> Any:
    """Every reward on the real completions (placeholders score 0 without calling anyone)."""
    from posttune_grpo.rewards import Scores, score

    keep = [i for i, flag in enumerate(real.tolist()) if flag]
    texts = [tokenizer.decode(completions[i], skip_special_tokens=True) for i in keep]
    source = [j for j in range(len(prompts["prompts"])) for _ in range(group)]
    fields = {name: [values[source[i]] for i in keep] for name, values in prompts["fields"].items()}
    scored = score(rewards, [prompts["prompts"][source[i]] for i in keep], texts, fields,
                   completion_ids=[completions[i] for i in keep], on_error=on_error)
    total, per_reward = [0.0] * len(completions), {name: [0.0] * len(completions) for name in scored.per_reward}
    for position, i in enumerate(keep):
        total[i] = scored.total[position]
        for name, values in scored.per_reward.items():
            per_reward[name][i] = values[position]
    return Scores(total, per_reward, scored.failures, scored.timeouts)


def _batch_std(session: Any, rewards: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
    """The standard deviation of every real reward of the step, over all data-parallel ranks."""
    if session.method_config.scale_rewards != "batch":
        return None
    from posttune.plugin import sum_over_token_ranks

    sums = torch.stack([(rewards * real).sum(), (rewards.square() * real).sum(), real.sum()]).double()
    total, squares, count = sum_over_token_ranks(sums.to(session.device), session.mesh).tolist()
    if count < 2:
        return torch.tensor(0.0)
    variance = max(squares - total * total / count, 0.0) / (count - 1)
    return torch.tensor(math.sqrt(variance))


@torch.no_grad()
def _score_with_models(session: Any, rollouts: Rollouts) -> None:
    """The policy's log-probs before any update (for more than one pass) and the reference's (for KL)."""
    config = session.method_config
    wanted = []
    if micro_batches_per_generation(session) > session.config.train.grad_accum_steps:
        # more than one optimizer step per generation batch: every step after the first trains a policy that
        # has moved, so the ratio needs the generating policy's log-probs (TRL records them the same way)
        wanted.append(("old_logps", session.model))
    if REFERENCE in session.models:
        wanted.append(("ref_logps", session.models[REFERENCE]))
    from posttune.plugin import step_context

    size = micro_batch_size(session)
    for name, model in wanted:
        parts = []
        for batch in rollouts.micro_batches(size):
            batch = _device(session, batch)
            width = batch["input_ids"].shape[1]
            with step_context(session, batch):  # loss parallel, TP's sequence padding: as in training
                logps = token_logps(session, batch, model=model, temperature=config.temperature)
            parts.append(logps[:, :width].cpu())
        setattr(rollouts, name, torch.cat(parts))


def _device(session: Any, batch: dict[str, Any]) -> dict[str, Any]:
    from posttune.plugin import to_device

    return to_device(batch, session.device)


def _pad_id(tokenizer: Any) -> int:
    from posttune.plugin import pad_id

    return pad_id(tokenizer)


# ---- the loss -----------------------------------------------------------------------------------

def loss(session: Any, batch: dict[str, Any]) -> LossOutput:
    config = session.method_config
    logps = token_logps(session, batch, temperature=config.temperature)
    mask = (batch["labels"] != -100).to(logps.dtype)
    result = policy_loss(logps, batch.get("old_logps"), batch["advantages"], mask, epsilon=config.epsilon,
                         epsilon_high=config.epsilon_high, ref_logps=batch.get("ref_logps"), beta=config.beta)
    loss_sum, normaliser = aggregate(result.per_token, mask, config.loss_aggregation, config.max_new_tokens,
                                     batch["weights"])
    kept = (batch["weights"] > 0).to(logps.dtype)
    tokens = (mask * kept.unsqueeze(1)).sum()
    real = (batch["rows"] >= 0).to(logps.dtype)  # every generated completion (not placeholders), kept or not
    metrics: dict[str, Any] = {
        "reward": ((batch["rewards"] * real).sum(), real.sum()),
        "reward_sq": ((batch["rewards"].square() * real).sum(), real.sum()),
        "completion_length": ((batch["lengths"] * real).sum(), real.sum()),
        "truncated": ((batch["truncated"] * real).sum(), real.sum()),
        "clip_fraction": ((result.clipped * kept.unsqueeze(1)).sum(), tokens),
    }
    if "equal" in batch:  # rollouts saved before this metric existed have no such rows
        metrics["frac_reward_zero_std"] = ((batch["equal"] * real).sum(), real.sum())
    for name, values in batch["per_reward"].items():
        metrics[f"reward/{name}"] = ((values * real).sum(), real.sum())
    if result.kl is not None:
        metrics["kl"] = ((result.kl * kept.unsqueeze(1)).sum(), tokens)
    unit = "completion_tokens" if config.loss_aggregation == "token" else "completions"
    return LossOutput(loss_sum, normaliser, tokens=batch["num_tokens"], metrics=metrics, unit=unit)


# ---- lifecycle ------------------------------------------------------------------------------------

def setup(session: Any) -> None:
    from posttune_grpo.rewards import resolve_rewards

    session.method_state = GRPOState(rewards=resolve_rewards(session.method_config.rewards))


def on_step_end(session: Any, record: dict[str, Any]) -> None:
    """Reward spread, the longest completion, generation throughput and the split of the step's time."""
    from posttune.plugin import all_reduce_max

    state: GRPOState = session.method_state
    record["completion_length_max"] = int(all_reduce_max(torch.tensor(float(state.longest), device=session.device)))
    mean, mean_sq = record.get("reward"), record.pop("reward_sq", None)
    if mean is not None and mean_sq is not None:
        record["reward_std"] = math.sqrt(max(mean_sq - mean * mean, 0.0))
    elapsed = time.perf_counter() - state.step_started
    record["generation_s"] = state.generation_seconds
    waited = state.rollout_wait_s if session.method_config.mode == "async" else state.generation_seconds
    record["training_s"] = max(elapsed - waited, 0.0)  # async: generation overlaps; only the wait is not training
    for name, count in state.reward_failures.items():
        record[f"reward_failures/{name}"] = count
    for name, count in state.reward_timeouts.items():
        record[f"reward_timeouts/{name}"] = count
    state.reward_failures, state.reward_timeouts = {}, {}
    if state.generation_seconds:
        record["generation_tokens_per_s"] = state.generated_tokens / state.generation_seconds
    state.generation_seconds, state.generated_tokens, state.longest = 0.0, 0, 0
    state.step_started = time.perf_counter()
    if session.method_config.mode == "async":
        from posttune_grpo.async_ray import after_step

        after_step(session, record)


def state_dict(session: Any) -> dict[str, Any]:
    state: GRPOState = session.method_state
    return {"pending": None if state.pending is None else state.pending.state_dict(), "cursor": state.cursor}


def load_state_dict(session: Any, saved: dict[str, Any]) -> None:
    state: GRPOState = session.method_state
    state.pending = None if saved["pending"] is None else Rollouts.from_state(saved["pending"])
    state.cursor = int(saved["cursor"])


@torch.no_grad()
def evaluate(session: Any) -> dict[str, float]:
    """Greedy answers to every validation prompt, scored: mean reward (total and per function)."""
    from posttune.plugin import generate_batch, sum_over_token_ranks

    config = session.method_config
    generate = session.generation_engine or generate_batch
    totals: dict[str, list[float]] = {}
    for prompts in session.validation_data:
        prompt_ids, rows = padded_prompts(prompts, session.config.train.batch_size, _pad_id(session.tokenizer))
        out = generate(session.model, prompt_ids, max_new_tokens=config.max_new_tokens,
                       stop_token_ids=session.tokenizer.eos_ids, pad_id=_pad_id(session.tokenizer))
        completions = out.token_lists()
        real = torch.tensor([float(row >= 0) for row in rows])
        scores = _score(session.tokenizer, session.method_state.rewards, config.reward_errors, prompts,
                        completions, real, 1)
        values = {"reward": scores.total, **{f"reward/{n}": v for n, v in scores.per_reward.items()},
                  "completion_length": [float(len(c)) for c in completions]}
        for name, column in values.items():
            sums = totals.setdefault(name, [0.0, 0.0])
            sums[0] += float((torch.tensor(column) * real).sum())
            sums[1] += float(real.sum())
    keys = sorted(totals)
    if not keys:
        return {}
    flat = torch.tensor([value for key in keys for value in totals[key]], dtype=torch.float64)
    flat = sum_over_token_ranks(flat.to(session.device), session.mesh).tolist()
    return {key: flat[2 * i] / max(flat[2 * i + 1], 1.0) for i, key in enumerate(keys)}
