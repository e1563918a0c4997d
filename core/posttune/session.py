"""The session: everything one training run holds, filled in composition order (DESIGN §4).

Plugins receive it in ``apply``, ``setup``, ``batches`` and ``loss``. Fields start empty and
are set by the stage that owns them; a plugin reads what earlier stages produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from posttune.config.schema import RunConfig
    from posttune.plan import Plan


@dataclass(eq=False)
class Session:
    config: RunConfig
    plan: Plan
    method_config: Any = None  # the method's validated settings (``Method.config`` instance)
    device: torch.device | None = None
    mesh: Any = None  # torch.distributed DeviceMesh, or None on one process
    tokenizer: Any = None
    model: torch.nn.Module | None = None
    optimizer: Any = None
    scheduler: Any = None
    train_data: Any = None  # iterable of batches prepared for the method
    validation_data: Any = None
    step: int = 0
    state: dict[str, Any] = field(default_factory=dict)  # per-method and per-plugin state
