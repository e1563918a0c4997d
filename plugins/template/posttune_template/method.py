"""A toy method: next-token cross-entropy summed over labelled tokens.

It shows the method contract: the core's trainer owns the loop and normalises the loss by the
token count across micro-batches and ranks, so ``loss`` returns a sum and the count.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from posttune.descriptors import LossOutput

IGNORE = -100


@dataclass(frozen=True)
class ToyLMConfig:
    label_smoothing: float = 0.0


def setup(session: Any) -> None:
    """Nothing to prepare: no reference model, no generator."""


def batches(session: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches as the data pipeline prepared them (``input_ids`` and ``labels``)."""
    yield from session.train_data


def loss(session: Any, batch: dict[str, torch.Tensor]) -> LossOutput:
    logits = session.model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    smoothing = session.method_config.label_smoothing
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                            ignore_index=IGNORE, reduction="sum", label_smoothing=smoothing)
    tokens = (labels != IGNORE).sum()
    return LossOutput(total, tokens, {"tokens": float(tokens)})
