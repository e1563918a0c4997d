"""The reward model as a posttune method: preference pairs in, one forward, Bradley-Terry loss.

- ``data``: preference pairs through the core's toolkit (``pair_loader``: the checkpoint's chat
  template, the prompt's tail kept under ``max_prompt_len``), the chosen rows then the rejected
  ones in one forward pass.
- ``loss``: the score head's value at each row's last token that is not padding
  (``sequence_scores``, transformers' pooling, so the exported model scores the same), the
  per-pair loss summed, normalised by the trainer over the pairs of the whole step.
"""

from __future__ import annotations

from typing import Any

import torch

from posttune.plugin import DatasetConfig, LossOutput, Session, pad_id, sequence_scores
from posttune_rm.losses import bradley_terry


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune.plugin import pair_loader

    return pair_loader(session, dataset, split)


def rewards(session: Session, batch: dict[str, Any], model: Any = None) -> torch.Tensor:
    """One reward per row of ``batch["input_ids"]``: the score head's first value at the row's last real token."""
    model = session.model if model is None else model
    scores = model(batch["input_ids"])  # [rows, seq, labels]
    return sequence_scores(scores, batch["input_ids"], pad_id(session.tokenizer))[:, 0].float()


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
