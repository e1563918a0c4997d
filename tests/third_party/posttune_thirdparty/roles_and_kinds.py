"""A data kind and a model role the core has never heard of, as a third party adds them.

    models:
      anchor: {path: ./my-base-model}     # the frozen model the policy is held near
    method: {name: anchored_lm, beta: 0.1}
    data:
      train: {path: snippets.jsonl, format: snippet}

- The kind ``snippet``: a row is a piece of plain text (``{"snippet": "..."}``), trained on
  every token. The format ``snippet`` gives rows of that kind; ``anchored_lm`` reads it, so a
  ``chat`` dataset (kind ``conversation``) is refused before launch, and ``snippet`` rows are
  refused by methods that read other kinds.
- The role ``anchor``: a frozen model from the config's ``models.anchor`` section (required:
  no default from the policy), built and sharded as the run's plans say, ``session.models["anchor"]``.
- ``anchored_lm``: the token cross-entropy plus ``beta`` x the squared gap between the policy's
  and the anchor's log-probability of each target token, summed (the trainer divides by the
  labelled tokens).

Nothing here is known to the core: the kind and the role are plain names declared below.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from posttune.plugin import (ConfigError, DatasetFormat, LossOutput, Method, ModelRole, SampleMaker, Session,
                             build_loader, dataset_format, pad_id, padded_batch, token_cross_entropy, token_logps)

KIND = "snippet"
ROLE = "anchor"


def snippet(row: dict[str, Any]) -> str:
    """A ``snippet`` row: its text, trained on every token."""
    text = row["snippet"]
    if not isinstance(text, str) or not text:
        raise ValueError("field 'snippet' must be a non-empty string")
    return text


class SnippetMaker(SampleMaker):
    """``SampleMaker`` reads plain text already; it only has to accept this kind of rows."""

    kind = KIND


@dataclass(frozen=True)
class AnchoredConfig:
    beta: float = 0.1  # weight of the squared log-probability gap to the anchor model


def validate(config: Any, method: AnchoredConfig) -> None:
    if not method.beta >= 0:
        raise ConfigError("method.beta", f"expected a number >= 0, got {method.beta}")


def data(session: Session, dataset: Any, split: str) -> Any:
    settings = session.config.data
    make = SnippetMaker(dataset_format(session, split), session.tokenizer, max_seq_len=settings.max_seq_len,
                        skip_bad_rows=settings.skip_bad_rows, column_map=dataset.column_map, where=f"data.{split}")
    collate = partial(padded_batch, pad_id=pad_id(session.tokenizer))
    return build_loader(session, dataset, split, make=make, collate=collate)


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    import torch

    ce, labelled = token_cross_entropy(session, batch)
    policy = token_logps(session, batch)
    with torch.no_grad():
        anchor = token_logps(session, batch, model=session.models[ROLE])
    gap = (policy - anchor).square().sum()  # 0 where a label is ignored: both log-probs are 0 there
    return LossOutput(ce + session.method_config.beta * gap, labelled, tokens=batch["num_tokens"],
                      metrics={"anchor_gap": (gap.detach(), labelled)})


FORMAT = DatasetFormat(KIND, KIND, snippet, ("snippet",), "a piece of plain text, trained on every token")
METHOD = Method(
    name="anchored_lm", config=AnchoredConfig, dataset_kind=KIND, data=data, loss=loss,
    roles=(ModelRole(ROLE),), validate=validate,
    description="cross-entropy on snippets, held near a frozen anchor model (a third-party example)",
)


def register_datasets(register: Any) -> None:
    register(FORMAT)


def register_methods(register: Any) -> None:
    register(METHOD)
