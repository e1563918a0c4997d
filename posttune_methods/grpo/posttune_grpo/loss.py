"""The GRPO objective: pure functions of tensors, and ``loss``, the method's callback that applies them
to a micro-batch of rollouts and reports what GRPO users watch (docs/grpo.md has the derivations and papers).

For completion i of a group (one prompt's ``G`` completions) with reward ``r_i``:

- advantages (``scale_rewards``): ``A_i = r_i - mean(r_group)``, divided by the group's standard
  deviation (``group``, DeepSeekMath's GRPO), by the whole batch's (``batch``), or not at all
  (``none``, Dr. GRPO: dividing by a group's std favours groups that are nearly solved);
  ``baseline: leave_one_out`` (RLOO) takes the mean of the group's other completions instead,
  ``A_i = r_i - (sum_j r_j - r_i) / (G - 1)``: a baseline independent of ``r_i``, so the estimate is
  unbiased (it is ``G / (G - 1)`` times the mean-centred one);
- per token t of completion i, with ``ratio = exp(logp - logp_old)`` (the generating policy's
  log-prob: with one optimisation pass per batch the ratio is 1 and only its gradient acts):
  ``l_it = -min(ratio * A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A_i)``
  (``epsilon_high > epsilon`` is DAPO's clip-higher), plus ``beta * KL_it`` with the k3 estimator
  ``exp(ref - logp) - (ref - logp) - 1`` (Schulman's unbiased, always-positive estimate);
- ``importance_sampling_level: sequence`` (GSPO): one ratio per completion,
  ``s_i = exp(mean_t(logp_it - logp_old_it))``, clipped as a whole; every token of completion i takes
  ``-min(s_i * A_i, clip(s_i, ...) * A_i)`` (TRL broadcasts it the same way), so the aggregation below
  sums it ``|o_i|`` times (``sequence``: once per completion, GSPO's objective). The gradient flows
  through the mean of the log-ratios: ``s_i * A_i / |o_i| * sum_t grad(logp_it)``;
  ``sequence_sum`` (RLOO, the completion as one action) takes the completion's likelihood ratio itself,
  ``exp(sum_t(logp_it - logp_old_it))``, the same way: at ratio 1 its gradient is ``A_i * sum_t grad(logp_it)``,
  REINFORCE on the whole completion;
- ``objective`` replaces the clipped surrogate: ``cispo`` (MiniMax-M1's CISPO) clips the importance
  weight instead of the update, ``l_it = -sg(min(ratio, 1 + epsilon_high)) * A_i * logp_it``: every token
  keeps a gradient, the weight only bounds it; ``sapo`` (Qwen's SAPO) replaces the hard clip by a smooth gate,
  ``l_it = -sigmoid(tau * (ratio - 1)) * 4 / tau * A_i`` with ``tau`` one temperature for positive advantages
  and another for the rest: its gradient is the policy gradient at ratio 1 and fades as the ratio moves away;
- ``delta`` (INTELLECT-2's two-sided clipping): the unclipped ratio capped at ``delta`` too, so a token with a
  negative advantage whose ratio ran far up no longer gives an unbounded term;
- ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence masking): a completion with a negative
  advantage whose mean ``logp_behaviour - logp`` over its tokens is above the threshold is left out of the
  policy term (the sampler's policy has drifted too far from the learner's to trust a push down);
- ``bias_correction_kl`` (DeepSeek-V3.2): the k3 KL term times the ratio, an unbiased KL estimate when the
  tokens were sampled by ``pi_old`` rather than the current policy (TRL's default);
- ``top_entropy_quantile`` (Wang et al. 2025, "Beyond the 80/20 Rule"): only the completion tokens whose
  entropy (of the policy's distribution at the sampling temperature) is at least the ``1 - rho`` quantile of
  the micro-batch's, over every rank holding other completions of it, take the policy term (TRL's
  ``get_high_entropy_mask``): the few "forking" tokens where the model hesitates carry the learning signal;
  the KL term and the normaliser are unchanged;
- ``mask_truncated_completions`` (DAPO's overlong filtering): a completion that hit ``max_new_tokens``
  without a stop token weighs 0, like a placeholder: out of the loss sum and out of the normaliser;
- aggregation (what the trainer divides the summed loss by, over the whole optimizer step):
  ``token`` -- every completion token weighs the same (DAPO); ``sequence`` -- each completion's
  mean over its tokens, then the mean over completions (the GRPO paper); ``constant`` -- the sum
  over tokens divided by ``max_new_tokens``, then the mean over completions (Dr. GRPO: no
  length bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from posttune.plugin import LossOutput, Session

ScaleRewards = Literal["group", "batch", "none"]
Aggregation = Literal["token", "sequence", "constant"]
Level = Literal["token", "sequence", "sequence_sum"]
Baseline = Literal["mean", "leave_one_out"]
Objective = Literal["clip", "cispo", "sapo"]
TISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
#: CISPO's default weight cap, 1 + epsilon_high: the ratio cap of 5 TRL recommends for it
CISPO_EPSILON_HIGH = 4.0
#: added to a standard deviation before dividing by it (a group of equal rewards has std 0)
STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, scale: ScaleRewards,
                     batch_std: torch.Tensor | float | None = None,
                     baseline: Baseline = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages ``[N]``, whether each completion's group has all-equal rewards ``[N]``).

    ``rewards`` holds whole groups in order (``N = groups * group_size``). Standard deviations
    are unbiased (Bessel-corrected), as TRL's. ``batch_std`` is the standard deviation over the
    whole batch (every data-parallel rank's rewards), needed for ``scale="batch"``. ``baseline``:
    what a reward is compared with, its group's mean or (``leave_one_out``, RLOO) the mean of the
    group's other rewards; the scaling then divides either the same way.
    """
    grouped = rewards.float().view(-1, group_size)
    if baseline == "mean":
        centred = grouped - grouped.mean(dim=1, keepdim=True)
    elif baseline == "leave_one_out":
        centred = grouped - (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}")
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + STD_EPS)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError("scale_rewards='batch' needs the batch's standard deviation")
        centred = centred / (torch.as_tensor(batch_std, dtype=torch.float32) + STD_EPS)
    elif scale != "none":
        raise ValueError(f"unknown scale_rewards {scale!r}")
    equal = (grouped.max(dim=1).values == grouped.min(dim=1).values).repeat_interleave(group_size)
    return centred.reshape(-1), equal


def completion_sums(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[n, 1]``: each completion's sum of ``values`` over its tokens. Outside ``mask`` the values are padding:
    zeroed, not multiplied, so no stray value can leak in."""
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum(dim=1, keepdim=True)


def tis_weights(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor,
                cap: float, mode: TISMode = "token_truncate") -> torch.Tensor:
    """Importance weights ``pi_old / pi_behaviour`` per token (0 outside ``mask``): how much more likely the
    learner's policy finds each sampled token than the engine that sampled it did. ``mode`` (TRL's
    ``vllm_importance_sampling_mode``): per token or per completion (the ratio of the whole completion, the
    same for each of its tokens); above ``cap`` truncated to it, or (``*_mask``) set to 0, leaving the token or
    completion out (masked importance sampling: a sample the learner finds far likelier than the sampler did
    is the sampler's rounding, not a signal to scale up)."""
    level, how = mode.split("_")
    log_ratio = (old_logps - behaviour_logps) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True)
    ratio = torch.exp(log_ratio)
    ratio = ratio.clamp(max=cap) if how == "truncate" else ratio.masked_fill(ratio > cap, 0.0)
    return ratio * mask


def sampler_weights(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, labels: torch.Tensor,
                    config: Any) -> torch.Tensor:
    """``tis_weights`` over the completion tokens of ``labels``, by the method's ``tis_cap`` and ``tis_mode``
    (GRPO's and PPO's)."""
    return tis_weights(old_logps, behaviour_logps, (labels != -100).float(), config.tis_cap, config.tis_mode)


@dataclass(frozen=True)
class PolicyLoss:
    """Per-token losses and what to log about them (all ``[n, s]``, 0 outside the mask)."""

    per_token: torch.Tensor
    kl: torch.Tensor | None  # the k3 estimate per token, when a reference is given
    clipped: torch.Tensor  # 1.0 where clipping removed the token's gradient (each token of a clipped sequence)
    dropped: torch.Tensor | None = None  # [n] 1.0 where the off-policy mask left the completion out


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
                mask: torch.Tensor, *, epsilon: float, epsilon_high: float | None = None,
                ref_logps: torch.Tensor | None = None, beta: float = 0.0,
                is_weights: torch.Tensor | None = None, level: Level = "token", objective: Objective = "clip",
                sapo_temperatures: tuple[float, float] = (1.0, 1.05), delta: float | None = None,
                off_policy_threshold: float | None = None, behaviour_logps: torch.Tensor | None = None,
                bias_correction_kl: bool = False, token_mask: torch.Tensor | None = None) -> PolicyLoss:
    """The clipped surrogate (plus ``beta`` times the k3 KL to the reference) per completion token.

    ``old_logps`` None means the completions were generated by this very policy (one pass per
    batch): the ratio is exactly 1 and the gradient is ``-A * grad(logp)``, REINFORCE with the
    group-normalised advantage. ``is_weights`` (rollouts from another process's engine, possibly
    stale) multiplies each token's surrogate by the truncated importance weight
    ``min(pi_old / pi_behaviour, cap)``, computed when the rollouts arrived: the clip keeps the update
    near ``pi_old`` (the learner's policy when it began on the batch), the weight corrects for the
    policy that actually sampled (truncated importance sampling; the KL term is not weighted).

    ``level="sequence"`` (GSPO) takes one ratio per completion, the exponential of its tokens' mean
    log-ratio, and clips that: the reward belongs to the whole completion, so the trust region does too
    (either all of a completion's tokens get the policy gradient or none do; single tokens' ratios are
    noisy). The surrogate is ``[n, 1]`` and broadcasts onto the completion's tokens, where the truncated
    importance weights and the KL term stay per token, as TRL's ``importance_sampling_level="sequence"``
    does. Nothing is detached but ``old_logps``: with ``old_logps`` None the ratio's value is 1 and its
    gradient, ``mean_t grad(logp_it)``, is the update. ``level="sequence_sum"`` (RLOO, TRL's
    ``RLOOTrainer``) is the same with the completion's whole likelihood ratio, the sum of the log-ratios.

    ``objective`` ``cispo`` and ``sapo`` replace the clipped surrogate (the module docstring); for them
    ``clipped`` marks where CISPO capped the weight, and nothing for SAPO, which has no hard clip.
    ``delta``, ``off_policy_threshold`` (with the sampler's ``behaviour_logps``), ``bias_correction_kl`` and
    ``token_mask`` (0 where a token takes no policy term: ``high_entropy_mask``): the module docstring;
    applied where TRL's ``GRPOTrainer`` applies them.
    """
    high = (CISPO_EPSILON_HIGH if objective == "cispo" else epsilon) if epsilon_high is None else epsilon_high
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    if level in ("sequence", "sequence_sum"):
        log_ratio = completion_sums(log_ratio, mask)
        if level == "sequence":
            log_ratio = log_ratio / lengths
    elif level != "token":
        raise ValueError(f"unknown importance sampling level {level!r}")
    ratio = torch.exp(log_ratio)
    advantage = advantages.unsqueeze(1).to(logps.dtype)
    if objective == "clip":
        unclipped = (ratio if delta is None else torch.clamp(ratio, max=delta)) * advantage
        clipped_term = torch.clamp(ratio, 1.0 - epsilon, 1.0 + high) * advantage
        per_token = -torch.minimum(unclipped, clipped_term)
        clipped = (clipped_term < unclipped).to(logps.dtype)  # min chose the clipped, gradient-free branch
    elif objective == "cispo":
        per_token = -torch.clamp(ratio, max=1.0 + high).detach() * advantage * logps
        clipped = (ratio > 1.0 + high).to(logps.dtype).expand_as(logps)
    elif objective == "sapo":
        positive, negative = sapo_temperatures
        tau = torch.where(advantage > 0, positive, negative).to(logps.dtype)
        per_token = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantage
        clipped = torch.zeros_like(logps)
    else:
        raise ValueError(f"unknown objective {objective!r}")
    dropped = None
    if off_policy_threshold is not None:
        drift = (completion_sums(behaviour_logps - logps.detach(), mask) / lengths).squeeze(1)
        dropped = ((advantages < 0) & (drift > off_policy_threshold)).to(logps.dtype)
        per_token = per_token * (1.0 - dropped).unsqueeze(1)
    if token_mask is not None:
        per_token = per_token * token_mask.to(logps.dtype)
    if is_weights is not None:
        per_token = per_token * is_weights.to(logps.dtype)
    kl = None
    if ref_logps is not None and beta:
        log_ratio_ref = ref_logps - logps
        kl = (torch.exp(log_ratio_ref) - log_ratio_ref - 1.0) * mask
        if bias_correction_kl:  # the estimate the loss takes is the one logged (as TRL logs it)
            kl = kl * ratio
        per_token = per_token + beta * kl
    return PolicyLoss(per_token * mask, kl, clipped * mask, dropped)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: Aggregation, max_new_tokens: int,
              weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, normaliser) for the trainer, who divides the step's sums by each other.

    ``weights`` ``[n]`` is 1 for a completion that trains and 0 for one left out (a placeholder,
    or a group of equal rewards when those are filtered): it counts in neither sum.
    """
    kept = mask * weights.unsqueeze(1).to(mask.dtype)
    if how == "token":
        return (per_token * kept).sum(), kept.sum()
    lengths = mask.sum(dim=1).clamp(min=1)
    per_sequence = (per_token * mask).sum(dim=1)
    if how == "sequence":
        per_sequence = per_sequence / lengths
    elif how == "constant":
        per_sequence = per_sequence / max_new_tokens
    else:
        raise ValueError(f"unknown loss aggregation {how!r}")
    return (per_sequence * weights).sum(), weights.sum()


def learner_logps(session: Session, batch: dict[str, Any], model: Any = None, *, entropies: bool = False) -> Any:
    """``[rows, width]`` log-probs of a micro-batch's labels under ``model`` (the policy by default) at the
    sampling temperature (with ``entropies``, and the entropy at each position, as ``token_logps`` gives them).
    Padding-free (``padding_free``), the rows go end to end in one row of documents, each group's prompt once
    (``share_prompt``), and the values come back in the padded layout; a method config without the settings, or a
    run whose plans reshape the padded batch in a step context (tensor, context, loss parallelism), takes the
    padded rows."""
    from posttune.plugin import documents_as_rows, pad_id, rows_as_documents, token_logps

    config = session.method_config
    if not getattr(config, "padding_free", False) or session.step_contexts:
        return token_logps(session, batch, model=model, temperature=config.temperature, entropies=entropies)
    rows, width = batch["input_ids"].shape
    flat = rows_as_documents(batch["input_ids"], batch["labels"], batch["prompt_lengths"] + batch["lengths"],
                             pad_id=pad_id(session.tokenizer), share_prompt=config.share_prompt)
    values = token_logps(session, flat, model=model, temperature=config.temperature, entropies=entropies)
    if entropies:
        return tuple(documents_as_rows(value, flat, rows, width) for value in values)
    return documents_as_rows(values, flat, rows, width)


def high_entropy_mask(entropies: torch.Tensor, considered: torch.Tensor, quantile: float,
                      session: Session | None = None) -> torch.Tensor:
    """1.0 at the ``considered`` tokens whose entropy is at least the ``1 - quantile`` quantile (linear
    interpolation, as ``torch.quantile``) of the considered tokens' entropies, on this rank and every rank
    holding other tokens of the micro-batch (``session``'s token group); 0 elsewhere. ``quantile`` 0 keeps the
    highest-entropy token(s) alone."""
    chosen = considered > 0
    values = _on_every_token_rank(entropies[chosen].float(), session)
    if values.numel() == 0:
        return torch.zeros_like(entropies)
    ordered = values.sort().values
    position = (1.0 - quantile) * (ordered.numel() - 1)
    low = int(position)
    high = min(low + 1, ordered.numel() - 1)
    threshold = torch.lerp(ordered[low], ordered[high], position - low)
    return ((entropies >= threshold) & chosen).to(entropies.dtype)


def _on_every_token_rank(values: torch.Tensor, session: Session | None) -> torch.Tensor:
    """``values`` (``[n]``, all >= 0, ``n`` differing by rank) of every rank in the token group, end to end."""
    from posttune.plugin import all_reduce_max, token_group

    group, size = token_group(session) if session is not None else (None, 1)
    if size == 1:
        return values
    longest = int(all_reduce_max(torch.tensor([values.numel()], device=values.device), group))
    padded = torch.full((longest,), -1.0, dtype=values.dtype, device=values.device)
    padded[:values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(size)]
    torch.distributed.all_gather(parts, padded, group=group)
    joined = torch.cat(parts)
    return joined[joined >= 0]


def training_weights(batch: dict[str, Any], mask_truncated: bool) -> torch.Tensor:
    """``[n]``: 1 for a completion the loss trains on, 0 for one left out. The rollouts' weights (placeholders
    and filtered groups are 0), and with ``mask_truncated`` (DAPO's overlong filtering) 0 for a completion cut
    off at ``max_new_tokens``: its reward reflects where it was cut, not what it would have said. Applied here,
    in the loss, so every mode and every saved rollout (they all keep ``truncated``) is filtered alike, and
    the left-out rows count in neither sum the trainer divides."""
    weights = batch["weights"]
    if mask_truncated:
        weights = weights * (1.0 - batch["truncated"].to(weights.dtype))
    return weights


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    """The clipped policy loss (plus KL) of a micro-batch of rollouts, aggregated, with its metrics:
    reward sums over real completions (placeholders excluded), lengths, truncation, clipping, KL."""
    config = session.method_config
    selective = config.top_entropy_quantile < 1
    if selective:
        logps, entropies = learner_logps(session, batch, entropies=True)
    else:
        logps, entropies = learner_logps(session, batch), None
    mask = (batch["labels"] != -100).to(logps.dtype)
    level, masking = config.importance_sampling_level, config.mask_truncated_completions
    weights = training_weights(batch, masking)
    kept = (weights > 0).to(logps.dtype)
    token_mask = None
    if selective:
        token_mask = high_entropy_mask(entropies, mask * kept.unsqueeze(1), config.top_entropy_quantile, session)
    beta = 0.0 if config.kl_in_reward else config.beta  # in the reward, the KL is already in the advantages
    result = policy_loss(logps, batch.get("old_logps"), batch["advantages"], mask, epsilon=config.epsilon,
                         epsilon_high=config.epsilon_high, ref_logps=batch.get("ref_logps"), beta=beta,
                         is_weights=batch.get("is_weights"), level=level, objective=config.objective,
                         sapo_temperatures=(config.sapo_temperature_pos, config.sapo_temperature_neg),
                         delta=config.delta, off_policy_threshold=config.off_policy_mask_threshold,
                         behaviour_logps=batch["behaviour_logps"], bias_correction_kl=config.bias_correction_kl,
                         token_mask=token_mask)
    loss_sum, normaliser = aggregate(result.per_token, mask, config.loss_aggregation, config.max_new_tokens, weights)
    tokens = (mask * kept.unsqueeze(1)).sum()
    real = (batch["rows"] >= 0).to(logps.dtype)  # every generated completion (not placeholders), kept or not
    if level != "token":  # one ratio per completion: the share of completions clipped
        clip_fraction = ((result.clipped.amax(dim=1) * kept).sum(), kept.sum())
    else:
        clip_fraction = ((result.clipped * kept.unsqueeze(1)).sum(), tokens)
    metrics: dict[str, Any] = {
        "reward": ((batch["rewards"] * real).sum(), real.sum()),
        "reward_sq": ((batch["rewards"].square() * real).sum(), real.sum()),
        "completion_length": ((batch["lengths"] * real).sum(), real.sum()),
        "truncated": ((batch["truncated"] * real).sum(), real.sum()),
        "clip_fraction": clip_fraction,
    }
    if masking:  # the generated completions this setting left out (truncated ones that would have trained)
        masked = batch["truncated"].to(logps.dtype) * (batch["weights"] > 0).to(logps.dtype)
        metrics["truncated_masked"] = (masked.sum(), real.sum())
    if "equal" in batch:  # rollouts saved before this metric existed have no such rows
        metrics["frac_reward_zero_std"] = ((batch["equal"] * real).sum(), real.sum())
    for name, values in batch["per_reward"].items():
        metrics[f"reward/{name}"] = ((values * real).sum(), real.sum())
    if token_mask is not None:  # the trained tokens' mean entropy, and the share of them taking the policy term
        metrics["entropy"] = ((entropies * mask * kept.unsqueeze(1)).sum(), tokens)
        metrics["entropy_selected"] = (token_mask.sum(), tokens)
    if result.dropped is not None:  # the share of the trained completions the off-policy mask left out
        metrics["off_policy_masked"] = ((result.dropped * kept).sum(), kept.sum())
    if result.kl is not None:
        metrics["kl"] = ((result.kl * kept.unsqueeze(1)).sum(), tokens)
    elif "kl" in batch:  # kl_in_reward: the completions' summed log-ratios, per token
        metrics["kl"] = ((batch["kl"] * kept).sum(), tokens)
    unit = "completion_tokens" if config.loss_aggregation == "token" else "completions"
    return LossOutput(loss_sum, normaliser, tokens=batch["num_tokens"], metrics=metrics, unit=unit)
