"""Optimizers and learning-rate schedules from the `train:` section.

A name (`adamw`, `adam`, `sgd`) or a `_component_` mapping; schedules `constant`, `linear`,
`cosine`, `wsd` (each with linear warmup) or a `_component_` mapping. Weight decay applies to
matrices only: biases and norm scales are not decayed, as in most LLM recipes.
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from posttune.config.components import instantiate
from posttune.config.schema import DECAY_RATIO, SCHEDULE_NAMES, TrainConfig
from posttune.errors import ConfigError, did_you_mean

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


def param_groups(params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float, *,
                 lora_plus: tuple[float, float] | None = None) -> list[dict[str, Any]]:
    """Trainable parameters split into decayed (2-D and up) and not decayed (1-D) groups.

    ``lora_plus`` ``(lr, ratio)``: LoRA+ (Hayou et al. 2024), the adapters' B matrices and every 1-D
    trainable weight (DoRA's magnitudes) in groups of their own at ``lr x ratio``, as PEFT's
    ``create_loraplus_optimizer`` groups them; the rest keep the optimizer's ``lr``.
    """
    decay, no_decay, fast_decay, fast_no_decay = [], [], [], []
    for name, param in params:
        if not param.requires_grad:
            continue
        fast = lora_plus is not None and ("lora_B" in name.split(".") or param.ndim < 2)
        if param.ndim >= 2:
            (fast_decay if fast else decay).append(param)
        else:
            (fast_no_decay if fast else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if lora_plus is not None:
        lr, ratio = lora_plus
        groups += [{"params": fast_decay, "weight_decay": weight_decay, "lr": lr * ratio},
                   {"params": fast_no_decay, "weight_decay": 0.0, "lr": lr * ratio}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params: Iterable[tuple[str, torch.nn.Parameter]],
                    train: TrainConfig, *, loraplus_lr_ratio: float | None = None) -> torch.optim.Optimizer:
    """The optimizer ``train`` names over the trainable parameters, in decayed and not-decayed groups
    (and LoRA+'s faster groups with ``loraplus_lr_ratio``, see `param_groups`).

    A process's first torch optimizer imports ``torch._dynamo``, whose import runs torch.fx's
    ``wrap``; that keeps its own frame in a reference cycle, and with it every frame above it:
    this one, ``compose``'s and the session it is building, until Python's next full collection.
    One collection right after that import frees the cycle (~0.1 s, once per process), so a
    process that composes several sessions (a notebook, a sweep, a test suite) frees a session
    as soon as it drops it.
    """
    first = "torch._dynamo" not in sys.modules
    optimizer = _optimizer(named_params, train, loraplus_lr_ratio)
    if first and "torch._dynamo" in sys.modules:
        gc.collect()
    return optimizer


def _optimizer(named_params: Iterable[tuple[str, torch.nn.Parameter]], train: TrainConfig,
               loraplus_lr_ratio: float | None) -> torch.optim.Optimizer:
    lora_plus = None if loraplus_lr_ratio is None else (train.lr, loraplus_lr_ratio)
    groups = param_groups(named_params, train.weight_decay, lora_plus=lora_plus)
    if not groups:
        raise ConfigError("train", "the model has no trainable parameters")
    if isinstance(train.optimizer, dict):
        return instantiate(train.optimizer, groups, where="train.optimizer", lr=train.lr)
    factory = OPTIMIZERS.get(train.optimizer)
    if factory is None:
        raise ConfigError("train.optimizer", f"unknown optimizer '{train.optimizer}' (known: "
                                             f"{', '.join(OPTIMIZERS)}, or a _component_ mapping)"
                                             f"{did_you_mean(train.optimizer, OPTIMIZERS)}")
    return factory(groups, lr=train.lr, **kernel_options(factory, groups))


#: devices where torch's fused (single-kernel) Adam/AdamW exists for floating-point parameters
FUSED_DEVICES = ("cpu", "cuda")


def kernel_options(factory: Callable[..., torch.optim.Optimizer], groups: list[dict[str, Any]]) -> dict[str, bool]:
    """The fastest exact update kernel torch has for these parameters.

    Adam/AdamW's fused kernel updates every parameter in one pass per tensor and measures ~5x
    faster than the default per-parameter loop on CPU (benchmarks in docs/performance.md);
    torch only defaults to it on no device. It needs floating-point parameters on one of
    ``FUSED_DEVICES``; otherwise torch's own default (foreach on CUDA) stays.
    """
    if factory not in (torch.optim.AdamW, torch.optim.Adam):
        return {}
    params = [p for group in groups for p in group["params"]]
    if all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params):
        return {"fused": True}
    return {}


def lr_lambda(kind: str, warmup: int, total: int, min_ratio: float = 0.0, decay: int = 0) -> Callable[[int], float]:
    """Multiplier of the base LR at optimizer step ``step`` (0-based).

    ``linear`` and ``cosine`` decay from the end of the warmup to the run's last step, ``wsd`` holds the peak
    and decays (cosine) over its last ``decay`` steps only; each ends at ``min_ratio`` (transformers'
    ``cosine_with_min_lr`` and ``warmup_stable_decay`` compute the same decay).
    """
    start = max(warmup, total - decay) if kind == "wsd" else warmup  # where the decay begins

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant" or step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, total - start))
        shape = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * shape

    return factor


SCHEDULES = SCHEDULE_NAMES  # checked by `validate` before any weight loads; refused here too for direct callers


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig, total_steps: int) -> Any:
    if isinstance(train.scheduler, dict):
        return instantiate(train.scheduler, optimizer, where="train.scheduler")
    if train.scheduler not in SCHEDULES:
        raise ConfigError("train.scheduler", f"unknown schedule '{train.scheduler}' (known: {', '.join(SCHEDULES)}, "
                                             f"or a _component_ mapping){did_you_mean(train.scheduler, SCHEDULES)}")
    decay, warmup = math.ceil((train.decay_ratio or DECAY_RATIO) * total_steps), warmup_steps(train, total_steps)
    if 0 < total_steps <= warmup:
        from posttune.training.distributed import is_main

        if is_main():  # a recipe's warmup_steps kept for a shorter run: the peak rate is never reached
            field = "train.warmup_steps" if train.warmup_ratio is None else "train.warmup_ratio"
            last = lr_lambda("constant", warmup, total_steps)(total_steps - 1) * train.lr
            print(f"posttune: warning: {field}: {warmup} warm-up steps in a run of {total_steps}: the learning rate "
                  f"never reaches train.lr ({train.lr:g}); it ends at {last:.3g}", file=sys.stderr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train.scheduler, warmup, total_steps,
                                                                  train.min_lr_ratio, decay))


def warmup_steps(train: TrainConfig, total_steps: int) -> int:
    """``train.warmup_steps``, or ``train.warmup_ratio`` of the run's optimizer steps rounded up, as transformers'
    Trainer counts it (a recipe's ``warmup_ratio: 0.03`` warms up over the same steps here)."""
    if train.warmup_ratio is None:
        return train.warmup_steps
    return math.ceil(train.warmup_ratio * total_steps)


def resync_lr(optimizer: Any, scheduler: Any) -> None:
    """Set each group's rate to what the run's own schedule gives at the restored step.

    The checkpoint's optimizer holds the rate its run's schedule set last; a resume of a longer run (more
    ``max_steps`` or ``epochs``) has a schedule of another length, whose value at that step differs (a finished
    cosine run's last rate is 0: the first extra step did not train). The same schedule gives the same value."""
    inner = getattr(scheduler, "scheduler", scheduler)
    if not isinstance(inner, torch.optim.lr_scheduler.LambdaLR):  # a _component_ schedule: its own state is its own
        return
    rates = [base * factor(inner.last_epoch) for base, factor in zip(inner.base_lrs, inner.lr_lambdas, strict=True)]
    for group, rate in zip(inner.optimizer.param_groups, rates, strict=True):  # the groups the schedule drives
        if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep a tensor LR
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate
    inner._last_lr = rates
    if callable(getattr(optimizer, "sync_lr", None)):
        optimizer.sync_lr()


def rescale_lr(optimizer: Any, scheduler: Any, ratio: float) -> None:
    """Multiply every learning rate the optimizer and its schedule hold by ``ratio``.

    A resume that changes ``train.lr`` applies it this way: the checkpoint's optimizer and scheduler
    state carry the old base rate, and the schedule continues from the resumed step at the new one.
    Wrapped schedulers (optimizer-in-backward's) expose the core's as ``scheduler``; an optimizer that
    copies its rates elsewhere (the same technique's per-parameter optimizers) offers ``sync_lr``.
    """
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if key in group:
                value = group[key]
                if isinstance(value, torch.Tensor):  # torchao's optimizers keep a tensor LR
                    value.mul_(ratio)
                else:
                    group[key] = value * ratio
    inner = getattr(scheduler, "scheduler", scheduler)
    for attribute in ("base_lrs", "_last_lr"):
        if isinstance(getattr(inner, attribute, None), list):
            setattr(inner, attribute, [value * ratio for value in getattr(inner, attribute)])
    if callable(getattr(optimizer, "sync_lr", None)):
        optimizer.sync_lr()
