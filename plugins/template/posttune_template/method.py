"""A toy method: next-token cross-entropy summed over labelled tokens.

It shows the method contract: the core's trainer owns the loop and normalises the loss by the
token count across micro-batches and ranks, so ``loss`` returns a sum and the count. Labels
come pre-shifted from the core's data pipeline: ``labels[:, t]`` is the target of position t.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from posttune.descriptors import LossOutput

IGNORE = -100


@dataclass(frozen=True)
class ToyLMConfig:
    label_smoothing: float = 0.0


def setup(session: Any) -> None:
    """Nothing to prepare: no reference model, no generator."""


def batches(session: Any) -> Iterator[dict[str, Any]]:
    """Micro-batches as the data pipeline prepared them (``input_ids`` and ``labels``)."""
    yield from session.train_data


def loss(session: Any, batch: dict[str, Any]) -> LossOutput:
    import torch.nn.functional as F

    logits = session.model(batch["input_ids"])
    labels = batch["labels"]
    smoothing = session.method_config.label_smoothing
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                            ignore_index=IGNORE, reduction="sum", label_smoothing=smoothing)
    tokens = (labels != IGNORE).sum()
    return LossOutput(total, tokens, {"tokens": float(tokens)})
