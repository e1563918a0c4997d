"""The training loop: one readable function, the same for every method (DESIGN §5).

    for each micro-batch of method.batches(session):
        out = method.loss(session, batch)          # LossOutput(loss_sum, num_tokens, metrics)
        out.loss_sum.backward()                    # gradients of the *sum*
    at the accumulation boundary (or the end of an epoch):
        tokens = all-reduce(sum of num_tokens)     # across micro-batches and ranks
        grads *= world / tokens                    # the mean over every non-ignored token
        clip, optimizer.step(), scheduler.step(), log, evaluate, checkpoint

Summing first and dividing once by the global token count makes batch 4 x accumulation 1 and
batch 1 x accumulation 4 give the same gradients even when sequences differ in length.
``world`` undoes the mean that data-parallel gradient reduction takes over ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttune.session import Session
from posttune.training import distributed, state
from posttune.training.metrics import MetricsLog, peak_memory_mib


@dataclass
class Window:
    """What the micro-batches of one optimizer step add up to."""

    micro: int = 0
    loss_sum: torch.Tensor | float = 0.0
    tokens: torch.Tensor | float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def add(self, out: Any) -> None:
        self.micro += 1
        # full_value: a loss computed under loss parallel is a (replicated) DTensor
        self.loss_sum = self.loss_sum + distributed.full_value(out.loss_sum.detach()).float()
        self.tokens = self.tokens + torch.as_tensor(out.num_tokens, dtype=torch.float32)
        for key, value in out.metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + float(value)


def train(session: Session) -> dict[str, Any]:
    """Run until ``session.state['total_steps']``; returns the summary also printed at the end."""
    method = session.plan.method.descriptor
    config = session.config.train
    total = session.state["total_steps"]
    log = MetricsLog(Path(session.config.checkpoint.output_dir), total_steps=total, initial_step=session.step,
                     enabled=distributed.is_main())
    session.model.train()
    window = Window()
    run_start, run_tokens = time.perf_counter(), 0.0
    while session.step < total:
        for batch in method.batches(session):
            batch = distributed.to_device(batch, session.device)
            # Parallel plans' contexts (loss parallel, context parallel) wrap forward and backward.
            with distributed.step_context(session, batch):
                out = method.loss(session, batch)
                _backward(session, out)
            window.add(out)
            if window.micro == config.grad_accum_steps:
                run_tokens += _optimizer_step(session, window, log)
                window = Window()
                if session.step >= total:
                    break
        else:  # the epoch ran out: a partial accumulation still makes a step
            if window.micro:
                run_tokens += _optimizer_step(session, window, log)
                window = Window()
            session.state["epoch"] += 1
            session.train_data.set_epoch(session.state["epoch"])
    summary = _summary(session, run_tokens, time.perf_counter() - run_start)
    log.close()
    return summary


def _backward(session: Session, out: Any) -> None:
    """Gradients of the summed loss; with an optimizer stepping in backward, their scale first.

    ``optimizer_in_backward`` applies each gradient the moment backward produces it, so there
    is no later point to divide by the token count: it sets ``steps_in_backward`` and, with
    accumulation 1, the global count is known here, after the forward pass. The scale is
    published as ``session.state["grad_scale"]`` and applied to each finished gradient, the
    same multiplication ``_optimizer_step`` does, so both paths round alike.
    """
    if session.state.get("steps_in_backward"):
        group_size = distributed.token_group(session.mesh)[1]
        tokens = torch.as_tensor(out.num_tokens, dtype=torch.float32, device=session.device).clone()
        tokens = distributed.sum_over_token_ranks(tokens, session.mesh)  # not the world: TP ranks share tokens
        session.state["grad_scale"] = group_size / max(float(tokens), 1.0)
    out.loss_sum.backward()


def _optimizer_step(session: Session, window: Window, log: MetricsLog) -> float:
    """Normalise, clip and apply the accumulated gradients; log; evaluate and save when due."""
    config = session.config.train
    params = [p for p in session.model.parameters() if p.requires_grad]
    # Sum over the ranks that see different tokens (data parallel, context parallel), not the
    # world: TP ranks of one group share a batch. FSDP2 averages gradients over that same group,
    # so ``group_size`` undoes its mean.
    group_size = distributed.token_group(session.mesh)[1]
    loss_sum, tokens = distributed.sum_over_token_ranks(torch.stack([
        torch.as_tensor(window.loss_sum, dtype=torch.float32), torch.as_tensor(window.tokens, dtype=torch.float32)
    ]).to(session.device), session.mesh).tolist()
    scale = group_size / max(tokens, 1.0)
    for param in params:
        if param.grad is not None:
            param.grad.mul_(scale)
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else float("inf")
    if hasattr(session.optimizer, "consumed_grad_norm"):  # gradients stepped and freed in backward
        grad_norm = session.optimizer.consumed_grad_norm()
    else:
        grad_norm = distributed.clip_grad_norm(params, max_norm)  # plain and DTensor (FSDP2/TP) gradients
    lr = float(session.optimizer.param_groups[0]["lr"])  # torchao optimizers keep a tensor LR
    session.optimizer.step()
    session.scheduler.step()
    session.optimizer.zero_grad(set_to_none=True)
    session.step += 1
    elapsed = time.perf_counter() - window.started
    record = {
        "step": session.step,
        "epoch": session.state["epoch"],
        "loss": loss_sum / max(tokens, 1.0),
        "lr": lr,
        "grad_norm": float(distributed.full_value(grad_norm)),
        "tokens": int(tokens),
        "tokens_per_s": tokens / max(elapsed, 1e-9),
        "peak_memory_mib": peak_memory_mib(session.device),
        **{k: v / window.micro for k, v in window.metrics.items()},
    }
    if config.eval_every and session.step % config.eval_every == 0 and session.validation_data is not None:
        record["val_loss"] = evaluate(session)
    log.write(record)
    every = session.config.checkpoint.save_every
    if every and session.step % every == 0 and session.step < session.state["total_steps"]:
        path = state.save_checkpoint(session)
        log.note(f"saved checkpoint {path}")
    return tokens


@torch.no_grad()
def evaluate(session: Session) -> float:
    """Mean loss per token over the whole validation set, across ranks."""
    method = session.plan.method.descriptor
    session.model.eval()
    totals = torch.zeros(2, dtype=torch.float32, device=session.device)
    for batch in session.validation_data:
        batch = distributed.to_device(batch, session.device)
        with distributed.step_context(session, batch):
            out = method.loss(session, batch)
        totals += torch.stack([distributed.full_value(out.loss_sum.detach()).float(),
                               torch.as_tensor(out.num_tokens, dtype=torch.float32, device=session.device)])
    session.model.train()
    loss_sum, tokens = distributed.sum_over_token_ranks(totals, session.mesh).tolist()
    return loss_sum / max(tokens, 1.0)


def _summary(session: Session, tokens: float, seconds: float) -> dict[str, Any]:
    summary = {
        "steps": session.step,
        "tokens": int(tokens),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        "peak_memory_mib": round(peak_memory_mib(session.device), 1),
    }
    if session.validation_data is not None:
        summary["val_loss"] = evaluate(session)
    return summary
