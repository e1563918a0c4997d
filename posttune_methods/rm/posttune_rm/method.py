"""The reward model as a posttune method: preference pairs in, one forward, Bradley-Terry loss.

- ``data``: preference pairs through the core's toolkit (``pair_loader``: the checkpoint's chat
  template, the prompt's tail kept under ``max_prompt_len``), the chosen rows then the rejected
  ones in one forward pass; by default padding-free (``padding_free``), every response its own
  document of one row, as DPO's pairs, so no padding is computed, and each prompt computed once
  (``share_prompt``).
- ``loss``: the score head's value at each response's last token that is not padding
  (``sequence_scores``, transformers' pooling, so the exported model scores the same), the
  per-pair loss summed, normalised by the trainer over the pairs of the whole step.
- ``margin_column``: each pair's margin read from its row (``MarginPairMaker``) and batched as
  ``margins``, one per pair in the batch's order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from posttune.plugin import IGNORE_INDEX, DatasetConfig, LossOutput, PairMaker, Session, pad_id, sequence_scores
from posttune_rm.losses import bradley_terry


class MarginPairMaker(PairMaker):
    """Preference rows -> ``[chosen, rejected, ([margin bits], [IGNORE_INDEX])]`` (a sample group).

    The data toolkit keeps token ids per sample and nothing else, so the row's margin travels as a
    marker sample: one id holding the margin's float32 bits, never fed to a model (``margins``
    reads it back). A missing or bad margin is a bad row like any other (``skip_bad_rows``).
    """

    def __init__(self, *args: Any, column: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.column = column
        self.row: Mapping[str, Any] = {}

    def __call__(self, row: Mapping[str, Any], index: int) -> Any:
        self.row = row  # the dataset's own columns: `make` sees the format's pair alone
        return super().__call__(row, index)

    def make(self, pair: Any) -> list[tuple[list[int], list[int]]] | None:
        margin = self.row[self.column]  # a KeyError is the toolkit's "missing field" row error
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
            raise ValueError(f"field '{self.column}' must be a number >= 0 (the pair's margin), got {margin!r}")
        samples = super().make(pair)
        if samples is None:
            return None
        bits = int(torch.tensor([float(margin)], dtype=torch.float32).view(torch.int32))
        return [*samples, ([bits], [IGNORE_INDEX])]


def margins(rows: list) -> torch.Tensor:
    """The margin of each pair of a micro-batch (``MarginPairMaker``'s groups), ``[pairs]`` (a placeholder for
    an empty share, as ``pair_batch`` pads one, gets 0)."""
    bits = [int(group[2].ids[0]) for group in rows] or [0]
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune.plugin import pair_batch, pair_loader, splits_sequence

    method = session.method_config
    pad, multiple = pad_id(session.tokenizer), session.config.data.pad_to_multiple_of
    padding_free = method.padding_free
    # a plan that splits the sequence (context parallelism) keeps each document to itself
    share = padding_free and method.share_prompt and not splits_sequence(session)

    def collate(rows: list) -> dict[str, Any]:
        batch = pair_batch([group[:2] for group in rows], pad_id=pad, pad_to_multiple_of=multiple,
                           padding_free=padding_free, share_prompt=share)
        if method.margin_column is not None:
            batch["margins"] = margins(rows)
        return batch

    maker = None if method.margin_column is None else partial(MarginPairMaker, column=method.margin_column)
    return pair_loader(session, dataset, split, collate=collate, maker=maker)


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
    margin = batch["margins"].to(chosen.device) if "margins" in batch else config.margin
    losses = bradley_terry(chosen, rejected, margin=margin, center_coefficient=config.center_rewards_coefficient)
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
