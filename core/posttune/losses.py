"""Token-level losses shared by methods. Memory techniques may replace how logits are formed.

Every function returns a *sum* and the number of tokens it covers: the trainer divides once
by the global count (see ``posttune.training.trainer``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_cross_entropy(session: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over labelled positions, and their count.

    ``batch["labels"]`` is pre-shifted (the target of each position). A memory technique can
    install ``session.state["token_loss"]`` (e.g. chunked linear cross-entropy that never
    materialises full logits); it receives the same arguments and returns the same pair.
    """
    custom = session.state.get("token_loss") if hasattr(session, "state") else None
    if custom is not None:
        return custom(session, batch)
    logits = session.model(batch["input_ids"], document_ids=batch.get("document_ids"))
    labels = batch["labels"]
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum, (labels != IGNORE_INDEX).sum()
