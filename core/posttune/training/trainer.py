"""The training loop: one readable function, the same for every method (docs/architecture.md).

    for each micro-batch of method.batches(session):
        out = method.loss(session, batch)     # LossOutput(loss_sum, normaliser, tokens, metrics)
        out += the model's auxiliary loss     # an MoE's load balancing, times this batch's normaliser
        out.loss_sum.backward()               # gradients of the *sum*
    at the accumulation boundary (or the end of an epoch):
        n = all-reduce(sum of normalisers)    # across micro-batches and ranks: tokens, pairs, ...
        grads *= ranks / n                    # the mean over every unit of the whole step
        clip; a NaN/Inf loss or grad norm stops the run (or is skipped: nonfinite.py)
        optimizer.step(), scheduler.step(), method.on_step_end, evaluate, log, checkpoint
    after each step: SIGTERM on any rank -> checkpoint at this step, stop (preemption.py)

Summing first and dividing once by the global normaliser makes batch 4 x accumulation 1 and
batch 1 x accumulation 4 give the same gradients even when sequences differ in length.
``ranks`` undoes the mean that data-parallel gradient reduction takes over ranks. Plugins
extend the loop only through the session's typed fields (``step_contexts``,
``before_backward``, ``clip_gradients``); the loop has no branch for any method or technique.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttune.descriptors import LossOutput
from posttune.errors import ConfigError, PluginError
from posttune.session import Session
from posttune.training import distributed, nonfinite, output_dir, preemption, state
from posttune.training.best import Best
from posttune.training.metrics import MetricsLog, peak_memory_mib, read_metrics


@dataclass
class Window:
    """What the micro-batches of one optimizer step (or one evaluation) add up to.

    Every metric is kept as (total, count): a method's plain number counts once per
    micro-batch, a ``(total, count)`` pair as given. One all-reduce then gives the global means.
    """

    micro: int = 0
    loss_sum: torch.Tensor | float = 0.0
    normaliser: torch.Tensor | float = 0.0
    tokens: torch.Tensor | float = 0.0
    unit: str = "labelled_tokens"
    metrics: dict[str, list[float]] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def add(self, out: Any) -> None:
        self.micro += 1
        # full_value: a loss computed under loss parallel is a (replicated) DTensor
        self.loss_sum = self.loss_sum + distributed.full_value(out.loss_sum.detach()).float()
        self.normaliser = self.normaliser + torch.as_tensor(out.normaliser, dtype=torch.float32)
        self.tokens = self.tokens + torch.as_tensor(out.tokens, dtype=torch.float32)
        self.unit = out.unit
        for key, value in out.metrics.items():  # kept as tensors: no host sync per micro-batch
            total, count = value if isinstance(value, tuple) else (value, 1.0)
            sums = self.metrics.setdefault(key, [0.0, 0.0])
            sums[0] = sums[0] + _detached(total)
            sums[1] = sums[1] + _detached(count)

    def reduce(self, session: Session, *extra: torch.Tensor) -> dict[str, Any]:
        """Sum over the ranks that hold different data: loss per unit, units, tokens, metric means.

        The step's one host sync: ``extra`` scalars (already global, e.g. the gradient norm) ride
        along to the host in the same transfer, returned as ``extra`` in order.
        """
        keys = sorted(self.metrics)
        values = [self.loss_sum, self.normaliser, self.tokens] + [v for k in keys for v in self.metrics[k]]
        flat = torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()).to(session.device) for v in values])
        flat = distributed.sum_over_token_ranks(flat, session)
        if extra:
            flat = torch.cat([flat, torch.stack([e.float().reshape(()).to(flat.device) for e in extra])])
        host = flat.tolist()
        loss_sum, normaliser, tokens = host[:3]
        # a metric over no example (a side of a pair loss the step held none of) is left out, as TRL does
        means = {k: host[3 + 2 * i] / host[4 + 2 * i] for i, k in enumerate(keys) if host[4 + 2 * i] > 0}
        return {"loss": loss_sum / max(normaliser, 1.0), "normaliser": normaliser, "tokens": tokens, **means,
                "extra": host[len(values):]}


def _detached(value: Any) -> torch.Tensor | float:
    return distributed.full_value(value.detach()).float() if isinstance(value, torch.Tensor) else float(value)


def train(session: Session) -> dict[str, Any]:
    """Run until ``session.total_steps``; returns the summary also printed at the end."""
    config = session.config.train
    log = MetricsLog(Path(session.config.checkpoint.output_dir), total_steps=session.total_steps,
                     initial_step=session.step, enabled=distributed.is_main(), log_every=config.log_every,
                     pending=session.log_window)
    first_step = session.step
    session.trainable.train()
    window = Window()
    run_start, run_tokens = time.perf_counter(), 0.0
    best, probation = _judges(session, log.path.parent)
    with preemption.watching(), contextlib.closing(log):
        while session.step < session.total_steps and not _stopped_early(session, log, probation):
            for batch in batches(session):
                batch = distributed.to_device(batch, session.device)
                # Plans' contexts (loss parallel, context parallel, sequence padding) wrap forward and backward.
                with distributed.step_context(session, batch), counting_real_tokens(session, batch):
                    # drop what forwards outside the loss recorded (a layer recomputed in backward)
                    pop_aux_loss(session, summed=False)
                    out = with_aux_loss(session, loss_of(session, batch))
                    for hook in session.before_backward:
                        hook(session, out)
                    out.loss_sum.backward()
                window.add(out)
                if window.micro == config.grad_accum_steps:
                    run_tokens += _optimizer_step(session, window, log, probation)
                    _stop_if_asked(session, log, probation)
                    window = Window()
                    if session.step >= session.total_steps or best.stop_reason() is not None:
                        break
            else:  # the epoch ran out: a partial accumulation still makes a step
                if window.micro and best.stop_reason() is None:
                    run_tokens += _optimizer_step(session, window, log, probation)
                    _stop_if_asked(session, log, probation)
                    window = Window()
                session.epoch += 1
                if hasattr(session.train_data, "set_epoch"):
                    session.train_data.set_epoch(session.epoch)
        probation.finish(session)
        summary = _summary(session, log, steps_run=session.step - first_step, tokens=run_tokens,
                           seconds=time.perf_counter() - run_start)
        return {**summary, **_best_summary(session, best)}


def _judges(session: Session, output_dir: Path) -> tuple[Best, nonfinite.Probation]:
    """The best-checkpoint judge and the checkpoint probation, with a resumed run's history from metrics.jsonl.

    The records are read here and dropped on return: a long run's history (a record a step, ~1 KiB each in
    Python) would otherwise stay resident for the whole resumed run (300,000 records: +300 MiB)."""
    records = read_metrics(output_dir) if session.resume_from else ()
    best = Best.of(session.config, records)
    return best, nonfinite.Probation(session, records, best)


def pop_aux_loss(session: Session, *, summed: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """The policy's auxiliary loss since the last call (``Decoder.aux_loss``), its statistics summed
    over the ranks that hold different tokens (``summed``; records only being dropped need no
    collective); None for a model without one (a dense decoder)."""
    aux_loss = getattr(session.model, "aux_loss", None)
    if not callable(aux_loss):
        return None
    group, size = distributed.token_group(session) if summed else (None, 1)
    return aux_loss(distributed.summing(group) if size > 1 else None)


def counting_real_tokens(session: Session, batch: Any) -> contextlib.AbstractContextManager:
    """The policy's routing statistics leave out the micro-batch's padding (``Decoder.counting``), after the
    plans' contexts padded or split it; a model or batch without them: nothing to do."""
    counting = getattr(session.model, "counting", None)
    if not callable(counting) or not isinstance(batch, dict) or "real_tokens" not in batch:
        return contextlib.nullcontext()
    return counting(batch["input_ids"], batch["real_tokens"])


def loss_of(session: Session, batch: Any) -> LossOutput:
    """The method's ``loss`` on ``batch``; anything but a ``LossOutput`` is the plugin's error, named in one line
    (it would otherwise fail inside the trainer, naming nothing)."""
    method = session.plan.method
    out = method.descriptor.loss(session, batch)
    if not isinstance(out, LossOutput):
        raise PluginError(f"method '{method.descriptor.name}' ({method.provenance}): loss returned "
                          f"{type(out).__name__}, not a LossOutput(loss_sum, normaliser, ...)")
    for key, value in out.metrics.items():
        parts = value if isinstance(value, tuple) and len(value) == 2 else (value,)
        if not all(isinstance(part, (int, float, torch.Tensor)) for part in parts):
            raise PluginError(f"method '{method.descriptor.name}' ({method.provenance}): loss's metric '{key}' is "
                              f"{value!r:.80}, not a number, a scalar tensor or a (total, count) pair of them")
    return out


def with_aux_loss(session: Session, out: Any) -> Any:
    """``out`` with the policy's auxiliary loss added, times the micro-batch's normaliser, and its parts
    in the metrics: after the step's one division by the global normaliser, the loss gains the
    auxiliary loss of the step's batch, as transformers adds it to a mean loss."""
    aux = pop_aux_loss(session)
    if aux is None:
        return out
    loss, metrics = aux
    if distributed.is_dtensor(out.loss_sum):  # loss parallel: a replicated DTensor (every rank's aux is the same)
        from torch.distributed.tensor import DTensor, Replicate

        mesh = out.loss_sum.device_mesh
        loss = DTensor.from_local(loss, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return dataclasses.replace(out, loss_sum=out.loss_sum + loss * out.normaliser, metrics={**out.metrics, **metrics})


def _stop_if_asked(session: Session, log: MetricsLog, probation: nonfinite.Probation) -> None:
    """After a step: on SIGTERM (any rank), make sure a checkpoint of this step exists, then stop."""
    if not preemption.requested(session.device):
        return
    path = state.checkpoint_root(session) / f"step-{session.step:08d}"
    if not _checkpoint_due(session):  # else the step just wrote it
        _save(session, log, probation)
    raise preemption.Preempted(session.step, path)


def _stopped_early(session: Session, log: MetricsLog, probation: nonfinite.Probation) -> bool:
    """Whether ``train.early_stopping_patience`` ends the run here; it then ends as a finished run does,
    with a checkpoint of this step when the run saves any."""
    reason = probation.best.stop_reason() if probation.best is not None else None
    if reason is None:
        return False
    log.note(f"stopping early at step {session.step}: {reason}")
    saved = (state.checkpoint_root(session) / f"step-{session.step:08d}").is_dir()  # due, or resumed from
    if session.config.checkpoint.save_every and not saved:
        _save(session, log, probation)
    return True


def _best_summary(session: Session, best: Best) -> dict[str, Any]:
    """The best checkpoint of ``checkpoint.best_metric`` (and why the run stopped early), for the summary."""
    if best.metric is None:
        return {}
    out: dict[str, Any] = {}
    step = best.best_step()
    if step is not None:
        out[f"best_{best.metric}"], out["best_step"] = best.scores[step], step
    root = state.checkpoint_root(session)
    path = best.best_checkpoint(output_dir.lineage(root, session.run_id))
    if path is not None:
        out["best_checkpoint"] = str(path)
    if (reason := best.stop_reason()) is not None:
        out["stopped_early"] = reason
    return out


def _checkpoint_due(session: Session) -> bool:
    """Every ``save_every`` steps, and the final step too: a finished run stays resumable, so raising
    ``train.max_steps`` with ``resume: latest`` extends it (docs/training.md, "Extending a finished run")."""
    every = session.save_every
    return bool(every) and (session.step % every == 0 or session.step >= session.total_steps)


def batches(session: Session) -> Iterable[Any]:
    """One epoch of micro-batches: the method's own ``batches``, or its train loader's."""
    method = session.plan.method.descriptor
    return method.batches(session) if method.batches is not None else session.train_data


def _optimizer_step(session: Session, window: Window, log: MetricsLog, probation: nonfinite.Probation) -> float:
    """Normalise, clip and apply the accumulated gradients; log; evaluate and save when due.

    ``probation`` judges the newest checkpoint by this step, which runs on its weights (nonfinite.py).
    """
    config = session.config.train
    params = [p for p in session.trainable.parameters() if p.requires_grad]
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else float("inf")
    # Data-parallel plans average gradients over the ranks with different tokens; ``group_size`` undoes that mean.
    group_size = distributed.token_group(session)[1]
    if session.clip_gradients is None:
        # The norm of the gradients as accumulated (a global tensor) goes to the host with the
        # metrics in one sync; the normalising scale and the clip then make one multiply.
        raw_norm = distributed.grad_norm(params)
        reduced = window.reduce(session, raw_norm)
        scale = group_size / max(reduced["normaliser"], 1.0)
        grad_norm = reduced.pop("extra")[0] * scale
        clip = min(1.0, max_norm / (grad_norm + 1e-6)) if math.isfinite(grad_norm) else 1.0
        distributed.scale_gradients(params, scale * clip)
    else:  # a technique owns the gradients (optimizer in backward: already applied and freed)
        reduced = window.reduce(session)
        reduced.pop("extra")
        distributed.scale_gradients(params, group_size / max(reduced["normaliser"], 1.0))
        grad_norm = float(distributed.full_value(session.clip_gradients(session, params, max_norm)))
    lr = float(session.optimizer.param_groups[0]["lr"])  # torchao optimizers keep a tensor LR
    # Global values (loss reduced over ranks, the global norm): every rank decides the same.
    bad = nonfinite.step_problem(reduced["loss"], grad_norm)
    if bad is not None:
        nonfinite.skip_or_stop(session, session.step + 1, bad, reduced["loss"] if bad == "loss" else grad_norm,
                               probation)
    else:
        probation.judge(session, reduced["loss"], grad_norm, log.note)
        session.optimizer.step()
    session.scheduler.step()  # also when skipped: the schedule stays in step with the step count
    session.optimizer.zero_grad(set_to_none=True)
    session.step += 1
    if bad is not None:  # the step still counts: the method's step end (a reference synced every k steps, weights
        # pushed to rollout actors every k steps), and an evaluation or checkpoint due at it happen (best_metric
        # scores every checkpoint; patience counts every evaluation)
        log.note(f"step {session.step}: skipped (the {bad} is not finite)")
        _end_step(session, log, probation, {"step": session.step, "epoch": session.epoch, "lr": lr,
                                            "skipped_nonfinite": bad})
        return 0.0
    elapsed = time.perf_counter() - window.started
    normaliser, tokens = reduced.pop("normaliser"), reduced.pop("tokens")
    record = {
        "step": session.step,
        "epoch": session.epoch,
        "loss": reduced.pop("loss"),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": int(tokens),
        window.unit: int(normaliser),  # right after tokens: the loss plot reads its unit there
        "tokens_per_s": tokens / max(elapsed, 1e-9),
        "peak_memory_mib": peak_memory_mib(session.device),
        **reduced,
    }
    _end_step(session, log, probation, record)
    return tokens


def _end_step(session: Session, log: MetricsLog, probation: nonfinite.Probation, record: dict[str, Any]) -> None:
    """After every step, a skipped one too: the method's ``on_step_end`` (it may add to ``record``), the step's
    evaluation when one is due (its results join ``record``), the record written, the checkpoint when one is due."""
    method = session.plan.method.descriptor
    if method.on_step_end is not None:
        method.on_step_end(session, record)
    if session.eval_every and session.step % session.eval_every == 0 and session.validation_data is not None:
        with log.evaluating():
            results = _prefixed(evaluate(session))
        log.evaluated(session.step, results)
        record.update(results)
        if probation.best is not None:
            try:
                probation.best.evaluated(session.step, results)
            except ConfigError as exc:  # a metric the evaluation does not log: keep the steps run so far
                log.write(record)
                path = _save(session, log, probation)
                raise ConfigError(exc.path, f"{exc.problem}; step {session.step} is saved in {path}: fix it and "
                                            "resume (checkpoint.resume=latest)") from None
    log.write(record)
    if _checkpoint_due(session):
        _save(session, log, probation)


def _save(session: Session, log: MetricsLog, probation: nonfinite.Probation) -> Path:
    path = state.save_checkpoint(session)
    probation.saved(session, path)
    log.note(f"saved checkpoint {path}")
    return path


def evaluate(session: Session) -> dict[str, float]:
    """The method's evaluation, or the default: its loss and metrics over the validation loader."""
    method = session.plan.method.descriptor
    was_training = session.trainable.training
    session.trainable.eval()
    try:
        return dict(method.evaluate(session)) if method.evaluate is not None else validation_loss(session)
    finally:
        session.trainable.train(was_training)


@torch.no_grad()
def validation_loss(session: Session) -> dict[str, float]:
    """Loss per unit (and the method's metrics) over the whole validation set, across ranks."""
    window = Window()
    for batch in session.validation_data:
        batch = distributed.to_device(batch, session.device)
        with distributed.step_context(session, batch):
            window.add(_validation_loss_of(session, batch))
    reduced = window.reduce(session)
    reduced.pop("normaliser"), reduced.pop("tokens"), reduced.pop("extra")
    return reduced


def _validation_loss_of(session: Session, batch: Any) -> LossOutput:
    """``loss_of`` on a batch of the validation loader as it comes. A method whose ``batches`` makes its training
    micro-batches out of what its loader gives (rollouts from prompts) has a loss that cannot read those: without an
    ``evaluate`` of its own, what that loss raises is named in one line with the remedy, not as a traceback."""
    method = session.plan.method
    try:
        return loss_of(session, batch)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        if method.descriptor.batches is None:
            raise
        from posttune.errors import first_line

        raise PluginError(f"method '{method.descriptor.name}' ({method.provenance}): the default evaluation ran its "
                          f"loss on a batch of the validation loader, which raised {type(exc).__name__}: "
                          f"{first_line(str(exc)) or '(no message)'}; a method whose batches callback makes its "
                          "micro-batches from what its loader gives needs an evaluate callback of its own (GRPO's "
                          "answers the validation prompts and scores them)") from exc


def _prefixed(results: Mapping[str, float]) -> dict[str, float]:
    return {f"val_{key}": float(value) for key, value in results.items()}


def _summary(session: Session, log: MetricsLog, *, steps_run: int, tokens: float, seconds: float) -> dict[str, Any]:
    """What this invocation did (``steps_run``, tokens, time: a resumed run counts only its own)
    and where the run stands (``final_step``); the validation results at the final step, reused
    when that step already evaluated."""
    summary = {
        "steps_run": steps_run,
        "final_step": session.step,
        **({"train_loss": log.last_loss} if log.last_loss is not None else {}),  # the last logged step's
        "tokens": int(tokens),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        "peak_memory_mib": round(peak_memory_mib(session.device), 1),
    }
    if session.skipped_nonfinite or session.config.train.skip_nonfinite:
        summary["skipped_nonfinite"] = session.skipped_nonfinite
    if session.validation_data is not None:
        if log.last_eval is not None and log.last_eval[0] == session.step:
            results = log.last_eval[1]
        else:
            with log.evaluating():
                results = _prefixed(evaluate(session))
        summary.update(results)
    return summary
