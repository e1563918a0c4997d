"""The non-finite guard: a NaN/Inf loss or gradient norm never reaches the weights or the disk.

Checked at every optimizer step on the step's global loss (reduced over ranks in
``Window.reduce``) and the global gradient norm, so every rank takes the same decision.
Without ``train.skip_nonfinite`` such a step stops the run (exit 2) before the optimizer
steps; with it, up to that many steps are skipped: the gradients are dropped, the optimizer
does not step, but the step still counts (the data and the LR schedule move on, so step
numbers keep matching the data position on resume). Weights that became non-finite anyway
(an infinite learning rate turns finite gradients into NaN weights) are caught before any
checkpoint or final model is written.

Finite weights are not enough to trust a checkpoint: an overflowing update can leave weights
that are finite but so large that the next step's loss is NaN. So the newest checkpoint is *on
probation* until the next optimizer step, which runs on its weights, ends with a finite loss and
gradient norm that are not exploding (not ``EXPLODING`` times the median of the run's recent good
steps). Until then the newest trusted checkpoint before it is kept too (beyond ``keep_last`` only
when ``keep_last`` is 1: otherwise it is one of the newest ``keep_last`` already); a checkpoint
that fails is renamed ``step-N.unstable``, which ``resume: latest`` never picks.
docs/training.md, "The non-finite guard".
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from posttune.errors import PosttuneError
from posttune.training import output_dir


class NonFiniteError(PosttuneError):
    """The run met a NaN or Inf it was not allowed to skip; nothing of that step was saved."""


def step_problem(loss: float, grad_norm: float) -> str | None:
    """``"loss"`` or ``"grad norm"`` when that value of the step is NaN or Inf, else None."""
    if not math.isfinite(loss):
        return "loss"
    if not math.isfinite(grad_norm):
        return "grad norm"
    return None


def skip_or_stop(session: Any, step: int, what: str, value: float, probation: Probation | None = None) -> None:
    """Count one skipped step, or raise when ``train.skip_nonfinite`` steps were already skipped
    (the checkpoint on probation, whose weights gave this value, is marked unstable first)."""
    allowed = session.config.train.skip_nonfinite
    if session.skipped_nonfinite >= allowed:
        already = (f" after skipping {session.skipped_nonfinite} such step(s) (train.skip_nonfinite: {allowed})"
                   if allowed else " (train.skip_nonfinite lets a run skip such steps)")
        last = probation.failed(session, f"step {step}'s {what} was {value}") if probation is not None else None
        trusted = (f"the last trusted checkpoint is {last.name} (checkpoint.resume=latest continues from it)"
                   if last is not None else "no trusted checkpoint is left (checkpoint.resume=latest starts afresh)")
        raise NonFiniteError(f"train: step {step}: the {what} is {value}; stopped{already}, without saving this "
                             f"step; {trusted}")
    session.skipped_nonfinite += 1


#: a step whose |loss| or gradient norm exceeds this many times the median of the run's recent good
#: steps is exploding (losses are compared from LOSS_FLOOR up: GRPO's hover near zero)
EXPLODING = 100.0
LOSS_FLOOR = 0.1
HISTORY = 100
UNSTABLE = ".unstable"


class Probation:
    """Judges each new checkpoint by the step that runs on its weights (rank 0 renames and prunes)."""

    def __init__(self, session: Any, records: Iterable[Mapping[str, Any]] = (), best: Any = None):
        from posttune.training import distributed

        self.main = distributed.is_main()
        self.best = best  # a `posttune.training.best.Best`: its checkpoint is never pruned
        self.pending: Path | None = session.resume_from  # a resumed checkpoint is judged by its first step
        self.losses: deque[float] = deque(maxlen=HISTORY)
        self.grad_norms: deque[float] = deque(maxlen=HISTORY)
        for record in records:  # the resumed run's history, from metrics.jsonl
            if isinstance(record.get("loss"), (int, float)) and isinstance(record.get("grad_norm"), (int, float)):
                self._remember(record["loss"], record["grad_norm"])

    def saved(self, session: Any, path: Path) -> None:
        """A new checkpoint: on probation; the one trusted before it stays until it is judged."""
        self.pending = path
        self._prune(session, on_probation=True)

    def judge(self, session: Any, loss: float, grad_norm: float, note: Any) -> None:
        """After a finite step: trust the checkpoint it ran on, or mark it unstable when it explodes."""
        why = self.exploding(loss, grad_norm)
        if self.pending is not None:
            if why is None:
                self.pending = None
                self._prune(session, on_probation=False)
            else:
                name = self._unstable(f"the step after it had {why}")
                note(f"warning: checkpoint {name} is unstable: the step after it had {why}; resume: latest skips it")
        if why is None:
            self._remember(loss, grad_norm)

    def failed(self, session: Any, why: str) -> Path | None:
        """The run stops on a NaN/Inf: the checkpoint it ran on is unstable; the newest trusted one."""
        if self.pending is not None:
            self._unstable(why)
        mine = output_dir.lineage(_root(session), session.run_id)
        return mine[-1] if mine else None

    def finish(self, session: Any) -> None:
        """The run ended well: its last checkpoint holds the final model's weights, checked finite."""
        if self.pending is not None:
            self.pending = None
            self._prune(session, on_probation=False)

    def exploding(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is exploding against the run's recent good steps, or None."""
        norms = [n for n in self.grad_norms if n > 0]
        if norms and grad_norm > EXPLODING * (median := statistics.median(norms)):
            return f"grad norm {grad_norm:.3g}, over {EXPLODING:g}x the run's median {median:.3g}"
        if self.losses and abs(loss) > EXPLODING * (median := max(statistics.median(self.losses), LOSS_FLOOR)):
            return f"loss {loss:.3g}, over {EXPLODING:g}x the run's median {median:.3g}"
        return None

    def _remember(self, loss: float, grad_norm: float) -> None:
        self.losses.append(abs(loss))
        self.grad_norms.append(grad_norm)

    def _unstable(self, why: str) -> str:
        path, self.pending = self.pending, None
        if not self.main or path is None or not path.is_dir():
            return path.name if path is not None else ""
        for old in path.parent.glob(f"step-*{UNSTABLE}"):  # one is enough to look at: disks are finite
            shutil.rmtree(old, ignore_errors=True)
        os.rename(path, path.with_name(path.name + UNSTABLE))
        return path.name + UNSTABLE

    def _prune(self, session: Any, *, on_probation: bool) -> None:
        """Keep the newest ``keep_last``; while the newest is on probation, the trusted one just before it
        too. Only ``keep_last: 1`` needs one more for that: with 2 or more it is among them already."""
        if self.main:
            keep = session.config.checkpoint.keep_last
            best = self.best.best_checkpoint(output_dir.lineage(_root(session), session.run_id)) if self.best else None
            output_dir.prune(_root(session), None if keep is None else max(keep, 2) if on_probation else keep,
                             session.run_id, keep=best)


def _root(session: Any) -> Path:
    return Path(session.config.checkpoint.output_dir) / output_dir.CHECKPOINTS


def check_weights(session: Any, before: str) -> None:
    """Refuse to write trainable weights that hold NaN or Inf (collective: every rank calls it)."""
    from posttune.training import distributed

    finite = torch.ones((), dtype=torch.bool, device=session.device)
    for param in session.trainable.parameters():
        if param.requires_grad:  # frozen weights do not change
            local = param.detach().to_local() if distributed.is_dtensor(param) else param.detach()
            finite &= torch.isfinite(local).all().to(finite.device)  # one sync at the end, not one per tensor
    bad = (~finite).float().reshape(1)
    if bool(distributed.all_reduce_max(bad).item()):
        raise NonFiniteError(f"train: step {session.step}: the trained weights hold NaN or Inf (is train.lr too "
                             f"large?); stopped before writing {before}, which would hold them")
