"""Token-level divergences between a teacher's and a student's next-token distributions.

With ``p_t = softmax(teacher_logits / T)`` and ``p_s = softmax(student_logits / T)`` per token:

- ``forward_kl``: ``KL(p_t || p_s) = sum p_t (log p_t - log p_s)`` -- mean-seeking: the student
  covers everything the teacher gives weight to (classic distillation, Hinton et al. 2015).
- ``reverse_kl``: ``KL(p_s || p_t)`` -- mode-seeking: the student puts its weight where the
  teacher does (MiniLLM, Gu et al. 2024).
- ``jsd``: the generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024) with the
  mixture ``m = beta * p_t + (1 - beta) * p_s``:
  ``beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)``. That vanishes at ``beta`` 0 and 1, so
  there (as in TRL's GKD) it is defined as forward and reverse KL, which it approaches after
  division by ``beta`` and ``1 - beta``.

The temperature divides both logits; the result is not rescaled by ``T^2`` (as in GKD and TRL).
Every function returns one value per row of its ``[n, vocab]`` inputs.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: Divergence, *,
                     temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """``[n]`` divergence per token between teacher and student logits ``[n, vocab]`` (float32)."""
    return divergence_from_logps(F.log_softmax(student_logits.float() / temperature, dim=-1),
                                 F.log_softmax(teacher_logits.float() / temperature, dim=-1), kind, beta=beta)


def divergence_from_logps(student: torch.Tensor, teacher: torch.Tensor, kind: Divergence, *,
                          beta: float = 0.5) -> torch.Tensor:
    """``[n]`` divergence per token from the two models' (tempered) log-probabilities ``[n, vocab]``."""
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return _kl(teacher, student)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return _kl(student, teacher)
    if kind != "jsd":
        raise ValueError(f"unknown divergence {kind!r}")
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log(1.0 - beta))
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` per row from log-probabilities (finite: log-softmax of finite logits)."""
    return (p_log.exp() * (p_log - q_log)).sum(dim=-1)
