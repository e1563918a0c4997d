"""Micro-batches from samples: right padding, or packed rows with document ids.

Batch dict keys:
- ``input_ids`` LongTensor [b, s]: token ids, right-padded with the tokenizer's pad id.
- ``labels`` LongTensor [b, s]: pre-shifted targets (`samples.py`), IGNORE_INDEX on padding.
- ``document_ids`` LongTensor [b, s] (packed and padding-free rows): 0, 1, ... for the samples of a row in order,
  and one more id for the row's tail padding. Ids are non-negative and non-decreasing along a
  row, so they serve both `modules.attention.attention_mask` (a query sees only its own id) and
  varlen kernels that derive boundaries from id changes. The model restarts positions per id.
- ``num_tokens`` LongTensor []: the real (non-padding) tokens of the batch, what throughput counts.
- ``real_tokens`` BoolTensor [b, s]: True on the samples' tokens, False on padding (a placeholder's
  too). Targets alone cannot say it (a prompt has none); a mixture of experts' routing statistics
  count only these tokens, as transformers counts those of its ``attention_mask``.

``pair_batch`` (preference pairs) stacks the chosen samples, then the rejected ones, so one
forward pass scores both: rows ``i`` and ``b + i`` are pair i; ``rows`` LongTensor [b] holds each
pair's dataset row (-1 for a placeholder), the key under which a method keeps per-pair data.
With ``padding_free`` the same 2b samples are documents 0..2b-1 of one row (``flat_batch``'s layout);
with ``share_prompt`` too, pair i is documents 2i and 2i+1, its prompt computed once (``positions``
LongTensor [b, s] says where the second continues the first: ``shared_prompt_row``).

``flat_batch`` (a method's ``padding_free``) puts the samples of a padded batch end to end in one row
with ``document_ids``: the padded batch's loss and gradients without any padding computed.

``pad_to_multiple_of`` (``data.pad_to_multiple_of``) rounds the padded width up to a multiple:
the extra columns are padding like any other (no target), so losses do not change, while
kernels and compiled graphs see fewer distinct shapes.

A rank whose share of the last global batch is empty gets a placeholder batch of one padding
row with no targets: every rank then runs the same number of steps, and the trainer's token-count
normalisation gives that rank zero weight.
"""

from __future__ import annotations

from typing import Any

import torch

from posttune.data.samples import IGNORE_INDEX, Sample


def padded_batch(rows: list[list[Sample]], *, pad_id: int, pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """One sample per row, right-padded to the longest (a single padding token for an empty share)."""
    samples = [sample for row in rows for sample in row]
    return {**_pad(samples, pad_id, rows=max(len(samples), 1), multiple=pad_to_multiple_of),
            "num_tokens": _count(samples)}


def pair_batch(rows: list[list[Sample]], *, pad_id: int, pad_to_multiple_of: int | None = None,
               padding_free: bool = False, share_prompt: bool = False) -> dict[str, Any]:
    """Preference pairs ``[chosen, rejected]``: chosen rows first, then rejected, right-padded.

    An empty share becomes one placeholder pair without targets (``rows`` -1). ``padding_free``:
    the same samples in the same order end to end in ONE row with ``document_ids`` (``flat_batch``),
    document ``i`` the i-th row of the padded form (a placeholder a one-token document).
    ``share_prompt`` (with ``padding_free``): each pair's prompt once, documents ``2i`` and ``2i + 1``
    pair i's chosen and rejected responses (``shared_prompt_row``).
    """
    chosen, rejected = [row[0] for row in rows], [row[1] for row in rows]
    count = max(len(rows), 1)
    samples = chosen + [None] * (count - len(rows)) + rejected + [None] * (count - len(rows))
    if padding_free and share_prompt:
        interleaved = [sample for pair in zip(samples[:count], samples[count:]) for sample in pair]
        batch = shared_prompt_row(interleaved, pad_id, pad_to_multiple_of)
    elif padding_free:
        batch = _flat(samples, pad_id, pad_to_multiple_of)
    else:
        batch = _pad(samples, pad_id, rows=2 * count, multiple=pad_to_multiple_of)
    batch["rows"] = torch.tensor([row[0].row for row in rows] or [-1], dtype=torch.long)
    batch["num_tokens"] = _count(chosen + rejected)
    return batch


def _pad(samples: list[Sample | None], pad_id: int, *, rows: int,
         multiple: int | None = None) -> dict[str, torch.Tensor]:
    """``rows`` x longest ids, labels and real tokens (rounded up to ``multiple``), right-padded; a None
    sample (or a missing one) is all padding."""
    length = max((len(s) for s in samples if s is not None), default=1)
    if multiple is not None:
        length = -(-length // multiple) * multiple
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    real = torch.zeros_like(input_ids, dtype=torch.bool)
    for index, sample in enumerate(samples):
        if sample is not None:
            input_ids[index, : len(sample)] = sample.ids
            labels[index, : len(sample)] = sample.labels
            real[index, : len(sample)] = True
    return {"input_ids": input_ids, "labels": labels, "real_tokens": real}


def packed_batch(rows: list[list[Sample]], *, pad_id: int, max_seq_len: int) -> dict[str, Any]:
    """Each row's samples side by side in exactly ``max_seq_len`` tokens, with ``document_ids``."""
    input_ids = torch.full((max(len(rows), 1), max_seq_len), pad_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    document_ids = torch.zeros_like(input_ids)
    real = torch.zeros_like(input_ids, dtype=torch.bool)
    for index, row in enumerate(rows):
        start = 0
        for document, sample in enumerate(row):
            end = start + len(sample)
            input_ids[index, start:end] = sample.ids
            labels[index, start:end] = sample.labels
            document_ids[index, start:end] = document
            start = end
        document_ids[index, start:] = len(row)
        real[index, :start] = True
    return {"input_ids": input_ids, "labels": labels, "document_ids": document_ids, "real_tokens": real,
            "num_tokens": _count([sample for row in rows for sample in row])}


def flat_batch(rows: list[list[Sample]], *, pad_id: int, pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """Padding-free: the batch's samples end to end in ONE row, each its own document.

    The same samples, targets and loss as ``padded_batch`` (a document attends only to itself and
    its positions restart at 0), without computing a single padding token: a padded batch of
    alpaca-length rows is a third padding. The row is as long as the samples together (rounded up
    to ``pad_to_multiple_of``, the tail one more document without targets).
    """
    samples = [sample for row in rows for sample in row]
    return {**_flat(samples, pad_id, pad_to_multiple_of), "num_tokens": _count(samples)}


def _flat(samples: list[Sample | None], pad_id: int, multiple: int | None) -> dict[str, torch.Tensor]:
    """``samples`` end to end in one row, document i the i-th (a None sample one padding token), the
    row rounded up to ``multiple`` with one more document without targets: ``shared_prompt_row``'s
    layout with nothing shared, so the documents' positions restart at 0 and need not be given."""
    row = shared_prompt_row(samples, pad_id, multiple, share_prompt=False)
    del row["positions"]
    return row


def shared_prompt_row(samples: list[Sample | None], pad_id: int, multiple: int | None = None, *,
                      share_prompt: bool = True) -> dict[str, torch.Tensor]:
    """Samples end to end in one row, document i the i-th, each prompt computed once.

    A sample's prompt is its leading tokens without a target, but the last of them (whose prediction
    is the response's first target, so it stays). When the last sample that shares nothing (the
    root) starts with the same prompt, the sample leaves it out: ``positions`` start its document
    where the prompt ends, so it attends to the root's copy (``modules.attention``) and every token
    sees what it would see alone. Preference pairs (the rejected response continues the chosen one)
    and a group of completions of one prompt both fit. A None sample (a placeholder) is one padding
    token; the row's tail, to ``multiple``, one more document. ``share_prompt=False``: every
    document whole (``flat_batch``'s layout, with positions).
    """
    parts: list[tuple[torch.Tensor, torch.Tensor, int, bool]] = []  # (ids, labels, first position, real) per document
    root: Sample | None = None
    for sample in samples:
        if sample is None:
            parts.append((torch.tensor([pad_id]), torch.tensor([IGNORE_INDEX]), 0, False))
            continue
        skip = _shared_prefix(root, sample) if share_prompt else 0
        root = sample if skip == 0 else root
        parts.append((sample.ids[skip:], sample.labels[skip:], skip, True))
    total = sum(len(ids) for ids, *_ in parts)
    width = max(total, 1)  # an empty share: one padding token
    width = -(-width // multiple) * multiple if multiple else width
    input_ids = torch.full((1, width), pad_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    document_ids = torch.full_like(input_ids, len(parts))
    positions = torch.arange(width).unsqueeze(0) - total  # the tail's positions: 0, 1, ...
    real_tokens = torch.zeros_like(input_ids, dtype=torch.bool)
    end = 0
    for document, (ids, targets, start, real) in enumerate(parts):
        end, begin = end + len(ids), end
        input_ids[0, begin:end], labels[0, begin:end], document_ids[0, begin:end] = ids, targets, document
        positions[0, begin:end], real_tokens[0, begin:end] = torch.arange(start, start + len(ids)), real
    return {"input_ids": input_ids, "labels": labels, "document_ids": document_ids, "positions": positions,
            "real_tokens": real_tokens}


def rows_as_documents(input_ids: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor, *, pad_id: int,
                      share_prompt: bool = True) -> dict[str, torch.Tensor]:
    """Right-padded rows ``[n, s]`` (row r's first ``lengths[r]`` tokens real) as one padding-free row of
    documents, on their device: ``shared_prompt_row`` of the rows, so consecutive rows that start with
    one prompt (a group of completions) compute it once. ``documents_as_rows`` maps per-token values back."""
    ids, targets = input_ids.detach().cpu(), labels.detach().cpu()
    samples = [Sample(ids[row, :size], targets[row, :size], row)
               for row, size in enumerate(lengths.clamp(1, ids.shape[1]).tolist())]
    batch = shared_prompt_row(samples, pad_id, share_prompt=share_prompt)
    return {key: value.to(input_ids.device, non_blocking=True) for key, value in batch.items()}


def documents_as_rows(values: torch.Tensor, batch: dict[str, torch.Tensor], rows: int, width: int) -> torch.Tensor:
    """Per-token ``values`` ``[1, L]`` of ``rows_as_documents``' row back in the padded ``[rows, width]`` layout
    (a document's positions are its row's columns; the columns it left out, and padding, get 0). Differentiable."""
    documents, positions = batch["document_ids"][0], batch["positions"][0]
    mine = documents < rows  # the tail, rounded up, is one more document
    out = values.new_zeros(rows, width)
    return out.index_put((documents[mine], positions[mine]), values[0][mine])


def _shared_prefix(root: Sample | None, sample: Sample) -> int:
    """How many leading tokens ``sample`` takes from ``root``: its whole prompt (the leading tokens
    without a target, but its last token) when ``root`` starts with the same, else none. A sample
    that shares only part of its prompt (another prompt after a common system turn) is a root of
    its own, so that the samples after it can share all of its prompt."""
    untrained = int((sample.labels[: len(sample) - 1] == IGNORE_INDEX).long().cumprod(0).sum())
    if root is None or untrained == 0 or untrained > len(root):
        return 0
    head = slice(0, untrained)
    shared = bool((root.ids[head] == sample.ids[head]).all() and (root.labels[head] == IGNORE_INDEX).all())
    return untrained if shared else 0


def _count(samples: list[Sample]) -> torch.Tensor:
    return torch.tensor(sum(len(sample) for sample in samples), dtype=torch.long)


def pad_id(tokenizer: Any) -> int:
    """The pad id, else eos, else 0: padded positions carry no target, so any valid id serves."""
    for candidate in (getattr(tokenizer, "pad_id", None), getattr(tokenizer, "eos_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0
