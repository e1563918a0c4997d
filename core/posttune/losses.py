"""Token-level losses shared by methods; the ``loss``-stage memory technique may replace the kernels.

Labels are pre-shifted by the data pipeline (``labels[:, t]`` is the target of position t,
``IGNORE_INDEX`` where nothing is learned), so nothing here shifts. Every function that feeds
the trainer returns a *sum* (the trainer divides once by the global normaliser, see
``posttune.training.trainer``).

When a technique installed ``session.loss_kernel`` (chunked cross-entropy), both functions use
it: full ``[batch, seq, vocab]`` logits are then never materialised. Final-logit soft-caps are
applied either way (``model.logits`` / the kernel's per-chunk cap).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from posttune.data.samples import IGNORE_INDEX
from posttune.modules.decoder import forward_takes


def token_cross_entropy(session: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of the policy over labelled positions, and their count."""
    kernel = getattr(session, "loss_kernel", None)
    if kernel is not None:
        return kernel.cross_entropy(session.model, batch)
    logits, labels, _ = labelled_logits(session.model, batch)
    loss_sum = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum, (batch["labels"] != IGNORE_INDEX).sum()


def token_logps(session: Any, batch: dict[str, torch.Tensor], model: Any = None, *,
                temperature: float = 1.0, entropies: bool = False) -> Any:
    """``[batch, seq]`` log-probabilities of each label under ``model``; 0 where the label is ignored.

    ``model`` defaults to the policy; a model role (``session.models[name]``, also the
    policy with its adapters disabled) works the same way. ``temperature`` divides the logits
    first (after any soft-cap), as sampling at that temperature did: what a policy-gradient loss
    needs for completions it sampled. Differentiable when grad is enabled. Under loss parallel
    the logits stay vocabulary-sharded: ``cross_entropy`` is what that context parallelises.
    ``entropies``: ``(logps, entropies)``, the second the entropy in nats of ``softmax(logits /
    temperature)`` at each labelled position (0 elsewhere), without gradient (GRPO's high-entropy
    token selection), from the same forward.
    """
    from posttune.adapters.inject import active_model

    with active_model(session.model if model is None else model) as module:
        kernel = getattr(session, "loss_kernel", None)
        if kernel is not None and not entropies:
            return kernel.logps(module, batch, temperature)
        if kernel is not None and kernel.logps_entropies is not None:
            return kernel.logps_entropies(module, batch, temperature)
        logits, labels, keep = labelled_logits(module, batch)
        if temperature != 1.0:
            logits = logits / temperature
        nll = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                              reduction="none")
        values = (-nll, logits_entropy(logits)) if entropies else (-nll,)
        placed = tuple(in_label_shape(value, labels, keep) for value in values)
        return placed if entropies else placed[0]


def in_label_shape(values: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Per-position ``values`` of ``labelled_logits``' rows (``keep``: the mask they were taken at, or None for
    the full ``[batch, seq]``) in the batch's ``[batch, seq]`` shape, 0 where the label is ignored."""
    if hasattr(values, "full_tensor"):  # vocabulary-sharded logits under loss parallel: a DTensor result
        values = values.full_tensor()
    if keep is None:
        return values.view(labels.shape) * (labels != IGNORE_INDEX)
    return torch.zeros(keep.shape, dtype=values.dtype, device=values.device).masked_scatter(keep, values)


@torch.no_grad()
def logits_entropy(logits: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """The entropy (nats) of ``softmax(logits)`` over the last dimension, float32, ``rows`` rows at a time so
    only one chunk's probabilities exist at once; vocabulary-sharded logits (a DTensor) in one piece."""
    flat = logits.flatten(0, -2)
    parts = []
    for chunk in [flat] if hasattr(flat, "full_tensor") else flat.split(rows):
        logps = F.log_softmax(chunk.float(), dim=-1)
        parts.append(-(logps.exp() * logps).sum(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # split gives one (empty) chunk of no rows


def labelled_logits(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(logits, their labels, the mask they were taken at or None) of ``batch`` under ``model``.

    A native decoder (its forward takes ``logits_at``) puts only the labelled positions through
    its head: ``[n, vocab]`` logits and ``[n]`` labels. With a 150k vocabulary the head is a
    quarter of a 0.5B model's matmuls and its logits most of the activations, and a prompt is
    often half of a row. Otherwise (another model; a head tensor parallel shards) the full
    ``[batch, seq, vocab]`` logits, the labels as they are, and None.
    """
    labels = batch["labels"]
    kwargs = {"document_ids": batch.get("document_ids"), "positions": batch.get("positions")}
    keep = labels != IGNORE_INDEX if forward_takes(model, "logits_at") else None
    logits = model(batch["input_ids"], **kwargs, **({} if keep is None else {"logits_at": keep}))
    if keep is None or logits.dim() == labels.dim() + 1:  # not selected: the head is sharded
        return logits, labels, None
    return logits, labels[keep], keep


def sequence_logps(token_values: torch.Tensor, labels: torch.Tensor, *, average: bool = False,
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row sum (or mean) of ``token_values`` over labelled positions: ``[batch]``.

    With ``document_ids`` (rows of documents end to end, ``flat_batch``): per document instead,
    ``[batch, documents]`` where ``documents`` is the largest id + 1 (one host sync); a document
    id a row does not use gets 0.
    """
    mask = labels != IGNORE_INDEX
    values = token_values * mask
    if document_ids is None:
        total, count = values.sum(-1), mask.sum(-1)
    else:
        rows, documents = document_ids.shape[0], int(document_ids.max()) + 1
        index = (document_ids + documents * torch.arange(rows, device=document_ids.device)[:, None]).flatten()
        total = values.new_zeros(rows * documents).index_add(0, index, values.flatten()).view(rows, documents)
        count = mask.new_zeros(rows * documents, dtype=torch.long).index_add(0, index, mask.flatten().long())
        count = count.view(rows, documents)
    return total / count.clamp(min=1) if average else total
