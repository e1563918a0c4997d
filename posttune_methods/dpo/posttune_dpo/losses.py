"""The preference losses, per pair, from sequence log-probabilities (pure functions of tensors).

With ``pi_c, pi_r`` the policy's and ``ref_c, ref_r`` the reference's log-probabilities of the
chosen and rejected responses, ``beta`` the strength of the implicit KL constraint:

- ``sigmoid`` (DPO, Rafailov et al. 2023): ``z = beta * ((pi_c - ref_c) - (pi_r - ref_r))``,
  ``loss = -log sigmoid(z)``. With ``label_smoothing`` eps (cDPO, Mitchell 2023: the label is
  wrong with probability eps): ``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``.
- ``ipo`` (Azar et al. 2023): ``h = (pi_c - ref_c) - (pi_r - ref_r)``,
  ``loss = (h - 1 / (2 beta))^2``, a squared loss that does not saturate; computed on
  per-token *mean* log-probabilities, as TRL does.
- ``simpo`` (Meng et al. 2024), reference-free: ``z = beta * (pi_c - pi_r) - gamma`` on mean
  log-probabilities, ``loss = -log sigmoid(z)`` (label smoothing as in cDPO).

The implicit rewards are ``beta * (pi - ref)`` (DPO, IPO) and ``beta * pi`` (SimPO), detached.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

LossType = Literal["sigmoid", "ipo", "simpo"]
#: the loss types computed on per-token mean log-probabilities (the others on sums)
LENGTH_NORMALISED: tuple[str, ...] = ("ipo", "simpo")


def preference_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                      reference_chosen: torch.Tensor | None, reference_rejected: torch.Tensor | None, *,
                      loss_type: LossType, beta: float, label_smoothing: float = 0.0,
                      gamma: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards), each ``[pairs]``; the rewards are detached."""
    if loss_type == "simpo":
        logits = beta * (policy_chosen - policy_rejected) - gamma
        losses = _smoothed_sigmoid_loss(logits, label_smoothing)
        return losses, (beta * policy_chosen).detach(), (beta * policy_rejected).detach()
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid_loss(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    elif loss_type == "ipo":
        losses = (chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


def _smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
