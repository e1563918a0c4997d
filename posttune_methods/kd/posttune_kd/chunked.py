"""The distillation loss from two models' hidden states, a chunk of trained tokens at a time.

Distilling an 8B teacher into a 1B student over a 128k vocabulary, the two heads' logits for
2048 tokens are 1 GiB each in float32, and their log-softmaxes and the logits' gradient as much
again. Here only ``chunk_size`` trained tokens are projected to the vocabulary at once, by both
heads, and each chunk's loss *and* its gradient w.r.t. the student's hidden rows and head are
computed right there in the forward pass (the teacher's logits are needed for nothing else), so
the chunk's logits are freed before the next chunk. The chunk's gradient w.r.t. the student's
logits is written out (``chunk_math.py``), in place, so a chunk costs a few ``[chunk, vocab]``
buffers, not the dozen autograd would keep. Backward only scales the stored gradients: no
logits are recomputed, and the teacher is not needed after the forward pass.

Soft-capped heads (Gemma) are capped per chunk, the cap's derivative included. The student's
head may be adapted (LoRA/DoRA: ``head_weight`` folds it into one differentiable weight, and
autograd carries the weight's gradient on to the adapters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from posttune_kd.chunk_math import chunk_loss
from posttune_kd.divergences import Divergence, divergence_from_logps


@dataclass(frozen=True)
class Head:
    """A model's output head as the loss needs it: weight ``[vocab, hidden]``, bias, final-logit soft-cap."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32, soft-capped logits of ``hidden`` rows ``[n, hidden]``."""
        return cap(F.linear(hidden, self.weight, self.bias).float(), self.softcap)


@dataclass(frozen=True)
class Settings:
    kind: Divergence = "forward_kl"
    temperature: float = 1.0
    beta: float = 0.5
    kd_ratio: float = 1.0  # the divergence's weight; 1 - kd_ratio weighs the cross-entropy to the labels
    vocab: int | None = None  # the student's vocabulary: a teacher's logits past it (padding) are dropped


class KDSums(NamedTuple):
    """Sums over the trained tokens: the loss (differentiable), and its two terms (for the logs)."""

    loss: torch.Tensor
    divergence: torch.Tensor
    ce: torch.Tensor


def cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def token_terms(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                settings: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row ``[n]``: the divergence (tempered) and the cross-entropy of the student to ``targets``."""
    teacher_logits = teacher_logits[:, :settings.vocab] if settings.vocab is not None else teacher_logits
    tempered = F.log_softmax(student_logits.float() / settings.temperature, dim=-1)
    divergence = divergence_from_logps(tempered, F.log_softmax(teacher_logits.float() / settings.temperature, -1),
                                       settings.kind, beta=settings.beta)
    plain = tempered if settings.temperature == 1.0 else F.log_softmax(student_logits.float(), dim=-1)
    return divergence, -plain.gather(1, targets.unsqueeze(1)).squeeze(1)


def mixed(divergence: torch.Tensor, ce: torch.Tensor, kd_ratio: float) -> torch.Tensor:
    """``kd_ratio * divergence + (1 - kd_ratio) * cross-entropy``."""
    return kd_ratio * divergence + (1.0 - kd_ratio) * ce if kd_ratio < 1.0 else divergence


def plain_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                  settings: Settings) -> KDSums:
    """The loss from full ``[n, vocab]`` logits (a tensor-parallel head; a model without hidden states)."""
    divergence, ce = token_terms(student_logits, teacher_logits, targets, settings)
    return KDSums(mixed(divergence, ce, settings.kd_ratio).sum(), divergence.detach().sum(), ce.detach().sum())


def chunked_kd_loss(student_hidden: torch.Tensor, student: Head, teacher_hidden: torch.Tensor, teacher: Head,
                    targets: torch.Tensor, settings: Settings, *, chunk_size: int = 512) -> KDSums:
    """``plain_kd_loss`` of the two heads applied to ``[n, hidden]`` rows, with at most ``chunk_size``
    rows of either head's logits alive at once; differentiable w.r.t. the student's rows and head."""
    # under no_grad (evaluation) ``needs_input_grad`` still says a trainable head needs one: ask the grad mode
    loss, divergence, ce = _ChunkedKD.apply(student_hidden, student.weight, student.bias, student.softcap,
                                            teacher_hidden.detach(), teacher, targets, settings, chunk_size,
                                            torch.is_grad_enabled())
    return KDSums(loss, divergence, ce)


class _ChunkedKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                softcap: float | None, teacher_hidden: torch.Tensor, teacher: Head, targets: torch.Tensor,
                settings: Settings, chunk_size: int, grad_enabled: bool = True,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        need_hidden, need_weight, need_bias = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        need = need_hidden or need_weight or need_bias
        sums = torch.zeros(3, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows, chunk = hidden[start:start + chunk_size], slice(start, start + chunk_size)
            # Both logits passed as temporaries: chunk_loss frees them as soon as it can.
            divergence, ce, grad = chunk_loss(F.linear(rows, weight, bias).float(),
                                              teacher.logits(teacher_hidden[chunk]), targets[chunk], settings,
                                              softcap, need_grad=need)
            if grad is not None:
                if need_bias:
                    grad_bias += grad.sum(0)
                grad = grad.to(weight.dtype)
                if need_hidden:
                    torch.matmul(grad, weight, out=grad_hidden[chunk])
                if need_weight:  # low precision as a plain backward's matmul, summed over chunks in fp32
                    grad_weight += (grad.T @ rows).float()
                del grad
            sums += torch.stack([mixed(divergence, ce, settings.kd_ratio), divergence, ce])
        ctx.grads = [grad_hidden, grad_weight, grad_bias]
        ctx.dtypes = [hidden.dtype, weight.dtype, None if bias is None else bias.dtype]
        loss, divergence, ce = sums.unbind()
        ctx.mark_non_differentiable(divergence, ce)
        return loss, divergence, ce

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError("kd: backward ran twice through one chunked loss (retain_graph); compute it again")
        grads, ctx.grads = ctx.grads, None
        scale = None if bool(grad_loss == 1.0) else grad_loss
        out = []
        for grad, dtype in zip(grads, ctx.dtypes, strict=True):
            if grad is not None:
                if scale is not None:
                    grad.mul_(scale.to(grad.dtype))
                grad = grad.to(dtype)
            out.append(grad)
        return (*out, None, None, None, None, None, None, None)
