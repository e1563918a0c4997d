"""Micro-batches from samples: right padding, or packed rows with document ids.

Batch dict keys:
- ``input_ids`` LongTensor [b, s]: token ids, right-padded with the tokenizer's pad id.
- ``labels`` LongTensor [b, s]: pre-shifted targets (`samples.py`), IGNORE_INDEX on padding.
- ``document_ids`` LongTensor [b, s] (packing only): 0, 1, ... for the samples of a row in order,
  and one more id for the row's tail padding. Ids are non-negative and non-decreasing along a
  row, so they serve both `modules.attention.attention_mask` (a query sees only its own id) and
  varlen kernels that derive boundaries from id changes. The model restarts positions per id.

A rank whose share of the last global batch is empty gets a placeholder batch of one padding
row with no targets: every rank then runs the same number of steps, and the trainer's token-count
normalisation gives that rank zero weight.
"""

from __future__ import annotations

import torch

from posttune.data.samples import IGNORE_INDEX, Sample


def padded_batch(rows: list[list[Sample]], *, pad_id: int) -> dict[str, torch.Tensor]:
    """One sample per row, right-padded to the longest (a single padding token for an empty share)."""
    samples = [sample for row in rows for sample in row]
    length = max((len(s) for s in samples), default=1)
    input_ids = torch.full((max(len(samples), 1), length), pad_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for index, sample in enumerate(samples):
        input_ids[index, : len(sample)] = sample.ids
        labels[index, : len(sample)] = sample.labels
    return {"input_ids": input_ids, "labels": labels}


def packed_batch(rows: list[list[Sample]], *, pad_id: int, max_seq_len: int) -> dict[str, torch.Tensor]:
    """Each row's samples side by side in exactly ``max_seq_len`` tokens, with ``document_ids``."""
    input_ids = torch.full((max(len(rows), 1), max_seq_len), pad_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    document_ids = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        start = 0
        for document, sample in enumerate(row):
            end = start + len(sample)
            input_ids[index, start:end] = sample.ids
            labels[index, start:end] = sample.labels
            document_ids[index, start:end] = document
            start = end
        document_ids[index, start:] = len(row)
    return {"input_ids": input_ids, "labels": labels, "document_ids": document_ids}
