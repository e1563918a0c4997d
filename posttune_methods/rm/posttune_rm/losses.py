"""The reward model's loss per pair, from the two rewards (a pure function of tensors).

Bradley-Terry (Ouyang et al. 2022, eq. 1): the chance that the chosen response wins is
``sigmoid(r_c - r_r)``; the loss is its negative log, ``-log sigmoid(r_c - r_r - m)`` with an
optional margin ``m`` (Llama 2's margin loss, Touvron et al. 2023), plus
``coefficient * (r_c + r_r)^2`` when centring is asked (Eisenstein et al. 2023: rewards are
only defined up to a constant, and this keeps their mean near 0). TRL's RewardTrainer computes
the same per pair and averages over the batch; the trainer here sums and divides by the pairs of
the whole step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, *, margin: float | torch.Tensor = 0.0,
                  center_coefficient: float | None = None) -> torch.Tensor:
    """Per-pair losses ``[pairs]`` from the chosen and rejected rewards ``[pairs]``."""
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses
