"""PPO's experience: one rank's batch of rollouts with everything the losses need, made once per batch.

    generate and score (posttune-grpo: engine, rewards, the reward model)   -> rows, scores
    policy, reference and value model on the rows (no gradient)            -> old log-probs, ref log-probs, values
    a non-builtin engine's samples (vLLM)                                  -> truncated importance weights
    token rewards = -kl_coef * KL per token, + the score at the last token  (whitened if asked)
    GAE(gamma, lam) -> advantages, returns = advantages + values           (advantages whitened by default)

Every per-token tensor is labels-aligned (``advantages.py``): the value at position t is the value
model's output at t, the state from which the completion token labelled at t is sampled. Whitening
statistics are taken over every data-parallel rank's rows, so two ranks compute what one process
does with all the rows. The experience is a plain dict of row tensors: it is what a checkpoint keeps.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from posttune.plugin import (Session, documents_as_rows, in_label_shape, pad_id, rows_as_documents, step_context,
                             sum_over_token_ranks, to_device, token_logps)
from posttune_ppo import micro_batch_size
from posttune_ppo.advantages import gae, penalised_scores, token_rewards

#: the per-row tensors of an experience batch (``[N]`` or ``[N, S]``), sliced into micro-batches
ROW_TENSORS = ("input_ids", "labels", "old_logps", "is_weights", "ref_logps", "values", "returns", "advantages", "kl",
               "scores", "rewards", "weights", "lengths", "prompt_lengths", "truncated", "rows")


@torch.no_grad()
def make_experience(session: Session, prompts: dict[str, Any]) -> dict[str, Any]:
    """Generate, score and evaluate one rank's prompt batch: the rows PPO trains ``ppo_epochs`` times on."""
    from posttune_grpo.in_process import learner_scorer, sampled_elsewhere, scored_by
    from posttune_grpo.loss import sampler_weights
    from posttune_grpo.rollouts import generate_rollouts, rollout_spec
    from posttune_grpo.state import count_rollouts, learner_engine

    config, state = session.method_config, session.method_state
    started = time.perf_counter()
    session.trainable.eval()
    rollouts = generate_rollouts(learner_engine(session), session.tokenizer, prompts, session.epoch, state.rewards,
                                 rollout_spec(session), in_learner=learner_scorer(session))
    scores = penalised_scores(rollouts.rewards, rollouts.truncated, config.missing_eos_penalty)
    batch: dict[str, Any] = {
        "input_ids": rollouts.input_ids, "labels": rollouts.labels, "scores": scores, "rewards": rollouts.rewards,
        "weights": rollouts.weights, "lengths": rollouts.lengths, "prompt_lengths": rollouts.prompt_lengths,
        "truncated": rollouts.truncated, "rows": rollouts.rows, "per_reward": dict(rollouts.per_reward),
    }
    both = forward_rows(session, batch, lambda part: torch.stack(logps_and_values(session, part)))
    batch["old_logps"], batch["values"] = both[0], both[1]
    if sampled_elsewhere(session):  # the engine's samples corrected towards the learner's policy (as GRPO's)
        batch["is_weights"] = sampler_weights(batch["old_logps"], rollouts.behaviour_logps, batch["labels"], config)
    if "reference" in session.models:  # GRPO's learner-side scoring, a training micro-batch at a time
        batch["ref_logps"] = scored_by(session, rollouts, session.models["reference"],
                                       micro_batch_size(session.config, config))
    session.trainable.train()
    add_advantages(session, batch)
    rollouts.seconds = time.perf_counter() - started
    count_rollouts(state, rollouts)
    return batch


def logps_and_values(session: Session, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, S]`` each: the policy's log-probs of the labels (at the sampling temperature) and the value at
    every position (0 where a padding-free row does not compute one: padding, a shared prompt). A value
    model of its own runs its own forward; a head on the policy reads the hidden states of the policy's one
    forward (the logits come from the same hidden states, only the labelled positions' through the head).

    Padding-free (``padding_free``), the rows go end to end as documents, each group's prompt once
    (``share_prompt``), and both results come back in the padded layout; a run whose plans reshape the
    padded batch in a step context (tensor, context, loss parallelism) takes the padded rows."""
    config, value = session.method_config, session.models["value"]
    flat = None
    if config.padding_free and not session.step_contexts:
        flat = rows_as_documents(batch["input_ids"], batch["labels"], batch["prompt_lengths"] + batch["lengths"],
                                 pad_id=pad_id(session.tokenizer), share_prompt=config.share_prompt)
    data = batch if flat is None else flat
    layout = {} if flat is None else {"document_ids": flat["document_ids"], "positions": flat["positions"]}
    if config.value_model == "model":
        logps = token_logps(session, data, temperature=config.temperature)
        values = value(data["input_ids"], **layout)[..., 0].float()
    else:
        logps, values = _head_logps_and_values(session, data, layout, value)
    if flat is None:
        return logps, values
    rows, width = batch["input_ids"].shape
    return documents_as_rows(logps, flat, rows, width), documents_as_rows(values, flat, rows, width)


def _head_logps_and_values(session: Session, data: dict[str, Any], layout: dict[str, Any],
                           value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn.functional as F

    config, labels = session.method_config, data["labels"]
    hidden = session.model(data["input_ids"], return_hidden=True, **layout)
    values = value(hidden=hidden)[..., 0].float()
    keep = labels != -100  # only the labelled positions through the head, unless tensor parallel shards it
    logits = session.model.logits_of(hidden, keep).float() / config.temperature
    if logits.dim() == labels.dim() + 1:  # the full logits
        nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
        return -nll.view(labels.shape), values
    nll = F.cross_entropy(logits, labels[keep], reduction="none")
    return in_label_shape(-nll, labels, keep), values


def completion_mask(batch: dict[str, Any]) -> torch.Tensor:
    """Where a completion token of a row that trains is the target (placeholder rows are all false)."""
    return (batch["labels"] != -100) & (batch["weights"] > 0).unsqueeze(1)


def forward_rows(session: Session, batch: dict[str, Any], forward: Any) -> torch.Tensor:
    """``forward`` over the batch's rows a training micro-batch at a time (the loss's shapes), on the run's
    device, under the run's step contexts as training runs them; the ``[..., N, S]`` result on the CPU."""
    size = micro_batch_size(session.config, session.method_config)
    parts = []
    for start in range(0, batch["input_ids"].shape[0], size):
        keys = ("input_ids", "labels", "lengths", "prompt_lengths")
        part = to_device({k: batch[k][start:start + size] for k in keys}, session.device)
        with step_context(session, part):
            parts.append(forward(part)[..., :part["input_ids"].shape[1]].float().cpu())
    return torch.cat(parts, dim=-2)


def add_advantages(session: Session, batch: dict[str, Any]) -> None:
    """Token rewards (KL-penalised, the score at the last token), GAE, returns and whitening, in ``batch``."""
    config = session.method_config
    mask = completion_mask(batch)
    ref = batch.get("ref_logps", batch["old_logps"])
    rewards, kl = token_rewards(batch["scores"], batch["old_logps"], ref, mask, config.kl_coef, config.kl_estimator)
    if config.whiten_rewards:
        rewards = whiten(session, rewards, mask, shift_mean=False)
    values = torch.where(mask, batch["values"], 0.0)
    advantages, returns = gae(rewards, values, mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = whiten(session, advantages, mask)
    batch.update(values=values, advantages=advantages, returns=returns, kl=kl)


def whiten(session: Session, values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``advantages.masked_whiten`` with the mean and unbiased variance of every data-parallel rank's masked
    values (float64 sums, one all-reduce): what one process computes over all the rows."""
    from posttune_ppo.advantages import WHITEN_EPS

    kept = values.double() * mask
    sums = torch.stack([kept.sum(), kept.square().sum(), mask.sum().double()])
    total, squares, count = sum_over_token_ranks(sums.to(session.device), session).cpu().tolist()
    if count < 2:
        return torch.where(mask, values, 0.0)
    mean = total / count
    variance = max(squares - count * mean * mean, 0.0) / (count - 1)
    whitened = (values.double() - mean) / (variance + WHITEN_EPS) ** 0.5
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened.to(values.dtype), 0.0)


def micro_batches(batch: dict[str, Any], order: torch.Tensor, size: int) -> list[dict[str, Any]]:
    """The rows in ``order``, ``size`` at a time, as loss inputs (row tensors, per-reward values, token counts)."""
    out = []
    for start in range(0, len(order), size):
        rows = order[start:start + size]
        part: dict[str, Any] = {name: batch[name][rows] for name in ROW_TENSORS if name in batch}
        part["per_reward"] = {name: values[rows] for name, values in batch["per_reward"].items()}
        real = (part["weights"] > 0).long()
        part["num_tokens"] = ((part["prompt_lengths"] + part["lengths"]) * real).sum()
        out.append(part)
    return out
