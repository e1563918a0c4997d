"""PPO's pure tensor functions for RLHF (rewards with a KL penalty, GAE, whitening, clipped losses), with the
semantics of "The N Implementation Details of RLHF with PPO" and TRL's historical ``PPOTrainer``.

Every per-token tensor is *labels-aligned*: shape ``[N, S]``, position ``t`` holds what concerns the token
that is the *target* at ``t`` (its log-prob, the value of the state that predicts it, its reward).
``mask[N, S]`` (bool, or float where nonzero means true) is true where that target is a completion token:
contiguous within a row, starting at any offset (after the row's prompt), right-padded. A row whose mask is
all false is a placeholder and yields zeros. Outputs are exactly 0 outside the mask, and whatever lies there
in the inputs (padding, ``-inf``, NaN) reaches neither the outputs nor the gradients.
"""

from __future__ import annotations

import torch

#: added to the variance before ``rsqrt`` when whitening (TRL's value)
WHITEN_EPS = 1e-8


def penalised_scores(rewards: torch.Tensor, truncated: torch.Tensor, missing_eos_penalty: float | None) -> torch.Tensor:
    """``[N]`` the scores GAE rewards: the rollouts' rewards, less ``missing_eos_penalty`` for each completion cut
    off at ``max_new_tokens`` before its EOS (TRL's ``scores[~contain_eos_token] -= missing_eos_penalty``)."""
    if missing_eos_penalty is None:
        return rewards.clone()
    return rewards - missing_eos_penalty * truncated.to(rewards.dtype)


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the masked positions (over ``dim``, or all of them); 0 where none is masked."""
    keep = _as_bool(mask)
    total = torch.where(keep, values, 0).sum() if dim is None else torch.where(keep, values, 0).sum(dim)
    count = keep.sum() if dim is None else keep.sum(dim)
    count = count.to(total.dtype)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) * rsqrt(var + 1e-8)`` with the masked mean and unbiased (Bessel) masked variance over
    every masked position; with ``shift_mean=False`` the mean is added back (only scaled). 0 outside ``mask``;
    with fewer than 2 masked values, ``values`` unchanged inside the mask."""
    keep = _as_bool(mask)
    count = keep.sum().to(values.dtype)
    mean = masked_mean(values, keep)
    centred = torch.where(keep, values - mean, 0)
    var = masked_mean(centred**2, keep) * (count / (count - 1).clamp(min=1))
    whitened = centred * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(keep & (count >= 2), whitened, torch.where(keep, values, 0))


def token_rewards(scores: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float, kl_estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards ``[N, S]``, kl ``[N, S]``): ``-kl_coef * kl`` per completion token, plus the sequence score
    ``scores[i]`` (shape ``[N]``) at the last masked position of row ``i``.

    ``kl`` is ``logps - ref_logps`` (``"k1"``) or ``exp(ref - logp) - (ref - logp) - 1`` (``"k3"``).
    """
    keep = _as_bool(mask)
    diff = torch.where(keep, logps - ref_logps, 0)
    if kl_estimator == "k1":
        kl = diff
    elif kl_estimator == "k3":
        kl = torch.expm1(-diff) + diff
    else:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}")
    kl = torch.where(keep, kl, 0)
    positions = torch.arange(keep.shape[1], device=keep.device)
    last = torch.where(keep, positions, -1).amax(dim=1, keepdim=True)
    at_last = keep & (positions == last)
    rewards = torch.where(keep, -kl_coef * kl, 0) + torch.where(at_last, scores.unsqueeze(1).to(kl.dtype), 0)
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) by generalised advantage estimation over each row's masked positions.

    ``delta_t = r_t + gamma * V_next - V_t`` where ``V_next`` is the value at the row's next masked position,
    0 after its last (the episode ends at EOS or truncation: no bootstrap); ``A_t = delta_t + gamma * lam *
    A_next``; ``returns = A + values``. Both are targets, so detached; 0 outside ``mask``.
    """
    keep = _as_bool(mask)
    rewards = torch.where(keep, rewards.detach(), 0)
    values = torch.where(keep, values.detach(), 0)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    columns = []
    for t in reversed(range(keep.shape[1])):
        here = keep[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        columns.append(torch.where(here, adv, 0))
        next_value = torch.where(here, values[:, t], next_value)
        next_adv = torch.where(here, adv, next_adv)
    advantages = torch.stack(columns[::-1], dim=1) if columns else torch.zeros_like(values)
    returns = torch.where(keep, advantages + values, 0)
    return advantages, returns


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cliprange: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, clipped): ``max(-A * ratio, -A * clamp(ratio, 1 - c, 1 + c))`` with ``ratio =
    exp(logps - old_logps)``; ``clipped`` is 1.0 where the clamped term is strictly larger. Gradient flows to
    ``logps`` only (``old_logps`` and ``advantages`` are detached); both 0 outside ``mask``."""
    keep = _as_bool(mask)
    ratio = torch.exp(torch.where(keep, logps - old_logps.detach(), 0))
    adv = torch.where(keep, advantages.detach(), 0)
    unclipped = -adv * ratio
    clipped_term = -adv * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = torch.where(keep, torch.maximum(unclipped, clipped_term), 0)
    clipped = (keep & (clipped_term > unclipped)).to(loss.dtype)
    return loss, clipped


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, clipped): ``0.5 * max((v - R)^2, (v_clipped - R)^2)`` with ``v_clipped = old +
    clamp(v - old, -c, c)``; ``clipped`` is 1.0 where the second is strictly larger. ``cliprange_value=None``:
    ``0.5 * (v - R)^2``, nothing clipped. Gradient flows to ``values`` only; both 0 outside ``mask``."""
    keep = _as_bool(mask)
    v = torch.where(keep, values, 0)
    target = torch.where(keep, returns.detach(), 0)
    unclipped = (v - target) ** 2
    if cliprange_value is None:
        loss = torch.where(keep, 0.5 * unclipped, 0)
        return loss, torch.zeros_like(loss)
    old = torch.where(keep, old_values.detach(), 0)
    v_clipped = old + torch.clamp(v - old, -cliprange_value, cliprange_value)
    clipped_sq = (v_clipped - target) ** 2
    loss = torch.where(keep, 0.5 * torch.maximum(unclipped, clipped_sq), 0)
    clipped = (keep & (clipped_sq > unclipped)).to(loss.dtype)
    return loss, clipped
