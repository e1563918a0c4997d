"""A memory technique with its own term in `posttune plan`'s memory estimate, as a third party writes one.

    memory: [frozen_embedding]

``frozen_embedding`` stops training the policy's input embedding (``model.embed``: the native
decoder contract of ``posttune.modules``): no gradient and no optimizer state for it. Its
``estimate`` term takes both out of the policy's parts, and freezes the embedding of the
meta-built model the estimate counts, so that terms applied after it (the optimizer stage's)
see it frozen as the run's optimizer does. Nothing here is known to the core.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from posttune.plugin import Estimate, MemoryTechnique, Session

NAME = "frozen_embedding"


def apply(session: Session, target: Any) -> None:
    """At the ``adapt`` stage, before the optimizer is built from what still requires a gradient."""
    target.model.embed.weight.requires_grad_(False)


def estimate(est: Estimate, plan: Any) -> Estimate:
    """The policy without the embedding's gradient and optimizer state (already frozen under adapters: no change)."""
    policy = est.models[0]
    weight = policy.module.embed.weight
    if not policy.trainable or not weight.requires_grad:
        return est
    weight.requires_grad_(False)
    values = weight.numel()
    policy = replace(policy, trainable=policy.trainable - values,
                     gradient_bytes=policy.gradient_bytes - values * policy.width,
                     optimizer_bytes=policy.optimizer_bytes - policy.optimizer_bytes * values // policy.trainable)
    return replace(est, models=(policy, *est.models[1:]))


TECHNIQUE = MemoryTechnique(
    name=NAME, stage="adapt", apply=apply, estimate=estimate,
    saves="the input embedding's gradient and optimizer state",
    description="train everything but the input embedding (a third-party example with its own estimate term)",
)


def register_memory_techniques(register: Any) -> None:
    register(TECHNIQUE)
