"""The reward model as a posttune method: preference pairs in, one forward, Bradley-Terry loss.

- ``data``: preference pairs through the core's toolkit (``pair_loader``: the checkpoint's chat
  template, the prompt's tail kept under ``max_prompt_len``), the chosen rows then the rejected
  ones in one forward pass; by default padding-free (``padding_free``), every response its own
  document of one row, as DPO's pairs, so no padding is computed, and each prompt computed once
  (``share_prompt``).
- ``loss``: the score head's value at each response's last token that is not padding
  (``sequence_scores``, transformers' pooling, so the exported model scores the same), the
  per-pair loss summed, normalised by the trainer over the pairs of the whole step.
"""

from __future__ import annotations

from typing import Any

import torch

from posttune.plugin import DatasetConfig, LossOutput, Session, pad_id, sequence_scores
from posttune_rm.losses import bradley_terry


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune.plugin import pair_batch, pair_loader, splits_sequence

    pad, multiple = pad_id(session.tokenizer), session.config.data.pad_to_multiple_of
    padding_free = session.method_config.padding_free
    # a plan that splits the sequence (context parallelism) keeps each document to itself
    share = padding_free and session.method_config.share_prompt and not splits_sequence(session)

    def collate(rows: list) -> dict[str, Any]:
        return pair_batch(rows, pad_id=pad, pad_to_multiple_of=multiple, padding_free=padding_free,
                          share_prompt=share)

    return pair_loader(session, dataset, split, collate=collate)


def rewards(session: Session, batch: dict[str, Any]) -> torch.Tensor:
    """One reward per response, chosen then rejected: the score head's first value at its last real token.

    ``pair_batch``'s padded rows are the responses; its padding-free row holds them as documents
    ``0 .. 2 x pairs - 1`` (a rounded-up tail, one more document, is left out), pair i as documents
    2i and 2i + 1 when the prompt is shared (``positions``).
    """
    documents = batch.get("document_ids")
    scores = session.model(batch["input_ids"], document_ids=documents,
                           positions=batch.get("positions"))  # [rows, seq, labels]
    pooled = sequence_scores(scores, batch["input_ids"], pad_id(session.tokenizer), document_ids=documents)
    if documents is not None:
        pooled = pooled[0, : 2 * batch["rows"].numel()]
        if "positions" in batch:
            pooled = torch.cat([pooled[0::2], pooled[1::2]])
    return pooled[:, 0].float()


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    config = session.method_config
    chosen, rejected = rewards(session, batch).chunk(2)
    losses = bradley_terry(chosen, rejected, margin=config.margin, center_coefficient=config.center_rewards_coefficient)
    real = (batch["rows"] >= 0).to(losses.dtype)  # a placeholder pair (an empty share) weighs nothing
    pairs = real.sum()

    def mean(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (values.detach() * real).sum(), pairs

    both = torch.cat([chosen, rejected]).detach()
    return LossOutput((losses * real).sum(), pairs, tokens=batch["num_tokens"], unit="pairs", metrics={
        "rewards/chosen": mean(chosen),
        "rewards/rejected": mean(rejected),
        "rewards/accuracy": mean((chosen > rejected).to(losses.dtype)),
        "rewards/margin": mean(chosen - rejected),
        "rewards/mean": mean((chosen + rejected) / 2),
        "rewards/std": (both.std(unbiased=False) * pairs, pairs),  # within each micro-batch, averaged
    })
