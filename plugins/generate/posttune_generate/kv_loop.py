"""Batched autoregressive generation with a KV cache: left-pad, prefill once, one token per step.

    out = generate_batch(model, [[5, 17, 300], [9, 4]], max_new_tokens=64, temperature=0.7,
                         seeds=[11, 12], stop_token_ids=tokenizer.eos_ids)
    out.tokens, out.logprobs, out.mask  # [batch, T] each

Works with any model that follows the native contract (``model(ids, kv_cache=cache)``, plus
``padding_mask=`` when the prompts differ in length; see ``posttune.modules``' decoder). Prompts
are left-padded so that every row's next token is in the last column; the decoder hides the
padding and numbers each row's positions from its first real token, so a row generates what it
would alone (greedy equals transformers' greedy ``generate`` token for token).

Sampling draws no state from a ``torch.Generator``: the noise of row ``r`` at step ``t`` for
token ``v`` is ``posttune.plugin.uniform_noise`` of (row seed, t, v), and the token is the
Gumbel-max of the filtered, temperature-scaled logits. A row's completion is therefore a function
of its prompt and its own seed only, not of the batch it shares or of the rank that generates it.

Under ``torch.distributed`` every rank runs the same number of forward passes (sharded models,
FSDP2 or TP, run collectives inside forward): after each step the ranks agree whether any row
anywhere is unfinished, and a rank whose rows are done keeps stepping with pad tokens.

The sampling ranges are the core's (``check_sampling``), and a generation never runs past the
model's context (``context_length``): the KV cache is sized by what fits, not by what was asked.
``BuiltinEngine`` is this loop as the generation engine ``builtin``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttune.modules import KVCache, forward_takes
from posttune.plugin import (Completions, PosttuneError, Sampling, build_model, check_sampling, context_length,
                             derive_seed, seed_tensor, uniform_noise)


class BuiltinEngine:
    """The generation engine ``builtin``: ``generate_batch`` on the policy.

    Started on the live policy (``EnginePolicy.model``) it generates with the very module that
    trains, sharded or not, so its weights are always current: ``update_weights(None, version)``
    only records the version. Started without one (in a Ray actor) it builds the architecture from
    the family and build kwargs (on ``policy.device``, else CPU) and loads each state dict it is given.
    """

    def __init__(self, policy: Any):
        model = policy.model
        if model is None:
            model = build_model(policy.family, **policy.build_kwargs).eval()
            model = model if policy.device is None else model.to(policy.device)
        self.model: nn.Module | None = model
        self.version: int = policy.version

    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor], sampling: Sampling,
                 seeds: Sequence[int] | None = None) -> Completions:
        return generate_batch(self.model, prompts, max_new_tokens=sampling.max_new_tokens,
                              temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                              min_p=sampling.min_p, seeds=seeds, stop_token_ids=sampling.stop_token_ids,
                              pad_id=sampling.pad_id)

    def update_weights(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> None:
        if weights is not None:
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
            missing = [key for key in missing if not key.endswith("inv_freq")]  # buffers computed, not loaded
            if missing or unexpected:
                raise PosttuneError(f"generation engine 'builtin': the weights do not fit its model (missing "
                                    f"{missing[:3]}, unexpected {unexpected[:3]})")
        self.version = version

    def close(self) -> None:
        self.model = None


@torch.no_grad()  # not inference_mode: FSDP2's forward hooks may not accept inference tensors
def generate_batch(model: nn.Module, prompts: Sequence[Sequence[int] | torch.Tensor], *, max_new_tokens: int,
                   temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                   min_p: float | None = None, seed: int | None = None, seeds: Sequence[int] | None = None,
                   stop_token_ids: Iterable[int] = (), pad_id: int = 0) -> Completions:
    """Complete every prompt (token-id lists of any lengths) in one KV-cached batch.

    Greedy when ``temperature`` is 0. Otherwise each row samples from ``softmax(logits /
    temperature)`` restricted by ``top_k``, ``top_p`` and ``min_p`` (keep tokens with
    ``p >= min_p * max p``), with noise from its own seed: ``seeds[i]`` for row ``i``, or
    ``derive_seed(seed, i)`` from a run seed (then row i's completion depends on its index;
    pass ``seeds`` to make it depend on the row alone). Without either, the run seed is drawn
    from torch's global generator, so ``torch.manual_seed`` still makes a run repeat.

    A row stops after its first token in ``stop_token_ids``, which is kept (mask True). Rows with
    the same prompt (an RL method's group of completions) share one prefill: the KV cache of its
    first row is copied.

    Each row's ``max_new_tokens`` is capped so that its prompt plus its completion fits the model's
    context (``context_length``; no cap when it is unknown): positions past it are untrained. The cap
    is the row's own, so a row's completion does not depend on the other prompts of the call or of
    other ranks. A prompt longer than the context is a ValueError, as is a sampling setting out of
    its range (``check_sampling``).

    ``logprobs`` are ``log_softmax(logits / temperature)`` (``log_softmax(logits)`` when greedy)
    at the chosen tokens, before top-k/top-p/min-p: the filters are a sampling device, and a
    policy-gradient loss recomputes exactly this quantity from a plain forward pass (TRL and
    verl record the same), so old and new log-probabilities are comparable.

    Under torch.distributed this is a collective: call it on every rank, with the same
    ``max_new_tokens`` and at least one prompt per rank.
    """
    rows = [_token_list(prompt) for prompt in prompts]
    _check_arguments(rows, max_new_tokens, seed, seeds)
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    device = _device_of(model)
    max_new_tokens, caps = _fit_to_context(model, rows, max_new_tokens, device)
    sampling = temperature > 0.0
    row_seeds = _row_seeds(len(rows), seed, seeds, device) if sampling else None
    input_ids, padding = _left_pad(rows, pad_id, device)
    stop = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    cache = KVCache(input_ids.shape[1] + max_new_tokens)
    finished = torch.zeros(len(rows), dtype=torch.bool, device=device) if caps is None else caps <= 0
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    alive: list[torch.Tensor] = []
    step_input = input_ids
    last_only = {"logits_to_keep": 1} if forward_takes(model, "logits_to_keep") else {}
    shared = _distinct_prompts(rows, device)
    switch = getattr(getattr(model, "rope", None), "switch_length", None)
    switched = switch is None or _longest(padding, input_ids.shape[1]) > switch
    for step in range(max_new_tokens):
        if not switched and _longest(padding, cache.length + 1) > switch:
            # LongRoPE: a forward past the switch point rotates every position with the long factors, so
            # the keys cached with the short ones are recomputed once (as transformers' Phi-3 does)
            cache.reset()
            switched = True
            step_input = torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)
        extra = {} if padding is None else {"padding_mask": padding}
        if step == 0 and shared is not None:  # each distinct prompt once, its cache rows then copied
            firsts, copies = shared
            extra = {} if padding is None else {"padding_mask": padding[firsts]}
            logits = model(step_input[firsts], kv_cache=cache, **extra, **last_only)[:, -1].float()[copies]
            cache.select_rows(copies)
        else:
            logits = model(step_input, kv_cache=cache, **extra, **last_only)[:, -1].float()
        token, logprob = _choose(logits, step, temperature, top_k, top_p, min_p, row_seeds)
        alive.append(~finished)
        tokens.append(token.masked_fill(finished, pad_id))
        logprobs.append(logprob.masked_fill(finished, 0.0))
        finished = finished | torch.isin(tokens[-1], stop)
        if caps is not None:  # a row whose prompt and completion fill the context stops there, alone
            finished = finished | (caps <= step + 1)
        if step + 1 == max_new_tokens or not _any_unfinished(finished):
            break
        step_input = tokens[-1][:, None]
        if padding is not None:  # a finished row's pad inputs count as real: its outputs are ignored anyway
            padding = torch.cat([padding, padding.new_ones(len(rows), 1)], dim=1)
    return _completions(tokens, logprobs, alive, len(rows), device)


def _longest(padding: torch.Tensor | None, length: int) -> int:
    """The longest row's token count: ``length`` without padding, else the most real tokens in a row."""
    return length if padding is None else int(padding.sum(dim=1).max())


def generate(model: nn.Module, input_ids: list[int] | torch.Tensor, *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_token_ids: Iterable[int] = ()) -> list[int]:
    """The new tokens for one prompt (the first end-of-sequence token included, if produced).

    ``generate_batch`` with a batch of one, so both share one code path (and one seed scheme).
    """
    ids = _token_list(input_ids)
    if not ids:
        raise ValueError("generate needs a non-empty prompt")
    out = generate_batch(model, [ids], max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                         top_p=top_p, seed=seed, stop_token_ids=eos_token_ids)
    return out.token_lists()[0]


def filter_logits(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None) -> torch.Tensor:
    """``logits`` [batch, vocab] with the tokens top-k, then top-p, then min-p drop set to -inf
    (transformers' order); the most likely token always survives."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        logits = _top_p_filter(logits, top_p)
    if min_p is not None and min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p  # the mass before this token is already enough
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


# ---- the steps --------------------------------------------------------------------------------

def _choose(logits: torch.Tensor, step: int, temperature: float, top_k: int | None, top_p: float | None,
            min_p: float | None, row_seeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [batch], its log-probability before filtering [batch]) from float32 logits [batch, vocab]."""
    if temperature == 0.0 or row_seeds is None:
        token = logits.argmax(dim=-1)
        return token, logits.log_softmax(dim=-1).gather(-1, token[:, None]).squeeze(-1)
    scaled = _scaled(logits, temperature)
    filtered = filter_logits(scaled, top_k=top_k, top_p=top_p, min_p=min_p)
    gumbel = uniform_noise(row_seeds, step, logits.shape[-1]).log_().neg_().log_().neg_()  # -log(-log(u))
    token = (filtered + gumbel.float()).argmax(dim=-1)  # Gumbel-max: a draw from softmax(filtered)
    return token, scaled.log_softmax(dim=-1).gather(-1, token[:, None]).squeeze(-1)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``; where a tiny temperature overflows a row (its largest value no
    longer finite), that row is shifted by its maximum first: the same distribution (softmax and
    the filters ignore a shift), the top token at 0, overflowed ones at -inf (the greedy limit).
    Rows that do not overflow keep their values exactly."""
    scaled = logits / temperature
    top = logits.amax(dim=-1, keepdim=True)
    overflowed = ~torch.isfinite(scaled.amax(dim=-1, keepdim=True))
    return torch.where(overflowed & torch.isfinite(top), (logits - top) / temperature, scaled)


def _fit_to_context(model: nn.Module, rows: list[list[int]], max_new_tokens: int,
                    device: torch.device) -> tuple[int, torch.Tensor | None]:
    """(steps to run, each row's own cap or None): a row's ``max_new_tokens`` capped so its prompt and its
    completion fit the model's context; the steps, the most any row may take.

    Under torch.distributed the ranks agree on the steps (every rank must run as many forwards), and a
    prompt too long on any rank is an error on every rank, not a hang on the others.
    """
    context = context_length(model)
    if context is None:
        return max_new_tokens, None
    caps = (context - torch.tensor([len(row) for row in rows], device=device)).clamp(max=max_new_tokens)
    low, high = int(caps.min()), int(caps.max())  # low is negative when a prompt is longer than the context
    if dist.is_available() and dist.is_initialized():
        agreed = torch.tensor([low, -high], dtype=torch.long, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        low, high = int(agreed[0]), -int(agreed[1])
    if low < 0:
        longest = max(len(row) for row in rows)
        where = f"{longest} tokens" if longest > context else "on another rank"
        raise ValueError(f"a prompt is longer than the model's context of {context} tokens "
                         f"(max_position_embeddings): {where}")
    return high, caps


def _any_unfinished(finished: torch.Tensor) -> bool:
    """Whether any row on any rank still generates; one all-reduce per step under torch.distributed."""
    flag = (~finished).any().to(torch.int32).reshape(1)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _completions(tokens: list[torch.Tensor], logprobs: list[torch.Tensor], alive: list[torch.Tensor],
                 batch: int, device: torch.device) -> Completions:
    """Stack the steps and cut them to the longest local completion (other ranks may have run longer)."""
    if not tokens:
        empty = torch.zeros(batch, 0, device=device)
        return Completions(empty.long(), empty, empty.bool())
    mask = torch.stack(alive, dim=1)
    length = int(mask.sum(dim=1).max())
    return Completions(torch.stack(tokens, dim=1)[:, :length], torch.stack(logprobs, dim=1)[:, :length],
                       mask[:, :length])


def _distinct_prompts(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the first row of each distinct prompt, each row's index among those firsts), or None when no prompt
    repeats. Group-based RL asks for several completions of each prompt: the prefill, most of a short
    completion's work, then runs once per prompt and the KV cache's rows are copied to the group."""
    index: dict[tuple[int, ...], int] = {}
    copies = [index.setdefault(tuple(row), len(index)) for row in rows]
    if len(index) == len(rows):
        return None
    firsts = [0] * len(index)
    for row in reversed(range(len(rows))):
        firsts[copies[row]] = row
    return torch.tensor(firsts, device=device), torch.tensor(copies, device=device)


def _left_pad(rows: list[list[int]], pad_id: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids [batch, longest] left-padded, and the padding mask (None when no row is padded)."""
    longest = max(len(row) for row in rows)
    ids = torch.tensor([[pad_id] * (longest - len(row)) + row for row in rows], dtype=torch.long, device=device)
    if all(len(row) == longest for row in rows):
        return ids, None
    real = torch.tensor([[False] * (longest - len(row)) + [True] * len(row) for row in rows], device=device)
    return ids, real


def _row_seeds(batch: int, seed: int | None, seeds: Sequence[int] | None, device: torch.device) -> torch.Tensor:
    if seeds is None:
        if seed is None:  # unseeded: follow torch's global generator, as torch.multinomial would
            seed = int(torch.randint(0, 2**62, (1,)).item())
        seeds = [derive_seed(seed, row) for row in range(batch)]
    return seed_tensor(seeds, device)


def _check_arguments(rows: list[list[int]], max_new_tokens: int, seed: int | None,
                     seeds: Sequence[int] | None) -> None:
    if not rows:
        raise ValueError("generate_batch needs at least one prompt (a rank's share of an epoch's last batch of "
                         "prompts may be empty: generate for a placeholder prompt of weight 0 there, so that every "
                         "rank runs the same forward passes; docs/plugins.md, \"Generation engines\")")
    if any(not row for row in rows):
        raise ValueError("generate_batch needs non-empty prompts")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if seed is not None and seeds is not None:
        raise ValueError("give seed (a run seed) or seeds (one per prompt), not both")
    if seeds is not None and len(seeds) != len(rows):
        raise ValueError(f"seeds has {len(seeds)} values for {len(rows)} prompts")


def _token_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    """A prompt as a flat list of ints (a list, a [n] or [1, n] tensor); a batch of several is refused, not
    read as one prompt end to end."""
    tensor = torch.as_tensor(ids, dtype=torch.long)
    if tensor.dim() > 2 or (tensor.dim() == 2 and tensor.shape[0] != 1):
        raise ValueError(f"a prompt is a list of token ids or a [n] or [1, n] tensor, got shape {list(tensor.shape)} "
                         "(generate_batch takes several prompts)")
    return tensor.reshape(-1).tolist()




def _device_of(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
