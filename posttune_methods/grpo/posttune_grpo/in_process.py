"""GRPO's sync mode: rollouts made in the training process(es) when the learner needs them.

For each batch of prompts the loader gives this rank: the learner's engine generates
``group_size`` completions per prompt with the current weights, they are scored and normalised
(``scale_rewards: batch`` over every data-parallel rank), and, when the loss needs them, the
policy's log-probs before any update and the reference's are taken. The learner waits for all
of it: that time is the step's ``generation_s``, not training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from posttune.plugin import ConfigError, RunConfig, Session, step_context, to_device

from posttune_grpo.loss import learner_logps, sampler_weights
from posttune_grpo.rollouts import (
    Rollouts,
    generate_rollouts,
    micro_batch_size,
    micro_batches_per_generation,
    penalise_kl,
    rollout_spec,
)
from posttune_grpo.state import count_rollouts, learner_engine

REFERENCE = "reference"
BUILTIN_ENGINE = "builtin"  # posttune-generate's engine: generate_batch on the training model itself


def validate(config: RunConfig, method: Any) -> None:
    """Generation in the learner alternates with training: ``mode: sync`` only."""
    if method.mode != "sync":
        raise ConfigError("method.generation", f"mode {method.mode} overlaps generation with training, which "
                                               "needs Ray actors: generation: ray (or leave it unset)")


def start(session: Session) -> InProcessSource:
    return InProcessSource()


class InProcessSource:
    """Rollouts from the learner's own engine, one prompt batch at a time."""

    def rollouts(self, session: Any) -> Iterator[Rollouts]:
        for prompts in session.train_data:
            yield make_rollouts(session, prompts)

    def waited_s(self, session: Any) -> float:
        """The learner's time since the last step spent not training: generating and scoring."""
        return session.method_state.generation_seconds

    def after_step(self, session: Any, record: dict[str, Any]) -> None:
        """Nothing to add: the engine is brought to the new weights when it next generates."""

    def close(self) -> None:
        """Nothing of its own: the engine and the reward workers are the method's (method.close)."""


def learner_scorer(session: Session) -> Any:
    """``(reward, prompts, completions, tools) -> [n]`` for the rewards GRPO scores itself (model_reward.py)."""
    from posttune_grpo.model_reward import model_scores

    return lambda reward, prompts, texts, tools: model_scores(session, prompts, texts, reward.options.batch_size,
                                                              tools=tools)


def make_rollouts(session: Session, prompts: dict[str, Any]) -> Rollouts:
    """Generate, score and normalise one rank's batch of prompts (padded to ``batch_size`` prompts)."""
    state = session.method_state
    started = time.perf_counter()
    session.model.eval()
    rollouts = generate_rollouts(learner_engine(session), session.tokenizer, prompts, session.epoch, state.rewards,
                                 rollout_spec(session), batch_std=lambda total, real: batch_std(session, total, real),
                                 in_learner=learner_scorer(session))
    session.model.train()
    # more than one optimizer step per generation batch: every step after the first trains a policy that
    # has moved, so the ratio needs the generating policy's log-probs (TRL records them the same way)
    several_steps = micro_batches_per_generation(session) > session.config.train.grad_accum_steps
    tis = sampled_elsewhere(session)
    add_learner_logps(session, rollouts, old=several_steps or tis, tis=tis,
                      batch_std=lambda total, real: batch_std(session, total, real))
    rollouts.seconds = time.perf_counter() - started
    count_rollouts(state, rollouts)
    return rollouts


def sampled_elsewhere(session: Session) -> bool:
    """Whether sync mode's completions come from another copy of the policy than the learner's forward (any
    engine but ``builtin``: vLLM's own weights, in its own dtype and kernels), so that the truncated importance
    weight ``pi_old / pi_behaviour`` (``method.tis_cap``) corrects the mismatch, as it does for the Ray modes.
    The builtin engine samples with the learner's own model: its log-probs differ from training's by rounding
    alone, and the correction would cost a forward for nothing."""
    config = session.method_config
    return config.tis_cap is not None and config.engine != BUILTIN_ENGINE


def add_learner_logps(session: Session, rollouts: Rollouts, *, old: bool, tis: bool = False,
                      batch_std: Callable[..., Any] | None = None) -> None:
    """Score ``rollouts`` in the learner: the policy's own log-probs before any update (``old``) and the
    reference's (when the run has one), as training computes them. With ``tis`` (and ``old``), the truncated
    importance weights of ``method.tis_cap`` and ``tis_mode`` against the sampler's log-probs. With
    ``kl_in_reward`` the rewards then pay the KL to the reference and the advantages are taken again
    (``batch_std`` as for scoring)."""
    wanted = [("old_logps", session.model)] if old else []
    if REFERENCE in session.models:
        wanted.append(("ref_logps", session.models[REFERENCE]))
    if not wanted:
        return
    session.model.eval()
    size = micro_batch_size(session)
    for name, model in wanted:
        setattr(rollouts, name, scored_by(session, rollouts, model, size))
    config = session.method_config
    if tis and config.tis_cap is not None:
        rollouts.is_weights = sampler_weights(rollouts.old_logps, rollouts.behaviour_logps, rollouts.labels, config)
    if config.kl_in_reward:
        policy = rollouts.old_logps if rollouts.old_logps is not None else scored_by(session, rollouts,
                                                                                        session.model, size)
        penalise_kl(rollouts, policy, config.beta, rollout_spec(session), batch_std)
    session.model.train()


@torch.no_grad()
def scored_by(session: Session, rollouts: Rollouts, model: Any, size: int) -> torch.Tensor:
    """``model``'s log-probs of the completion tokens, ``size`` rows at a time, as training computes them."""
    parts = []
    for batch in rollouts.micro_batches(size):
        batch = to_device(batch, session.device)
        width = batch["input_ids"].shape[1]
        with step_context(session, batch):  # loss parallel, TP's sequence padding: as in training
            logps = learner_logps(session, batch, model=model)
        parts.append(logps[:, :width].cpu())
    return torch.cat(parts)


def batch_std(session: Session, rewards: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
    """The standard deviation of every real reward of the step, over all data-parallel ranks."""
    if session.method_config.scale_rewards != "batch":
        return None
    from posttune.plugin import sum_over_token_ranks

    sums = torch.stack([(rewards * real).sum(), (rewards.square() * real).sum(), real.sum()]).double()
    total, squares, count = sum_over_token_ranks(sums.to(session.device), session).tolist()
    if count < 2:
        return torch.tensor(0.0)
    variance = max(squares - total * total / count, 0.0) / (count - 1)
    return torch.tensor(math.sqrt(variance))
