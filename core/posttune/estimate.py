"""A rough memory estimate for `posttune plan`: what weights, gradients and optimizer state take.

The model is built on the meta device (no memory, no download of weights: only config.json is
read), adapters injected as the run would, and the parameters counted. Activations depend on
batch, sequence length, checkpointing and kernels and are not estimated; the numbers are per
process, divided across the data-parallel shards when a sharding plan owns ``dp_shard``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATES = 2  # exp_avg and exp_avg_sq, in the parameter's dtype


@dataclass(frozen=True)
class Estimate:
    parameters: int
    trainable: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    shards: int

    def lines(self) -> list[str]:
        def gib(n: int) -> str:
            return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

        per = f" per process ({self.shards} shards)" if self.shards > 1 else ""
        total = self.weights_bytes + self.gradient_bytes + self.optimizer_bytes
        return [
            f"parameters: {self.parameters:,} ({self.trainable:,} trainable)",
            f"memory estimate{per}, excluding activations: weights {gib(self.weights_bytes)}, "
            f"gradients {gib(self.gradient_bytes)}, optimizer {gib(self.optimizer_bytes)}; total {gib(total)}",
        ]


def estimate(plan: Any) -> Estimate:
    from posttune.training.compose import build_model

    session = _MetaSession(plan)
    model = build_model(session)
    if plan.config.adapter is not None:
        from posttune.adapters import apply_adapters

        adapter = plan.config.adapter
        apply_adapters(model, targets=adapter.targets or list(plan.family.descriptor.lora_targets),
                       rank=adapter.rank, alpha=adapter.alpha, dropout=adapter.dropout, kind=adapter.kind)
    unique = {id(p): p for p in model.parameters()}.values()  # tied weights once
    parameters = sum(p.numel() for p in unique)
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    width = BYTES[plan.config.model.dtype]
    shards = plan.mesh.get("dp_shard", 1) if plan.parallel else 1
    return Estimate(parameters, trainable, parameters * width // shards, trainable * width // shards,
                    ADAM_STATES * trainable * width // shards, shards)


class _MetaSession:
    """Just what ``compose.build_model`` reads."""

    def __init__(self, plan: Any):
        self.plan = plan
        self.config = plan.config
