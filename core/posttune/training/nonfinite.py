"""The non-finite guard: a NaN/Inf loss or gradient norm never reaches the weights or the disk.

Checked at every optimizer step on the step's global loss (reduced over ranks in
``Window.reduce``) and the global gradient norm, so every rank takes the same decision.
Without ``train.skip_nonfinite`` such a step stops the run (exit 2) before the optimizer
steps; with it, up to that many steps are skipped: the gradients are dropped, the optimizer
does not step, but the step still counts (the data and the LR schedule move on, so step
numbers keep matching the data position on resume). Weights that became non-finite anyway
(an infinite learning rate turns finite gradients into NaN weights) are caught before any
checkpoint or final model is written. docs/training.md, "The non-finite guard".
"""

from __future__ import annotations

import math
from typing import Any

import torch

from posttune.errors import PosttuneError


class NonFiniteError(PosttuneError):
    """The run met a NaN or Inf it was not allowed to skip; nothing of that step was saved."""


def step_problem(loss: float, grad_norm: float) -> str | None:
    """``"loss"`` or ``"grad norm"`` when that value of the step is NaN or Inf, else None."""
    if not math.isfinite(loss):
        return "loss"
    if not math.isfinite(grad_norm):
        return "grad norm"
    return None


def skip_or_stop(session: Any, step: int, what: str, value: float) -> None:
    """Count one skipped step, or raise when ``train.skip_nonfinite`` steps were already skipped."""
    allowed = session.config.train.skip_nonfinite
    if session.skipped_nonfinite >= allowed:
        already = (f" after skipping {session.skipped_nonfinite} such step(s) (train.skip_nonfinite: {allowed})"
                   if allowed else " (train.skip_nonfinite lets a run skip such steps)")
        raise NonFiniteError(f"train: step {step}: the {what} is {value}; stopped{already}, without saving this "
                             "step: the last checkpoint is the last good state")
    session.skipped_nonfinite += 1


def check_weights(session: Any, before: str) -> None:
    """Refuse to write trainable weights that hold NaN or Inf (collective: every rank calls it)."""
    from posttune.training import distributed

    finite = torch.ones((), dtype=torch.bool, device=session.device)
    for param in session.model.parameters():
        if param.requires_grad:  # frozen weights do not change
            local = param.detach().to_local() if distributed.is_dtensor(param) else param.detach()
            finite &= torch.isfinite(local).all().to(finite.device)  # one sync at the end, not one per tensor
    bad = (~finite).float().reshape(1)
    if bool(distributed.all_reduce_max(bad).item()):
        raise NonFiniteError(f"train: step {session.step}: the trained weights hold NaN or Inf (is train.lr too "
                             f"large?); stopped before writing {before}, which would hold them")
