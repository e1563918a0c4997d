"""adamw_8bit / adamw_4bit: torchao's block-quantised AdamW in place of the core's AdamW.

AdamW keeps two fp32 moments per parameter (8 bytes); these keep them in 8 bits (plus one
fp32 scale per 256 values) or 4 bits (per 128). torchao leaves tensors under 4096 elements
(norm scales, biases) in fp32, where quantising would save little and cost accuracy. The
param groups, learning rate and weight decay are the core's; the LR schedule is rebuilt
around the new optimizer. Checkpoints save the quantised states as they are (torchao
registers them for ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import torch

from posttune.plugin import Session, build_scheduler


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    from torchao.optim import AdamW4bit, AdamW8bit

    return {"adamw_8bit": AdamW8bit, "adamw_4bit": AdamW4bit}[name]


def apply(session: Session, name: str) -> None:
    train = session.config.train
    # each group's own base lr (LoRA+'s faster groups), not the one the scheduler has already scaled
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"], "lr": g.get("initial_lr", g["lr"])}
              for g in session.optimizer.param_groups]
    session.optimizer = optimizer_class(name)(groups, lr=train.lr)
    session.scheduler = build_scheduler(session.optimizer, train, session.total_steps)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state holds, counting the parts of quantised tensor subclasses."""
    return sum(tensor_bytes(value) for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Storage of a tensor, or of the inner tensors of a subclass (NF4, 8-bit optimizer state)."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return tensor.numel() * tensor.element_size()
    names, _ = tensor.__tensor_flatten__()
    return sum(tensor_bytes(getattr(tensor, name)) for name in names)
