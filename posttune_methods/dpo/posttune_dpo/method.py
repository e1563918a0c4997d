"""DPO as a posttune method: its data, its reference model and its loss (plugin API 2).

- ``data``: preference pairs through the core's toolkit (``PairMaker``: the checkpoint's chat
  template, the prompt masked, its tail kept under ``max_prompt_len``), batched by
  ``pair_batch``: the chosen responses, then the rejected ones, in *one* forward pass; by
  default padding-free (``padding_free``), every response its own document of one row, so no
  padding is computed, and each pair's prompt computed once (``share_prompt``: the rejected
  response continues the chosen one's prompt; docs/dpo.md).
- the reference: the ``reference`` model role. The core builds it as a frozen copy of the
  policy's source (sharded like the policy under FSDP2), or hands the policy itself with its
  adapters disabled when LoRA/DoRA trains (no copy); with ``precompute_reference`` it is used
  once, in ``setup``, and then released.
- ``loss``: the summed per-pair loss, normalised by the trainer over the pairs of the whole step;
  RPO's NLL term (``rpo_alpha``) and ORPO's are per pair too (each chosen response's per-token mean).
- TR-DPO (``sync_reference_every``): after every that many optimizer steps the reference's weights move
  toward the policy's (``on_step_end``), each rank its own shard; once moved they are kept in checkpoints
  (``state_dict``), since nothing else could rebuild them.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.nn.functional as F

from posttune.plugin import ConfigError, DatasetConfig, LossOutput, Session, sequence_logps, token_logps
from posttune_dpo import REFERENCE_FREE, SFT, pair_losses, weighted_losses
from posttune_dpo.losses import LENGTH_NORMALISED, orpo_log_odds, preference_losses

REFERENCE = "reference"


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune.plugin import pad_id, pair_batch, pair_loader, splits_sequence

    pad, multiple = pad_id(session.tokenizer), session.config.data.pad_to_multiple_of
    padding_free = session.method_config.padding_free
    # a plan that splits the sequence (context parallelism) keeps each document to itself
    share = padding_free and session.method_config.share_prompt and not splits_sequence(session)

    def collate(rows: list) -> dict[str, Any]:
        batch = pair_batch(rows, pad_id=pad, pad_to_multiple_of=multiple, padding_free=padding_free,
                           share_prompt=share)
        batch["split"] = split  # which precomputed reference table holds these pairs
        return batch

    return pair_loader(session, dataset, split, collate=collate)


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    """Each pair's loss: the ``loss_type``'s, or the weighted sum of a list's. Sequence log-probs are token
    sums or (``LENGTH_NORMALISED`` losses) per-token means, each kind taken once per batch for both models;
    the rewards and log-probs logged are the first listed loss's."""
    config = session.method_config
    terms = weighted_losses(config)
    policy_tokens, weights = policy_token_logps(session, batch)
    policy: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
    reference: dict[bool, Any] = {}
    losses: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = {}
    logged = None
    placeholder = batch["rows"] < 0  # a placeholder pair (an empty share) weighs nothing
    for loss_type, weight in terms:
        if loss_type == SFT:
            continue
        average = loss_type in LENGTH_NORMALISED
        if average not in policy:
            policy[average] = pair_logps(policy_tokens, batch, average, config.ld_alpha)
            if average and "orpo" in (name for name, _ in terms):
                # a placeholder pair (no targets) has mean log-prob 0, probability 1: its odds would be infinite
                # and its loss NaN, which its weight 0 would not cancel; any finite value gives it a finite loss
                policy[average] = tuple(logps.masked_fill(placeholder, -1.0) for logps in policy[average])
        policy_chosen, policy_rejected = policy[average]
        reference_chosen = reference_rejected = None
        if loss_type not in REFERENCE_FREE:
            if average not in reference:
                reference[average] = reference_logps(session, batch, average)
            reference_chosen, reference_rejected = reference[average]
        term, chosen_rewards, rejected_rewards = preference_losses(
            policy_chosen, policy_rejected, reference_chosen, reference_rejected, loss_type=loss_type,
            beta=config.beta, label_smoothing=config.label_smoothing, gamma=config.simpo_gamma, tau=config.discopop_tau,
            f_divergence=config.f_divergence_type, f_alpha=config.f_alpha_divergence_coef, real=~placeholder)
        term = term if weight == 1.0 else weight * term
        losses = term if losses is None else losses + term
        if logged is None:
            logged = (policy_chosen, policy_rejected, chosen_rewards, rejected_rewards)
        if loss_type == "orpo":
            log_odds = orpo_log_odds(policy_chosen, policy_rejected)
            extra["log_odds_ratio"], extra["log_odds_chosen"] = F.logsigmoid(log_odds), log_odds
    nll_weight = dict(terms).get(SFT, config.rpo_alpha)
    if "orpo" in dict(terms) or nll_weight is not None:
        # the chosen response's NLL per token, one value per pair (its tokens' mean): summed over pairs and
        # divided by the step's pairs, as every pair's loss, so no split of the step changes it (docs/dpo.md)
        chosen_means = policy[True][0] if True in policy and config.ld_alpha is None else \
            pair_logps(policy_tokens, batch, True)[0]  # unweighted by ld_alpha, as TRL's sft term
        extra["nll_loss"] = -chosen_means
        if nll_weight is not None:
            losses = losses + nll_weight * extra["nll_loss"]
    if weights is not None:
        losses = losses * weights
        extra["wpo_weight"] = weights
    policy_chosen, policy_rejected, chosen_rewards, rejected_rewards = logged
    real = (~placeholder).to(losses.dtype)
    pairs = real.sum()

    def mean(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (values.detach() * real).sum(), pairs

    return LossOutput((losses * real).sum(), pairs, tokens=batch["num_tokens"], unit="pairs", metrics={
        "rewards/chosen": mean(chosen_rewards),
        "rewards/rejected": mean(rejected_rewards),
        "rewards/accuracy": mean((chosen_rewards > rejected_rewards).to(losses.dtype)),
        "rewards/margin": mean(chosen_rewards - rejected_rewards),
        "logps/chosen": mean(policy_chosen),
        "logps/rejected": mean(policy_rejected),
        **{key: mean(values) for key, values in extra.items()},
    })


def policy_token_logps(session: Session, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's token log-probs, and with ``wpo_weights`` each pair's WPO weight (Zhou et al. 2024,
    "WPO: Enhancing RLHF with Weighted Preference Optimization", eq. 2, as TRL's ``use_weighting``): the
    product of both responses' ``exp(mean over its tokens of log p(y_t) - log sum_v p(v)^2)``, each token's
    probability against the policy's own distribution there (1 for a response it would surely write), without
    gradient. The weights need the logits, so this path forms them (a loss technique that never does is
    refused in ``setup``)."""
    if not session.method_config.wpo_weights:
        return token_logps(session, batch), None
    from posttune.plugin import IGNORE_INDEX, in_label_shape, labelled_logits

    logits, labels, keep = labelled_logits(session.model, batch)
    logps = -F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none")
    with torch.no_grad():
        flat = logits.flatten(0, -2)
        flat = flat.full_tensor() if hasattr(flat, "full_tensor") else flat  # vocabulary-sharded (loss parallel)
        log_sum_sq = torch.cat([torch.logsumexp(2.0 * chunk.float(), -1) - 2.0 * torch.logsumexp(chunk.float(), -1)
                                for chunk in flat.split(1024)]) if flat.shape[0] else flat.new_zeros(0)
    logps, log_sum_sq = (in_label_shape(values, batch["labels"], keep) for values in (logps, log_sum_sq))
    chosen, rejected = pair_logps(logps.detach() - log_sum_sq, batch, True)
    return logps, torch.exp(chosen + rejected)


@torch.no_grad()
def reference_logps(session: Session, batch: dict[str, Any], average: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's (chosen, rejected) sequence log-probs: precomputed, or a forward pass now."""
    tables = session.method_state
    if tables is not None:
        return lookup(tables[batch["split"]][average], batch["rows"])
    return pair_logps(token_logps(session, batch, model=session.models[REFERENCE]), batch, average,
                      session.method_config.ld_alpha)


def pair_logps(token_values: torch.Tensor, batch: dict[str, Any], average: bool,
               ld_alpha: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence log-probs of a ``pair_batch``, padded rows or padding-free documents; with
    ``ld_alpha``, LD-DPO's: each response's tokens past its partner's length weighted by ``ld_alpha``."""
    if ld_alpha is not None:
        token_values = token_values * ld_weights(batch, ld_alpha).to(token_values.dtype)
    documents = batch.get("document_ids")
    if documents is None:
        return sequence_logps(token_values, batch["labels"], average=average).chunk(2)
    pairs = batch["rows"].numel()  # documents 0..2 * pairs - 1; a later id is the row's tail padding
    per_document = sequence_logps(token_values, batch["labels"], average=average, document_ids=documents)
    per_document = per_document[0, : 2 * pairs]
    if "positions" in batch:  # share_prompt: pair i is documents 2i and 2i + 1
        return per_document[0::2], per_document[1::2]
    return per_document.chunk(2)


def ld_weights(batch: dict[str, Any], alpha: float) -> torch.Tensor:
    """LD-DPO's token weights (Liu et al. 2024, "Length Desensitization in Direct Preference Optimization"), the
    labels' shape: 1 for a response's first ``min(len_chosen, len_rejected)`` tokens, ``alpha`` for the rest of
    the longer one, so the length a pair does not share counts less in either log-prob (TRL's ``ld_alpha``).
    Each response is a row (padded: pair i is rows i and pairs + i) or a document (padding-free: pair i is
    documents 2i and 2i + 1 with a shared prompt, else i and pairs + i); a later document is tail padding."""
    labels = batch["labels"]
    scored = (labels != -100).flatten().long()
    pairs = batch["rows"].numel()
    documents = batch.get("document_ids")
    if documents is None:
        documents = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(labels)
    documents = documents.flatten()
    count = max(int(documents.max()) + 1, 2 * pairs)
    lengths = torch.zeros(count, dtype=torch.long, device=labels.device).index_add_(0, documents, scored)
    running = scored.cumsum(0)  # each document (or row) is contiguous in the flattened order
    start = torch.zeros_like(lengths).scatter_reduce(0, documents, running - scored, "amin", include_self=False)
    position = running - start[documents]  # 1 for a response's first token
    index = torch.arange(count, device=labels.device)
    partner = index ^ 1 if "positions" in batch else (index + pairs) % (2 * pairs)
    partner = torch.where(index < 2 * pairs, partner, index)
    shared = torch.minimum(lengths, lengths[partner])
    weights = torch.where(position <= shared[documents], 1.0, alpha)
    return weights.view(labels.shape)


def setup(session: Session) -> None:
    """With ``precompute_reference``: score every pair with the reference once, then release it. With
    ``sync_reference_every``: check that the reference's weights pair with the policy's."""
    if session.method_config.sync_reference_every is not None:
        synced_pairs(session)
    kernel = getattr(session, "loss_kernel", None)
    if session.method_config.wpo_weights and kernel is not None:
        raise ConfigError("method.wpo_weights", f"WPO's weights need the policy's logits, which the loss kernel "
                                                f"'{kernel.name}' never forms; remove that memory technique")
    if not session.method_config.precompute_reference:
        return
    averages = sorted({name in LENGTH_NORMALISED for name in pair_losses(session.method_config)
                       if name not in REFERENCE_FREE})
    splits = {"train": session.train_data, "validation": session.validation_data}
    session.method_state = {split: precompute(session, loader, averages)
                            for split, loader in splits.items() if loader is not None}
    session.models.pop(REFERENCE)  # nothing holds the frozen copy any more (an adapters-off view costs nothing)
    session.targets.pop(REFERENCE, None)
    gc.collect()


@torch.no_grad()
def precompute(session: Session, loader: Any,
               averages: list[bool]) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
    """For each kind of sequence log-prob the losses use (token sums, per-token means: ``averages``), (sorted
    dataset rows, ``[rows, 2]`` reference log-probs) for every pair of a map-style loader, in one pass.

    Each data-parallel rank scores its own share of the dataset in order (every rank runs the
    same number of forward passes, as FSDP2 needs), then the shares are gathered, so each rank
    can look up any pair whatever the epoch's shuffle hands it. Keyed by dataset row, the table
    means the same after a resume from any data position.
    """
    from posttune.plugin import BatchLoader, step_context, to_device, world_size

    in_order = BatchLoader(num_items=loader.num_items, get_item=loader.get_item, collate=loader.collate,
                           batch_size=loader.batch_size, shuffle=False, rank=loader.rank,
                           world_size=loader.world_size)
    rows, values = [], []
    model = session.models[REFERENCE]
    for batch in in_order:
        batch = to_device(batch, session.device)
        with step_context(session, batch):  # loss parallel, TP's sequence padding: as in training
            logps = token_logps(session, batch, model=model)
        keep = batch["rows"] >= 0
        rows.append(batch["rows"][keep].cpu())
        ld = session.method_config.ld_alpha
        values.append(torch.cat([torch.stack(pair_logps(logps, batch, average, ld), dim=1)[keep].float().cpu()
                                 for average in averages], dim=1))
    mine = (torch.cat(rows), torch.cat(values))
    if world_size() > 1:
        import torch.distributed as dist

        shares: list[Any] = [None] * world_size()
        dist.all_gather_object(shares, mine)
        mine = (torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares]))
    order = torch.argsort(mine[0])
    keys, table = mine[0][order], mine[1][order]
    unique = torch.ones_like(keys, dtype=torch.bool)  # TP ranks of one data-parallel group score the same rows
    unique[1:] = keys[1:] != keys[:-1]
    return {average: (keys[unique], table[unique][:, 2 * index: 2 * index + 2])
            for index, average in enumerate(averages)}


def lookup(table: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The precomputed (chosen, rejected) log-probs of ``rows`` (0 for a placeholder row -1)."""
    keys, values = table
    wanted = rows.cpu()
    index = torch.searchsorted(keys, wanted.clamp(min=0)).clamp(max=max(len(keys) - 1, 0))
    found = values[index] * (wanted >= 0).unsqueeze(1)
    found = found.to(rows.device)
    return found[:, 0], found[:, 1]


def synced_pairs(session: Session) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, reference tensor, policy tensor) for every weight, each rank's shards; a reference that does not
    hold the policy's weights alike (``models.reference`` of another shape) is refused in one line."""
    from posttune.plugin import paired_shards

    return paired_shards(session.models[REFERENCE], session.model, "method.sync_reference_every")


@torch.no_grad()
def on_step_end(session: Session, record: dict[str, Any]) -> None:
    """TR-DPO's soft update (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment"):
    every ``sync_reference_every`` steps, ``ref <- alpha * policy + (1 - alpha) * ref``, in fp32."""
    every, alpha = session.method_config.sync_reference_every, session.method_config.sync_reference_alpha
    if every is None or session.step % every:
        return
    for _, reference, policy in synced_pairs(session):
        reference.copy_(reference.float().lerp_(policy.float(), alpha))


def state_dict(session: Session) -> dict[str, Any] | None:
    """A synced reference's weights (this rank's shards); None before the first sync (nothing to keep)."""
    every = session.method_config.sync_reference_every
    if every is None or session.step < every:
        return None
    return {"reference": {name: reference.detach().cpu().clone() for name, reference, _ in synced_pairs(session)}}


@torch.no_grad()
def load_state_dict(session: Session, state: dict[str, Any]) -> None:
    saved = state.get("reference")
    if saved is None:
        return
    if session.method_config.sync_reference_every is None:
        raise ConfigError("method.sync_reference_every", "the checkpoint holds a TR-DPO reference synced with the "
                                                         "policy; resume with the run's sync_reference_every")
    for name, reference, _ in synced_pairs(session):
        reference.copy_(saved[name])
