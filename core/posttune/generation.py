"""Batched autoregressive generation with a KV cache: left-pad, prefill once, one token per step.

    out = generate_batch(model, [[5, 17, 300], [9, 4]], max_new_tokens=64, temperature=0.7,
                         seeds=[11, 12], stop_token_ids=tokenizer.eos_ids)
    out.tokens, out.logprobs, out.mask  # [batch, T] each

Works with any model that follows the native contract (``model(ids, kv_cache=cache)``, plus
``padding_mask=`` when the prompts differ in length; see ``posttune.modules.decoder``). Prompts
are left-padded so that every row's next token is in the last column; the decoder hides the
padding and numbers each row's positions from its first real token, so a row generates what it
would alone (greedy equals transformers' greedy ``generate`` token for token).

Sampling draws no state from a ``torch.Generator``: the noise of row ``r`` at step ``t`` for
token ``v`` is a hash of (row seed, t, v) (``uniform_noise``), and the token is the Gumbel-max
of the filtered, temperature-scaled logits. A row's completion is therefore a function of its
prompt and its own seed only, not of the batch it shares or of the rank that generates it:
what data-parallel RL needs when the same (seed, prompt, sample) may be generated on 1 or N ranks.

Under ``torch.distributed`` every rank runs the same number of forward passes (sharded models,
FSDP2 or TP, run collectives inside forward): after each step the ranks agree whether any row
anywhere is unfinished, and a rank whose rows are done keeps stepping with pad tokens.

The sampling settings have one set of ranges (``check_sampling``), enforced here for every
caller (``posttune generate``, GRPO, on-policy KD), and a generation never runs past the
model's context (``context_length``): the KV cache is sized by what fits, not by what was asked. A method
that generates checks its ``max_new_tokens`` against that context once, in its setup (``check_new_tokens``).

``BuiltinEngine`` is this loop as the generation engine ``builtin`` (registered in
``posttune.engines``), and ``Sampling`` the settings any engine's ``generate`` takes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttune.errors import ConfigError
from posttune.modules.decoder import forward_takes
from posttune.modules.kv_cache import KVCache

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (odd: index * _GOLDEN never repeats mod 2**64)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


@dataclass(frozen=True, eq=False)
class Completions:
    """What ``generate_batch`` returns; T is the longest completion (at most ``max_new_tokens``).

    - ``tokens`` [batch, T] long: each row's generated tokens, ``pad_id`` after its end;
    - ``logprobs`` [batch, T] float32: each token's log-probability under the sampling
      distribution before filtering (see ``generate_batch``), 0 after the row's end;
    - ``mask`` [batch, T] bool: True for each generated token, the stop token included.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor

    def token_lists(self) -> list[list[int]]:
        """Each row's generated token ids (the stop token included), as Python lists."""
        return [row[keep].tolist() for row, keep in zip(self.tokens.cpu(), self.mask.cpu(), strict=True)]


@dataclass(frozen=True)
class Sampling:
    """How a generation engine samples (``GenerationEngine``): ``generate_batch``'s settings but the
    prompts and seeds, checked on creation against ``check_sampling``'s ranges (a ``SamplingError``).

    ``temperature`` 0 is greedy; ``stop_token_ids`` end a row (the stop token kept); ``pad_id`` fills
    a row's tokens after its end.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, Integral) or \
                self.max_new_tokens < 0:
            raise SamplingError("max_new_tokens", "an integer >= 0", self.max_new_tokens)
        check_sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


class BuiltinEngine:
    """The core's generation engine, ``builtin``: ``generate_batch`` on the policy, registered like a plugin's.

    Started on the live policy (``EnginePolicy.model``) it generates with the very module that
    trains, sharded or not, so its weights are always current: ``update_weights(None, version)``
    only records the version. Started without one (in a Ray actor) it builds the architecture from
    the family and build kwargs (on ``policy.device``, else CPU) and loads each state dict it is given.
    """

    def __init__(self, policy: Any):
        model = policy.model
        if model is None:
            from posttune.api import build_model

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
                from posttune.errors import PosttuneError

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


class SamplingError(ValueError):
    """A generation setting outside its range: ``name`` is the argument (``top_p``) and ``allowed``
    its range in words, so a command or a config can report it under its own spelling."""

    def __init__(self, name: str, allowed: str, value: Any):
        self.name, self.allowed, self.value = name, allowed, value
        super().__init__(f"{name} must be {allowed}, got {value}")


def check_sampling(*, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                   min_p: float | None = None) -> None:
    """Raise ``SamplingError`` for a setting out of range; None turns a filter off, as do top_p 1 and min_p 0.

    A negative or NaN temperature is refused rather than read as greedy: it is a typo, not a choice.
    """
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise SamplingError("temperature", "a finite number >= 0", temperature)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 1):
        raise SamplingError("top_k", "an integer >= 1", top_k)
    if top_p is not None and not (_is_number(top_p) and 0.0 < top_p <= 1.0):
        raise SamplingError("top_p", "in (0, 1]", top_p)
    if min_p is not None and not (_is_number(min_p) and 0.0 <= min_p <= 1.0):
        raise SamplingError("min_p", "in [0, 1]", min_p)


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def context_length(model: nn.Module) -> int | None:
    """The most positions ``model`` handles (its ``max_position_embeddings``), None when unknown.

    Read from the modules that hold the attribute (the rotary embedding of the native families),
    so PEFT, FSDP2 and ``torch.compile`` wrappers are seen through; with several, the smallest.
    RoPE scaling that extends the context counts, as vLLM counts it: yarn reaches
    ``original_max_position_embeddings x factor``, dynamic NTK ``max_position_embeddings x factor``.
    """
    sizes = [size for module in model.modules() if (size := _positions_of(module)) is not None]
    return min(sizes) if sizes else None


def check_new_tokens(model: nn.Module, max_new_tokens: int, field: str, prompt_len: int | None,
                     prompt_field: str = "data.max_prompt_len") -> None:
    """A method's ``max_new_tokens`` (the config's ``field``) against ``model``'s context: generation stops there,
    so completions past it would be cut, silently. None fits: refused; the longest prompt, ``prompt_len`` tokens
    (what the config bounds it by, ``prompt_field``; None: unbounded), would not leave room for them all: a warning."""
    context = context_length(model)
    if context is None:
        return
    if max_new_tokens >= context:
        raise ConfigError(field, f"{max_new_tokens} leaves no room for a prompt in the model's context of {context} "
                                 "tokens (max_position_embeddings)")
    if prompt_len is not None and prompt_len + max_new_tokens > context:
        print(f"posttune: warning: {field}: a prompt of {prompt_len} tokens ({prompt_field}) leaves "
              f"{max(context - prompt_len, 0)} of the {max_new_tokens} new tokens in the model's context of "
              f"{context}: longer completions are cut there", file=sys.stderr)


def _positions_of(module: nn.Module) -> int | None:
    size = getattr(module, "max_position_embeddings", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return None
    scaling = getattr(module, "scaling", None)
    scaling = scaling if isinstance(scaling, Mapping) else {}
    kind, factor = getattr(module, "rope_type", None), scaling.get("factor") or 1.0
    if kind == "yarn":
        return max(size, int((scaling.get("original_max_position_embeddings") or size) * factor))
    if kind == "dynamic":
        return int(size * factor)
    return size


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


# ---- counter-based noise ----------------------------------------------------------------------

def derive_seed(seed: int, *keys: int) -> int:
    """A well-mixed int64 seed from ``seed`` and integer ``keys`` (row i of a run: ``derive_seed(seed, i)``).

    Use it to give each completion a seed of its own, e.g. ``derive_seed(run_seed, prompt_id,
    sample_index)``, so the same completion is sampled whichever rank or batch generates it.
    """
    state = _mix_int(seed & _MASK64)
    for key in keys:
        state = _mix_int((state + (key & _MASK64) * _GOLDEN) & _MASK64)
    return _signed(state)


def uniform_noise(row_seeds: torch.Tensor, step: int, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1), float64 [rows, vocab_size]: a hash of (row seed, step, token).

    A splitmix64 stream: row r at step t starts from ``mix(mix(seed_r) + (t+1) * golden)`` and
    token v takes ``mix(start + (v+1) * golden)``; ``mix`` is a bijection of 64-bit integers, so
    the values of one row and step never repeat. Computed with int64 torch ops (multiplication
    wraps; ``>>`` is arithmetic on int64, hence the masked logical shift), on the seeds' device.
    The top 53 bits become ``(k + 0.5) / 2**53``: never 0 or 1, so ``-log(-log(u))`` is finite.
    """
    start = _mix(_mix(row_seeds.long().clone()) + _signed((step + 1) * _GOLDEN % (1 << 64)))
    index = torch.arange(1, vocab_size + 1, dtype=torch.long, device=row_seeds.device)
    bits = _mix(start[:, None] + index * _signed(_GOLDEN))
    bits >>= 11
    bits &= (1 << 53) - 1  # the top 53 bits (torch's >> on int64 copies the sign bit)
    return bits.double().add_(0.5).mul_(2.0**-53)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on an int64 tensor (wrapping arithmetic); returns ``z``.

    In place because it runs over [rows, vocab] every sampling step: allocations dominate it.
    """
    scratch = torch.empty_like(z)
    z ^= _shift_right(z, 30, out=scratch)
    z *= _signed(_MIX1)
    z ^= _shift_right(z, 27, out=scratch)
    z *= _signed(_MIX2)
    z ^= _shift_right(z, 31, out=scratch)
    return z


def _mix_int(z: int) -> int:
    """``_mix`` on a Python int in [0, 2**64)."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _shift_right(z: torch.Tensor, bits: int, *, out: torch.Tensor) -> torch.Tensor:
    """Logical right shift of int64 values into ``out`` (torch's ``>>`` keeps the sign bit)."""
    torch.bitwise_right_shift(z, bits, out=out)
    return out.bitwise_and_((1 << (64 - bits)) - 1)


def _signed(value: int) -> int:
    """A value in [0, 2**64) as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


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
    return torch.tensor([_signed(int(s) & _MASK64) for s in seeds], dtype=torch.long, device=device)


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
