"""One chunk of the distillation loss and its gradient w.r.t. the student's logits, in closed form.

Autograd on a chunk keeps every intermediate ``[chunk, vocab]`` tensor of the divergence alive
for its backward (about nine of them); written out, the gradient needs the two log-softmaxes
and one or two buffers more, updated in place. With ``s = log_softmax(z / T)`` (student),
``t = log_softmax(teacher / T)``, ``p_s = exp(s)``, ``p_t = exp(t)``, per row:

    forward_kl = sum p_t (t - s)           d/dz = (p_s - p_t) / T
    reverse_kl = sum p_s (s - t)           d/dz = p_s (s - t - reverse_kl) / T
    jsd        = beta KL(p_t||m) + (1 - beta) KL(p_s||m),   m = beta p_t + (1 - beta) p_s
                                           d/dz = (1 - beta) p_s (s - log m - KL(p_s||m)) / T
    ce         = -log_softmax(z)[target]   d/dz = softmax(z) - onehot(target)

(for the JSD, the terms in ``p_t / m`` and ``p_s / m`` cancel: ``d jsd / d p_s = (1 - beta)
(s - log m)`` up to a constant, which the softmax's Jacobian removes). A soft-capped head
multiplies the gradient by ``1 - tanh(raw / cap)^2``. ``tests/methods/test_kd_loss.py`` checks
all of it against autograd through ``token_terms`` (``chunked.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def chunk_loss(raw: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, settings: Any,
               softcap: float | None, *, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(the chunk's summed divergence ``[]``, summed cross-entropy ``[]``, and -- if ``need_grad`` -- the
    gradient of ``kd_ratio * divergence + (1 - kd_ratio) * ce`` summed, w.r.t. ``raw``, the head's
    float32 logits before any soft-cap). Pass both logits as temporaries: they are freed, or their
    storage reused, as soon as their log-softmaxes exist."""
    temperature, ratio = settings.temperature, settings.kd_ratio
    squashed = None
    if softcap is not None:
        squashed = torch.tanh(raw / softcap)
        raw = torch.mul(squashed, softcap, out=raw)  # the capped logits, in the raw ones' storage
    if settings.vocab is not None:
        teacher_logits = teacher_logits[:, :settings.vocab]
    teacher = _log_softmax(teacher_logits, temperature)
    del teacher_logits
    student = _log_softmax(raw, temperature)
    plain = student if temperature == 1.0 else torch.log_softmax(raw, dim=-1)
    del raw
    divergence, grad = _divergence(student, teacher, settings.kind, settings.beta, need_grad and ratio > 0)
    del student, teacher
    if grad is not None:
        grad.mul_(ratio / temperature)
    rows = torch.arange(len(targets), device=targets.device)
    ce = -plain[rows, targets]  # a copy: ``plain`` is free to become the softmax
    if need_grad and ratio < 1.0:
        softmax = plain.exp_()
        softmax[rows, targets] -= 1.0
        grad = softmax.mul_(1.0 - ratio) if grad is None else grad.add_(softmax, alpha=1.0 - ratio)
    del plain
    if grad is not None and squashed is not None:
        grad.mul_(squashed.square_().neg_().add_(1.0))  # d(cap * tanh(raw / cap)) / d raw
    return divergence.sum(), ce.sum(), grad


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)


def _divergence(student: torch.Tensor, teacher: torch.Tensor, kind: str, beta: float,
                need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row divergence ``[n]`` and, if asked, its gradient w.r.t. the tempered logits times T."""
    if kind == "jsd" and beta == 0.0:
        kind = "forward_kl"
    if kind == "jsd" and beta == 1.0:
        kind = "reverse_kl"
    if kind == "forward_kl":
        p_teacher = teacher.exp()
        divergence = (teacher - student).mul_(p_teacher).sum(-1)
        grad = student.exp().sub_(p_teacher) if need_grad else None
        return divergence, grad
    p_student = student.exp()
    if kind == "reverse_kl":
        gap = student - teacher
        divergence = (gap * p_student).sum(-1)
        return divergence, (gap.sub_(divergence.unsqueeze(1)).mul_(p_student) if need_grad else None)
    if kind != "jsd":
        raise ValueError(f"unknown divergence {kind!r}")
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log(1.0 - beta))
    to_mixture = student - mixture  # s - log m
    kl_student = (to_mixture * p_student).sum(-1)
    kl_teacher = (teacher - mixture).mul_(teacher.exp()).sum(-1)
    divergence = beta * kl_teacher + (1.0 - beta) * kl_student
    if not need_grad:
        return divergence, None
    return divergence, to_mixture.sub_(kl_student.unsqueeze(1)).mul_(p_student).mul_(1.0 - beta)
