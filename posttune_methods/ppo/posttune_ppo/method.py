"""PPO's lifecycle callbacks (plugin API 2): the prompt loader, setup, the epoch's micro-batches, the loss,
the step record and checkpoint state.

    for each prompt batch of the epoch (``batches``):
        experience = make_experience(...)                 (experience.py: rollouts, values, GAE)
        for each of ppo_epochs passes, rows reshuffled:
            for each micro-batch: yield it                (num_mini_batches optimizer steps per pass)

The shuffle of pass p of the batch made at optimizer step s is seeded by (train.seed, s, p), and
the experience not yet trained on is the method's checkpoint state: a run killed between two
micro-batches resumes on exactly the rows, in exactly the order, it would have trained on.
Evaluation (greedy completions scored by the rewards), the step record (reward spread, completion
lengths, generation time) and ``close`` are posttune-grpo's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttune.plugin import DatasetConfig, LossOutput, Session
from posttune_grpo.state import GRPOState, count_trained
from posttune_ppo import micro_batch_size, rows_per_rank
from posttune_ppo.advantages import policy_loss, value_loss
from posttune_ppo.experience import completion_mask, logps_and_values, make_experience, micro_batches


@dataclass
class PPOState(GRPOState):
    """GRPO's state (rewards, engine, generation figures), with ``pending`` an experience dict and the
    step it was made at (it seeds the shuffles)."""

    made_at: int = 0


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune.plugin import prompt_loader

    from posttune_grpo.method import RolloutLoader

    prompts = prompt_loader(session, dataset, split)
    if split != "train":
        return prompts
    config, method = session.config, session.method_config
    per_batch = method.ppo_epochs * (rows_per_rank(config, method) // micro_batch_size(config, method))
    return RolloutLoader(prompts, per_batch)


def setup(session: Session) -> None:
    from posttune.plugin import check_new_tokens
    from posttune_grpo.in_process import InProcessSource
    from posttune_grpo.python_rewards import file_digests
    from posttune_grpo.scoring import resolve_rewards

    check_new_tokens(session.model, session.method_config.max_new_tokens, "method.max_new_tokens",
                     session.config.data.max_prompt_len)

    # GRPO's learner-side source: what its step record reads (the time spent generating), nothing to close
    rewards = resolve_rewards(session.method_config.rewards)
    state = PPOState(rewards=rewards, source=InProcessSource(),
                     reward_files=file_digests(reward.fn for reward in rewards))
    session.method_state = state
    if any(reward.in_learner for reward in state.rewards):
        from posttune_grpo.model_reward import load_reward_tokenizer

        state.reward_tokenizer = load_reward_tokenizer(session)


def batches(session: Session) -> Any:
    """One epoch of micro-batches: the pending experience's rest first (after a resume), then new ones."""
    state: PPOState = session.method_state
    if state.pending is not None:
        yield from _train_on(session, state)
    for prompts in session.train_data:
        state.pending, state.cursor, state.made_at = make_experience(session, prompts), 0, session.step
        yield from _train_on(session, state)


def _train_on(session: Session, state: PPOState) -> Any:
    from posttune.plugin import derive_seed

    size = micro_batch_size(session.config, session.method_config)
    rows = state.pending["input_ids"].shape[0]
    per_pass = rows // size
    while state.cursor < session.method_config.ppo_epochs * per_pass:
        ppo_epoch, index = divmod(state.cursor, per_pass)
        generator = torch.Generator().manual_seed(derive_seed(session.config.train.seed, state.made_at, ppo_epoch))
        order = torch.randperm(rows, generator=generator)
        piece = micro_batches(state.pending, order[index * size:(index + 1) * size], size)[0]
        state.cursor += 1  # before yielding: a checkpoint taken now must not train on this one again
        count_trained(state, piece)
        yield piece
    state.pending = None


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    """Clipped policy loss + ``vf_coef`` x clipped value loss, summed over completion tokens (the trainer
    divides by the step's token count: a token mean over the whole mini-batch, which TRL's per-micro-batch means
    equal with one micro-batch a step), with the metrics."""
    config = session.method_config
    logps, values = logps_and_values(session, batch)
    mask = completion_mask(batch)
    policy, policy_clipped = policy_loss(logps, batch["old_logps"], batch["advantages"], mask, config.cliprange)
    if "is_weights" in batch:  # an engine other than builtin sampled (experience.py)
        policy = policy * batch["is_weights"].to(policy.dtype)
    value, value_clipped = value_loss(values, batch["values"], batch["returns"], mask, config.cliprange_value)
    tokens = mask.sum()
    real = (batch["rows"] >= 0).float()
    rows = real.sum()
    log_ratio = torch.where(mask, logps.detach() - batch["old_logps"], 0.0)
    metrics: dict[str, Any] = {
        "reward": ((batch["rewards"] * real).sum(), rows),
        "reward_sq": ((batch["rewards"].square() * real).sum(), rows),
        "score": ((batch["scores"] * real).sum(), rows),
        "kl": ((batch["kl"] * mask).sum(), rows),  # per completion, summed over its tokens (the anchors' objective/kl)
        "non_score_reward": (-config.kl_coef * (batch["kl"] * mask).sum(), rows),  # the KL penalty, per completion
        "completion_length": ((batch["lengths"] * real).sum(), rows),
        "truncated": ((batch["truncated"] * real).sum(), rows),
        "policy_loss": (policy.detach().sum(), tokens),
        "value_loss": (value.detach().sum(), tokens),
        "clip_fraction": ((policy_clipped * mask).sum(), tokens),
        "value_clip_fraction": ((value_clipped * mask).sum(), tokens),
        "approx_kl": ((0.5 * log_ratio.square()).sum(), tokens),  # policy vs the rollout's, this pass
        "value_mean": ((batch["values"] * mask).sum(), tokens),
        "returns_mean": ((batch["returns"] * mask).sum(), tokens),
    }
    for name, values_of in batch["per_reward"].items():
        metrics[f"reward/{name}"] = ((values_of * real).sum(), rows)
    loss_sum = policy.sum() + config.vf_coef * value.sum()
    return LossOutput(loss_sum, tokens, tokens=batch["num_tokens"], metrics=metrics, unit="completion_tokens")


def state_dict(session: Session) -> dict[str, Any]:
    state: PPOState = session.method_state
    return {"pending": state.pending, "cursor": state.cursor, "made_at": state.made_at,
            "reward_files": state.reward_files}


def load_state_dict(session: Session, saved: dict[str, Any]) -> None:
    from posttune_grpo.method import warn_changed_reward_files

    state: PPOState = session.method_state
    state.pending, state.cursor, state.made_at = saved["pending"], int(saved["cursor"]), int(saved["made_at"])
    warn_changed_reward_files(saved, state.reward_files)
