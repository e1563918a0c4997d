"""KTO as a posttune method: unpaired feedback rows, the mismatched pairs of its KL estimate, and its loss.

- the dataset format ``unpaired`` (kind ``feedback``): TRL's unpaired preference rows, ``prompt``,
  ``completion`` and a boolean ``label`` (true: desirable), read by ``FeedbackMaker`` with DPO's
  tokenization (``PairMaker``: the chat template, the prompt masked, its tail kept under
  ``max_prompt_len``). A row becomes a group of two samples: the completion, and a one-token
  marker holding the label (the data toolkit stores token ids per sample and nothing else, so the
  label travels as one; it is never fed to a model). Map-style, streaming, mixtures and resume
  are the toolkit's, unchanged.
- ``feedback_batch``: each row's completion and its *mismatched* pair, the row's prompt followed
  by the completion of the row before it in the micro-batch (the first row takes the last one's),
  as TRL rotates completions by one within each device batch. The two are laid out as DPO's
  chosen and rejected responses (``pair_batch``): one forward per model, padding-free by default,
  each prompt computed once (the mismatched pair starts with its row's prompt).
- ``loss``: the summed per-example KTO loss (``kto_losses.py``), normalised by the trainer over
  the examples of the whole step. The reference point ``z0`` is the mean log-ratio of the
  micro-batch's mismatched pairs pooled over the ranks that hold different data (TRL gathers its
  per-process estimates across processes), clamped at 0 and detached: docs/dpo.md, "KTO".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from posttune.plugin import (IGNORE_INDEX, DatasetConfig, LossOutput, PairMaker, Session,
                             as_messages, token_logps)
from posttune_dpo.kto_losses import kl_reference_point, kto_losses
from posttune_dpo.method import REFERENCE, pair_logps

KIND = "feedback"


@dataclass(frozen=True)
class FeedbackRow:
    """One row of unpaired feedback: a prompt, one completion (chat messages, or both text), and whether the
    completion is desirable."""

    prompt: list[dict[str, Any]] | str
    completion: list[dict[str, Any]] | str
    desirable: bool


def unpaired(row: Mapping[str, Any]) -> FeedbackRow:
    """TRL's unpaired preference row: ``prompt`` and ``completion`` (strings, or message lists as in the
    ``preference`` format) and ``label``, a JSON boolean; anything else is refused rather than guessed
    (``"false"`` or ``0`` would be read as opposite answers by different readers)."""
    label = _label(row)
    return FeedbackRow(as_messages(row["prompt"], "prompt", "user"),
                       as_messages(row["completion"], "completion", "assistant"), label)


def unpaired_text(row: Mapping[str, Any]) -> FeedbackRow:
    """TRL's standard unpaired rows: ``prompt`` and ``completion`` as plain text, encoded as ``prompt +
    completion`` and EOS with no chat template (as TRL's KTOTrainer does), and ``label``."""
    label = _label(row)
    for field in ("prompt", "completion"):
        if not isinstance(row[field], str):
            raise ValueError(f"field '{field}' must be text in format unpaired_text, got {type(row[field]).__name__} "
                             "(message lists: use format unpaired)")
    return FeedbackRow(row["prompt"], row["completion"], label)


def _label(row: Mapping[str, Any]) -> bool:
    for field in ("prompt", "completion", "label"):
        if row.get(field) is None:
            raise KeyError(field)
    label = row["label"]
    if isinstance(label, str) and label.strip().lower() in ("true", "false"):  # a CSV's cell, read as text
        label = label.strip().lower() == "true"
    if not isinstance(label, bool):
        raise ValueError(f"field 'label' must be true (desirable) or false (undesirable), got {label!r}")
    return label


class FeedbackMaker(PairMaker):
    """Feedback rows -> ``[(completion ids, labels), ([label], [IGNORE_INDEX])]`` (a sample group).

    The completion is tokenized exactly as DPO tokenizes a response (``PairMaker.responses``); row errors,
    ``skip_bad_rows`` and the skip counts are ``SampleMaker``'s.
    """

    kind = KIND

    def make(self, row: FeedbackRow) -> list[tuple[list[int], list[int]]] | None:
        samples = self.responses(row.prompt, (row.completion,))
        if samples is None:  # truncation left nothing of the completion to score
            return None
        return [samples[0], ([int(row.desirable)], [IGNORE_INDEX])]


def mismatched(prompt_of: Any, completion_of: Any, max_seq_len: int) -> Any:
    """The sample ``prompt_of``'s prompt followed by ``completion_of``'s completion, cut to ``max_seq_len``.

    A sample's prompt is its tokens up to its first target's position (the chat template's assistant
    header included, the same for every row), its completion the rest with the labels it had.
    """
    p = int((prompt_of.labels != IGNORE_INDEX).nonzero()[0])
    q = int((completion_of.labels != IGNORE_INDEX).nonzero()[0])
    ids = torch.cat([prompt_of.ids[: p + 1], completion_of.ids[q + 1:]])[:max_seq_len]
    labels = torch.cat([prompt_of.labels[:p], completion_of.labels[q:]])[:max_seq_len].clone()
    labels[-1] = IGNORE_INDEX  # the last position has no target, also where the cut fell
    return replace(prompt_of, ids=ids, labels=labels)  # the toolkit's Sample, of prompt_of's row


def feedback_batch(rows: list[list[Any]], *, pad_id: int, max_seq_len: int, pad_to_multiple_of: int | None = None,
                   padding_free: bool = True, share_prompt: bool = True) -> dict[str, Any]:
    """A micro-batch of feedback rows: ``pair_batch`` of (completion, mismatched pair) per row, plus
    ``desirable`` and ``kl_scored`` (the pair has a target left after the cut), each ``[rows]``."""
    from posttune.plugin import pair_batch

    completions = [group[0] for group in rows]
    pairs = [mismatched(sample, completions[index - 1], max_seq_len) for index, sample in enumerate(completions)]
    batch = pair_batch([[c, k] for c, k in zip(completions, pairs)], pad_id=pad_id,
                       pad_to_multiple_of=pad_to_multiple_of, padding_free=padding_free, share_prompt=share_prompt)
    batch["desirable"] = torch.tensor([bool(group[1].ids[0]) for group in rows] or [False])
    batch["kl_scored"] = torch.tensor([bool((k.labels != IGNORE_INDEX).any()) for k in pairs] or [False])
    return batch


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune.plugin import pad_id, pair_loader, splits_sequence

    config, method = session.config.data, session.method_config
    collate = partial(feedback_batch, pad_id=pad_id(session.tokenizer), max_seq_len=config.max_seq_len,
                      pad_to_multiple_of=config.pad_to_multiple_of, padding_free=method.padding_free,
                      # a plan that splits the sequence (context parallelism) keeps each document to itself
                      share_prompt=method.padding_free and method.share_prompt and not splits_sequence(session))
    return pair_loader(session, dataset, split, collate=collate, maker=FeedbackMaker)


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    from posttune.plugin import sum_over_token_ranks

    config = session.method_config
    policy, policy_kl = pair_logps(token_logps(session, batch), batch, False)
    with torch.no_grad():
        reference, reference_kl = pair_logps(token_logps(session, batch, model=session.models[REFERENCE]), batch,
                                             False)
    real = batch["rows"] >= 0  # a placeholder row (an empty share of the last batch) weighs nothing
    desirable, undesirable = batch["desirable"] & real, ~batch["desirable"] & real
    scored = (batch["kl_scored"] & real).to(policy.dtype)
    # z0 from this micro-batch's mismatched pairs, pooled over the ranks holding different data: every rank
    # takes the same reference point, as TRL's gathered estimate (no gradient: the policy's share is detached)
    kl = torch.stack([((policy_kl.detach() - reference_kl) * scored).sum(), scored.sum()]).float()
    z0 = kl_reference_point(*sum_over_token_ranks(kl, session))
    losses, rewards = kto_losses(policy, reference, batch["desirable"], z0.to(policy.dtype), beta=config.beta,
                                 desirable_weight=config.desirable_weight,
                                 undesirable_weight=config.undesirable_weight)
    weight = real.to(losses.dtype)

    def mean(values: torch.Tensor, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        where = where.to(values.dtype)
        return (values.detach() * where).sum(), where.sum()

    return LossOutput((losses * weight).sum(), weight.sum(), tokens=batch["num_tokens"], unit="examples", metrics={
        "rewards/chosen": mean(rewards, desirable),
        "rewards/rejected": mean(rewards, undesirable),
        "logps/chosen": mean(policy, desirable),
        "logps/rejected": mean(policy, undesirable),
        "kl": z0,
        "desirable_fraction": mean(desirable.to(losses.dtype), real),
    })
