"""Score heads: a decoder that returns a few values per token instead of vocabulary logits.

Reward models and value models are the family's decoder with its output head replaced by
``Linear(hidden, num_labels)`` (docs/checkpoints.md, "Score heads"). Hugging Face stores such a
model as ``<Arch>ForSequenceClassification``: the same backbone names, the head as
``score.weight``, ``num_labels`` in config.json. A sequence's score is the head's value at its
last token that is not the pad id, transformers' rule (``sequence_scores``), so a model scored
here and in transformers agrees on the same ids.

Only the head's names differ from the causal checkpoint, so any family's converter serves: the
head is renamed around it (``score_converter``) and a causal LM's ``lm_head`` is dropped when a
fresh score head replaces it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from posttune.checkpoint.origin import attach, origin_of
from posttune.descriptors import CheckpointConverter
from posttune.errors import PosttuneError

CAUSAL, SEQUENCE_CLASSIFICATION = "ForCausalLM", "ForSequenceClassification"
SCORE_HEAD = "output.weight"  # the native head (posttune.modules.Decoder.output)
HF_LM_HEAD, HF_SCORE = "lm_head.weight", "score.weight"
LABELS = "score_labels"  # ModelOrigin.extra's key: how many values the head gives per token


def add_score_head(model: nn.Module, num_labels: int = 1) -> nn.Module:
    """Replace ``model.output`` by a fresh ``Linear(hidden, num_labels)`` (no bias, untied, no soft-cap)."""
    if not isinstance(getattr(model, "output", None), nn.Linear):
        raise PosttuneError(f"{type(model).__name__} has no output head `output` (posttune.modules.Decoder's "
                            "contract): a score head cannot replace it")
    old = model.output.weight
    model.output = nn.Linear(old.shape[1], num_labels, bias=False, device=old.device, dtype=old.dtype)
    model.tie_word_embeddings = False
    model.logit_softcap = None  # transformers' sequence-classification heads are not capped
    origin = origin_of(model)
    attach(model, replace(origin, extra={**origin.extra, LABELS: num_labels}))
    return model


def score_labels(model: Any) -> int | None:
    """The values per token of a model with a score head, or None for a language model (or one posttune
    did not build); found through wrappers (``torch.compile``) as ``origin_of`` finds it."""
    try:
        return origin_of(model).extra.get(LABELS)
    except PosttuneError:
        return None


def score_pad_id(model: Any, fallback: int) -> int | None:
    """The pad id a loaded score model pools by, as transformers reads it: its config.json's ``pad_token_id``
    (None: there is none, and a row scores at its last token); ``fallback`` for a model not loaded from a
    checkpoint (built from a size, or wrapped beyond ``origin_of``)."""
    try:
        config = origin_of(model).hf_config
    except PosttuneError:
        return fallback
    return fallback if config is None else config.get("pad_token_id")


def checkpoint_labels(hf_config: Mapping[str, Any]) -> int | None:
    """``num_labels`` of a sequence-classification checkpoint's config.json, None for a causal one."""
    if not any(str(name).endswith(SEQUENCE_CLASSIFICATION) for name in hf_config.get("architectures") or ()):
        return None
    labels = hf_config.get("id2label")
    return len(labels) if isinstance(labels, Mapping) and labels else int(hf_config.get("num_labels", 2))


def causal_architectures(architectures: Any) -> list[str]:
    """The causal-LM names of ``architectures`` (what families register), sequence classifiers mapped back."""
    return [str(name).removesuffix(SEQUENCE_CLASSIFICATION) + CAUSAL if str(name).endswith(SEQUENCE_CLASSIFICATION)
            else str(name) for name in architectures or ()]


def score_converter(converter: CheckpointConverter) -> CheckpointConverter:
    """``converter`` with the head named ``score.weight``; a checkpoint's ``lm_head.weight`` is dropped."""

    def to_native(key: str, tensor: torch.Tensor, hf_config: Mapping[str, Any]) -> Any:
        if key == HF_SCORE:
            return SCORE_HEAD, tensor
        return None if key == HF_LM_HEAD else converter.to_native(key, tensor, hf_config)

    def from_native(key: str, tensor: torch.Tensor, hf_config: Mapping[str, Any]) -> Any:
        return (HF_SCORE, tensor) if key == SCORE_HEAD else converter.from_native(key, tensor, hf_config)

    return replace(converter, to_native=to_native, from_native=from_native)


def score_config(config: Mapping[str, Any], num_labels: int, pad_id: int | None) -> dict[str, Any]:
    """config.json of a score model: ``<Arch>ForSequenceClassification``, its labels and a pad id
    (transformers cannot find a row's last token in a batch without one)."""
    config = dict(config)
    config["architectures"] = [name.removesuffix(CAUSAL) + SEQUENCE_CLASSIFICATION if name.endswith(CAUSAL)
                               else name for name in causal_architectures(config.get("architectures"))]
    config["num_labels"] = num_labels
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    config["tie_word_embeddings"] = False
    if pad_id is not None:  # the id the scores were pooled by in training
        config["pad_token_id"] = pad_id
    return config


def sequence_scores(scores: torch.Tensor, input_ids: torch.Tensor, pad_id: int, *,
                    document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[batch, labels]``: each row's score at its last token that is not ``pad_id`` (position 0 if none),
    as transformers' sequence classifiers pool.

    With ``document_ids`` (rows of documents end to end, ``flat_batch``): per document instead,
    ``[batch, documents, labels]``, each at the document's last token that is not ``pad_id`` (its first
    if none), so a padding-free batch scores as its padded form; a document id a row does not use gets
    the row's first position. One host sync (the number of documents).
    """
    if document_ids is None:
        real = (input_ids != pad_id).to(torch.long)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (positions * real).argmax(-1)
        return scores[torch.arange(scores.shape[0], device=scores.device), last.to(scores.device)]
    rows, width = input_ids.shape
    documents = int(document_ids.max()) + 1
    index = (document_ids + documents * torch.arange(rows, device=document_ids.device)[:, None]).flatten()
    positions = torch.arange(rows * width, device=input_ids.device)
    starts = (torch.arange(rows, device=input_ids.device) * width).repeat_interleave(documents)
    first = torch.full_like(starts, rows * width).scatter_reduce(0, index, positions, "amin")
    real = torch.where(input_ids.flatten() != pad_id, positions, -1)
    last = torch.full_like(starts, -1).scatter_reduce(0, index, real, "amax")
    pick = torch.where(last >= 0, last, torch.where(first < rows * width, first, starts))
    return scores.flatten(0, 1)[pick.to(scores.device)].view(rows, documents, scores.shape[-1])


HEAD_FILE = "head.safetensors"  # a PolicyHead's weights, in a checkpoint's models/<role>/ and the final <role>/


class PolicyHead(nn.Module):
    """A trained score head on the policy's final hidden states (``ModelRole(on_policy=True)``): e.g. a
    value head sharing the policy's trunk, so no second model is held.

    ``forward(input_ids)`` runs the policy's trunk, then the head; ``forward(hidden=...)`` applies the head
    to hidden states the caller already has (one trunk forward for both the logits and the values). The
    policy is deliberately not a submodule: its parameters stay the policy's (in the optimizer once, saved
    with it); this module holds the head alone (``score.weight``, ``[num_labels, hidden]``).
    """

    def __init__(self, policy: nn.Module, num_labels: int = 1, *, device: Any = None):
        super().__init__()
        head = policy.output.weight  # a DTensor under a sharding plan: its shape is the whole tensor's
        self.score = nn.Linear(head.shape[1], num_labels, bias=False, device=device, dtype=head.dtype)
        object.__setattr__(self, "trunk", policy)  # not registered: see the docstring

    def forward(self, input_ids: torch.Tensor | None = None, *, hidden: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        if hidden is None:
            hidden = self.trunk(input_ids, return_hidden=True, **kwargs)
        return self.score(hidden)


def save_policy_head(head: PolicyHead, directory: Any, state: Mapping[str, torch.Tensor] | None = None) -> Any:
    """``directory/head.safetensors`` holding ``score.weight`` (written atomically); ``state``: the gathered
    tensors of a sharded head."""
    from pathlib import Path

    from safetensors.torch import save_file

    from posttune.checkpoint.atomic import atomic_dir

    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in (state or head.state_dict()).items()}
    with atomic_dir(directory, replaceable=(HEAD_FILE,)) as tmp:
        save_file(tensors, str(Path(tmp) / HEAD_FILE), metadata={"format": "pt"})
    return Path(directory)


def load_policy_head(head: PolicyHead, directory: Any) -> None:
    from pathlib import Path

    from safetensors.torch import load_file

    from posttune.checkpoint import materialize as mat

    saved = load_file(str(Path(directory) / HEAD_FILE))
    with torch.no_grad():
        for name, param in head.named_parameters():
            mat.copy_into(param, saved[name])
