"""A toy method: next-token cross-entropy summed over labelled tokens.

It shows the method contract of plugin API 2: the method builds its own loader from the core's
data toolkit (``data``), and ``loss`` returns a sum with what to divide it by; the core's
trainer owns the loop and divides once by the count summed across micro-batches and ranks.
Labels come pre-shifted from the toolkit: ``labels[:, t]`` is the target of position t.
Only ``posttune.plugin`` is imported from the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from posttune.plugin import DatasetConfig, LossOutput, Session

IGNORE = -100


@dataclass(frozen=True)
class ToyLMConfig:
    label_smoothing: float = 0.0


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    """One chat sample per row, the prompt masked, right-padded per micro-batch."""
    from posttune.plugin import SampleMaker, build_loader, dataset_format, pad_id, padded_batch

    make = SampleMaker(dataset_format(session, split), session.tokenizer,
                       max_seq_len=session.config.data.max_seq_len, column_map=dataset.column_map,
                       skip_bad_rows=session.config.data.skip_bad_rows, where=f"data.{split}",
                       system_prompt=dataset.system_prompt)
    return build_loader(session, dataset, split, make=make,
                        collate=partial(padded_batch, pad_id=pad_id(session.tokenizer)))


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    import torch.nn.functional as F

    logits = session.model(batch["input_ids"])
    labels = batch["labels"]
    smoothing = session.method_config.label_smoothing
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                            ignore_index=IGNORE, reduction="sum", label_smoothing=smoothing)
    labelled = (labels != IGNORE).sum()
    return LossOutput(total, labelled, tokens=batch.get("num_tokens", 0))
