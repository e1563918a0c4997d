"""KTO's loss, per example, from sequence log-probabilities (pure functions of tensors).

KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 7)
learns from unpaired binary feedback: each example is one completion of one prompt, marked
desirable or undesirable. With ``r = log pi(y | x) - log ref(y | x)`` the example's log-ratio
(summed over the completion's tokens) and ``z0`` the reference point, an estimate of
``KL(pi || ref)`` from mismatched (prompt, completion) pairs, clamped at 0 and detached:

- desirable:   ``loss = desirable_weight   * (1 - sigmoid(beta * (r - z0)))``
- undesirable: ``loss = undesirable_weight * (1 - sigmoid(beta * (z0 - r)))``

The implicit reward of an example is ``beta * r`` (detached), TRL's ``rewards/chosen`` for the
desirable ones and ``rewards/rejected`` for the others. The reference point is the method's
business (its batch, its ranks); here it is a number given.
"""

from __future__ import annotations

import torch


def kto_losses(policy_logps: torch.Tensor, reference_logps: torch.Tensor, desirable: torch.Tensor,
               reference_point: torch.Tensor | float, *, beta: float, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, rewards), each ``[examples]``: the weighted loss of every example and its detached reward
    ``beta * r``. ``desirable`` is a bool tensor; ``reference_point`` is ``z0`` (already clamped and detached:
    no gradient flows through it, as in the paper and TRL)."""
    log_ratios = policy_logps - reference_logps
    z0 = torch.as_tensor(reference_point, dtype=log_ratios.dtype, device=log_ratios.device).detach()
    # a desirable completion gains by rising above the reference point, an undesirable one by falling below it
    margin = torch.where(desirable, log_ratios - z0, z0 - log_ratios)
    weight = torch.full_like(log_ratios, undesirable_weight).masked_fill(desirable, desirable_weight)
    losses = weight * (1.0 - torch.sigmoid(beta * margin))
    return losses, (beta * log_ratios).detach()


def kl_reference_point(kl_sum: torch.Tensor, kl_count: torch.Tensor) -> torch.Tensor:
    """``z0``: the mean of the mismatched pairs' log-ratios ``kl_sum / kl_count``, clamped at 0 (a KL
    divergence is never negative; a negative estimate is sampling noise) and detached; 0 with no pairs."""
    return (kl_sum.detach() / kl_count.detach().clamp(min=1)).clamp(min=0)
