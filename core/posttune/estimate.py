"""A rough memory estimate for `posttune plan`: what weights, gradients and optimizer state take.

Every model of the run (the policy, and each frozen role the method asks for: a reference, a
teacher) is built on the meta device (no memory, no download of weights: only config.json is
read), adapters injected into the policy as the run would, and the parameters counted. Activations depend on
batch, sequence length, checkpointing and kernels and are not estimated; the numbers are per
process, divided across the data-parallel shards when a sharding plan owns ``dp_shard``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATES = 2  # exp_avg and exp_avg_sq, in the parameter's dtype


@dataclass(frozen=True)
class ModelEstimate:
    """One model of the run: the policy (trainable) or a frozen role."""

    role: str
    parameters: int
    trainable: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.weights_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Estimate:
    models: list[ModelEstimate]
    shards: int
    shared: list[str] = field(default_factory=list)  # roles that are the policy without adapters

    @property
    def parameters(self) -> int:
        return self.models[0].parameters

    @property
    def trainable(self) -> int:
        return self.models[0].trainable

    def lines(self) -> list[str]:
        per = f" per process ({self.shards} shards)" if self.shards > 1 else ""
        policy = self.models[0]
        lines = [f"parameters: {policy.parameters:,} ({policy.trainable:,} trainable)",
                 f"memory estimate{per}, excluding activations:"]
        for model in self.models:
            if model.trainable:
                lines.append(f"  {model.role}: weights {gib(model.weights_bytes)}, gradients "
                             f"{gib(model.gradient_bytes)}, optimizer {gib(model.optimizer_bytes)}")
            else:
                lines.append(f"  {model.role} (frozen, {model.parameters:,} parameters): weights "
                             f"{gib(model.weights_bytes)}")
        for role in self.shared:
            lines.append(f"  {role}: the policy with adapters disabled, no extra memory")
        lines.append(f"  total {gib(sum(m.total for m in self.models))}")
        return lines


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def estimate(plan: Any) -> Estimate:
    """Count every model the run holds, built on the meta device as the run would build it."""
    from posttune.session import ModelTarget
    from posttune.training.compose import build_model

    shards = plan.mesh.get("dp_shard", 1) if plan.parallel else 1
    policy = build_model(ModelTarget("policy", plan.family.descriptor, plan.config.model))
    if plan.config.adapter is not None:
        from posttune.adapters import apply_adapters

        adapter = plan.config.adapter
        apply_adapters(policy, targets=adapter.targets or list(plan.family.descriptor.lora_targets),
                       rank=adapter.rank, alpha=adapter.alpha, dropout=adapter.dropout, kind=adapter.kind)
    models = [_count("policy", policy, plan.config.model.dtype, shards, trainable=True)]
    shared = []
    for name, role in plan.roles.items():
        if role.shares_policy:
            shared.append(name)
            continue
        model = build_model(ModelTarget(name, role.family.descriptor, role.config))
        models.append(_count(name, model, role.config.dtype, shards, trainable=False))
    return Estimate(models, shards, shared)


def _count(role: str, model: Any, dtype: str, shards: int, *, trainable: bool) -> ModelEstimate:
    unique = {id(p): p for p in model.parameters()}.values()  # tied weights once
    parameters = sum(p.numel() for p in unique)
    learned = sum(p.numel() for p in unique if p.requires_grad) if trainable else 0
    width = BYTES[dtype]
    return ModelEstimate(role, parameters, learned, parameters * width // shards, learned * width // shards,
                         ADAM_STATES * learned * width // shards)
