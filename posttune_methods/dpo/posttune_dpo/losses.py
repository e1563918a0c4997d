"""The preference losses, per pair, from sequence log-probabilities (pure functions of tensors).

With ``pi_c, pi_r`` the policy's and ``ref_c, ref_r`` the reference's log-probabilities of the
chosen and rejected responses, ``beta`` the strength of the implicit KL constraint and
``h = (pi_c - ref_c) - (pi_r - ref_r)``:

- ``sigmoid`` (DPO, Rafailov et al. 2023): ``z = beta * h``, ``loss = -log sigmoid(z)``. With
  ``label_smoothing`` eps (cDPO, Mitchell 2023: the label is wrong with probability eps):
  ``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``.
- ``ipo`` (Azar et al. 2023): ``loss = (h - 1 / (2 beta))^2``, a squared loss that does not
  saturate; computed on per-token *mean* log-probabilities, as TRL does.
- ``simpo`` (Meng et al. 2024), reference-free: ``z = beta * (pi_c - pi_r) - gamma`` on mean
  log-probabilities, ``loss = -log sigmoid(z)`` (label smoothing as in cDPO).
- ``hinge`` (SLiC, Zhao et al. 2023): ``loss = max(0, 1 - beta * h)``, as TRL writes it (``1 / beta``
  is the margin the log-ratio difference must clear; past it the pair gives no gradient).
- ``robust`` (rDPO, Chowdhury et al. 2024), with eps the rate at which labels are flipped:
  ``((1 - eps) * -log sigmoid(z) - eps * -log sigmoid(-z)) / (1 - 2 eps)``, an unbiased estimate of
  the clean-label DPO loss (cDPO *adds* the flipped term; rDPO subtracts it).
- ``orpo`` (Hong et al. 2024), reference-free, on mean log-probabilities: the odds of a response
  are ``p / (1 - p)`` with ``log p`` its mean log-probability, ``r = log odds(chosen) - log odds(rejected)``,
  ``loss = -pi_c - beta * log sigmoid(r)``: the chosen response's per-token NLL plus the odds-ratio
  term weighted by ``beta`` (the paper's lambda, TRL's ``ORPOConfig.beta``).

- ``sigmoid_norm``: DPO on per-token *mean* log-probabilities (no length bias either way).
- ``exo_pair`` (EXO, Ji et al. 2024, eq. 16): the reverse KL from the policy's preference,
  ``q = sigmoid(z)``, to the labels' ``(1 - eps, eps)``:
  ``q (log q - log(1 - eps)) + (1 - q) (log(1 - q) - log eps)``; ``eps`` is ``label_smoothing`` (> 0).
- ``nca_pair`` (NCA, Chen et al. 2024), on each response's own reward ``c = beta (pi_c - ref_c)``,
  ``r = beta (pi_r - ref_r)``: ``-log sigmoid(c) - log sigmoid(-c) / 2 - log sigmoid(-r) / 2``: the chosen
  response's likelihood is pushed up, not only its margin.
- ``bco_pair`` (BCO, Jung et al. 2024, on pairs, without its running reward shift, as TRL's):
  ``-log sigmoid(c) - log sigmoid(-r)``.
- ``sppo_hard`` (SPPO, Wu et al. 2024, with hard win probabilities 1 and 0):
  ``(pi_c - ref_c - 1 / (2 beta))^2 + (pi_r - ref_r + 1 / (2 beta))^2``.
- ``apo_zero`` and ``apo_down`` (APO, D'Oosterlinck et al. 2024, eq. 7 and 8): ``1 - sigmoid(c) +
  sigmoid(r)`` (the chosen responses are better than the model's own: raise them, lower the rejected);
  ``sigmoid(c) + 1 - sigmoid(beta h)`` (they are worse: lower both, the rejected more).
- ``discopop`` (DiscoPOP, Chan Lu et al. 2024, eq. 5): ``z = beta h``, ``m = sigmoid(z / tau)``,
  ``(1 - m) (-log sigmoid(z)) + m exp(-z)``: a blend of the logistic and exponential losses.
- ``aot`` and ``aot_unpaired`` (AOT, Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via
  Optimal Transport"): DPO's smoothed logistic loss on ``beta * d``, where ``d`` pairs the batch's values
  *by rank*: ``aot`` the i-th smallest policy log-ratio ``pi_c - pi_r`` with the i-th smallest reference
  one ``ref_c - ref_r``; ``aot_unpaired`` the i-th smallest chosen log-ratio ``pi_c - ref_c`` with the
  i-th smallest rejected one (the chosen responses' distribution should dominate the rejected ones', not
  each pair). A batch here is a micro-batch's real pairs (placeholders left out), as TRL sorts each
  device's batch; the loss of one sorted position is reported at the pair in that position.

The implicit rewards are ``beta * (pi - ref)`` and, for the reference-free ``simpo`` and ``orpo``,
``beta * pi``; detached. RPO's NLL term (``rpo_alpha``) is added by the method (method.py).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

LossType = Literal["sigmoid", "ipo", "simpo", "hinge", "robust", "orpo", "sigmoid_norm", "exo_pair", "nca_pair",
                   "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop", "aot", "aot_unpaired"]
#: the loss types computed on per-token mean log-probabilities (the others on sums)
LENGTH_NORMALISED: tuple[str, ...] = ("ipo", "simpo", "orpo", "sigmoid_norm")


def preference_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                      reference_chosen: torch.Tensor | None, reference_rejected: torch.Tensor | None, *,
                      loss_type: LossType, beta: float, label_smoothing: float = 0.0,
                      gamma: float = 0.0, tau: float = 0.05, f_divergence: str = "reverse_kl",
                      f_alpha: float = 0.5,
                      real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards), each ``[pairs]``; the rewards are detached. ``gamma``:
    SimPO's margin; ``tau``: DiscoPOP's temperature; ``f_divergence`` (and ``f_alpha``): f-DPO's scores in
    place of the log-ratios in ``h`` (`f_scores`); ``real``: which pairs are real (not placeholders), for the
    losses that sort the batch (``aot``, ``aot_unpaired``; default: all)."""
    if loss_type == "simpo":
        logits = beta * (policy_chosen - policy_rejected) - gamma
        losses = _smoothed_sigmoid_loss(logits, label_smoothing)
        return losses, (beta * policy_chosen).detach(), (beta * policy_rejected).detach()
    if loss_type == "orpo":
        losses = -policy_chosen - beta * F.logsigmoid(orpo_log_odds(policy_chosen, policy_rejected))
        return losses, (beta * policy_chosen).detach(), (beta * policy_rejected).detach()
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    difference = chosen_ratio - rejected_ratio
    if f_divergence != "reverse_kl":
        difference = f_scores(chosen_ratio, f_divergence, f_alpha) - f_scores(rejected_ratio, f_divergence, f_alpha)
    z, chosen, rejected = beta * difference, beta * chosen_ratio, beta * rejected_ratio
    if loss_type in ("sigmoid", "sigmoid_norm"):
        losses = _smoothed_sigmoid_loss(z, label_smoothing)
    elif loss_type == "ipo":
        losses = (chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - z)
    elif loss_type == "robust":
        losses = _robust_loss(z, label_smoothing)
    elif loss_type == "exo_pair":
        losses = (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-label_smoothing))
                  + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(label_smoothing)))
    elif loss_type == "nca_pair":
        losses = -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
    elif loss_type == "bco_pair":
        losses = -F.logsigmoid(chosen) - F.logsigmoid(-rejected)
    elif loss_type == "sppo_hard":
        losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        losses = 1.0 - torch.sigmoid(chosen) + torch.sigmoid(rejected)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(chosen) + 1.0 - torch.sigmoid(z)
    elif loss_type == "discopop":
        # m exp(-z) as exp(log m - z): exp(-z) alone overflows to inf below z = -88.7 (fp32) and inf x 0 is NaN
        losses = torch.sigmoid(-z / tau) * -F.logsigmoid(z) + torch.exp(F.logsigmoid(z / tau) - z)
    elif loss_type == "aot":
        losses = _ranked_loss(policy_chosen - policy_rejected, reference_chosen - reference_rejected, real, beta,
                              label_smoothing)
    elif loss_type == "aot_unpaired":
        losses = _ranked_loss(chosen_ratio, rejected_ratio, real, beta, label_smoothing)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses, chosen.detach(), rejected.detach()


def f_scores(log_ratio: torch.Tensor, divergence: str, alpha: float = 0.5) -> torch.Tensor:
    """f-DPO (Wang et al. 2023, "Beyond Reverse KL"): the regulariser's ``f'(pi / ref)`` in place of the
    log-ratio: ``forward_kl`` ``1 - ref / pi``; ``js_divergence`` ``log 2 + log sigmoid(log-ratio)``;
    ``alpha_divergence`` ``((pi / ref)^(alpha - 1) - 1) / (alpha - 1)`` (the log-ratio at alpha 1), its exponent
    capped at 80 so that it stays finite in fp32. ``reverse_kl`` is DPO's own: the log-ratio."""
    if divergence == "forward_kl":
        return 1.0 - torch.exp(-log_ratio)
    if divergence == "js_divergence":
        return math.log(2.0) + F.logsigmoid(log_ratio)
    if divergence == "alpha_divergence" and abs(alpha - 1.0) > 1e-6:
        return (torch.exp(torch.clamp((alpha - 1.0) * log_ratio, max=80.0)) - 1.0) / (alpha - 1.0)
    return log_ratio


def orpo_log_odds(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> torch.Tensor:
    """ORPO's log odds ratio ``log odds(chosen) - log odds(rejected)`` from per-token mean log-probabilities,
    ``log odds = log p - log(1 - p)``, with ``log(1 - p)`` computed from ``log p`` without forming ``p``
    (accurate where ``p`` is close to 0 or 1; the ORPO paper's eq. 4 and 7)."""
    return (policy_chosen - _log1mexp(policy_chosen)) - (policy_rejected - _log1mexp(policy_rejected))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``: ``log1p(-exp(x))`` far from 0, ``log(-expm1(x))`` near it (Maechler
    2012); each branch is fed only the inputs it serves, so the other cannot put a NaN in the gradient. ``x`` is
    kept a rounding step below 0: a response whose every token has probability ~1 (mean log-prob 0.0 in fp32)
    gave -inf, and ORPO's loss NaN or inf (TRL's too); there its odds term is saturated and passes no gradient."""
    split = -math.log(2.0)
    far = x < split
    return torch.where(far, torch.log1p(-torch.exp(torch.clamp(x, max=split))),
                       torch.log(-torch.expm1(torch.clamp(x, min=split, max=-torch.finfo(x.dtype).eps))))


def _smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def _ranked_loss(higher: torch.Tensor, lower: torch.Tensor, real: torch.Tensor | None, beta: float,
                 label_smoothing: float) -> torch.Tensor:
    """AOT's loss: the smoothed logistic loss of ``beta`` x (the i-th smallest of ``higher`` - the i-th smallest of
    ``lower``) over the real pairs, each sorted position's loss put at the i-th real pair (0 at placeholders)."""
    keep = torch.ones_like(higher, dtype=torch.bool) if real is None else real
    gap = torch.sort(higher[keep]).values - torch.sort(lower[keep]).values
    return torch.zeros_like(higher).masked_scatter(keep, _smoothed_sigmoid_loss(beta * gap, label_smoothing))


def _robust_loss(logits: torch.Tensor, flip_rate: float) -> torch.Tensor:
    clean, flipped = -F.logsigmoid(logits), -F.logsigmoid(-logits)
    return ((1.0 - flip_rate) * clean - flip_rate * flipped) / (1.0 - 2.0 * flip_rate)
