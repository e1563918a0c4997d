"""What every generation engine shares: the settings (``Sampling``), the result (``Completions``), the
settings' ranges, the model's context, and the seeding scheme.

The engines themselves are registered plugins (``posttune.engines``; docs/plugins.md, "Generation
engines"): posttune-generate's ``builtin`` (a KV-cached loop on the training model itself),
posttune-vllm's ``vllm``. What is here is what a method, a command or an engine needs to agree on
whichever engine runs:

- the sampling settings have one set of ranges (``check_sampling``), so ``posttune generate``, GRPO
  and on-policy KD refuse the same values under their own spellings (``SamplingError``);
- a generation never runs past the model's context (``context_length``); a method that generates
  checks its ``max_new_tokens`` against it once, in its setup (``check_new_tokens``);
- each completion has a seed of its own (``derive_seed(run_seed, prompt, sample)``), and
  ``uniform_noise`` turns (row seed, step, token) into the noise of a Gumbel-max draw: a row's
  completion is a function of its prompt and its seed only, not of the batch or the rank that
  generates it (what data-parallel RL needs when a completion may be generated on 1 or N ranks).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch
from torch import nn

from posttune.errors import ConfigError

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (odd: index * _GOLDEN never repeats mod 2**64)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


@dataclass(frozen=True, eq=False)
class Completions:
    """What an engine's ``generate`` returns; T is the longest completion (at most ``max_new_tokens``).

    - ``tokens`` [batch, T] long: each row's generated tokens, ``pad_id`` after its end;
    - ``logprobs`` [batch, T] float32: each token's log-probability under the sampling
      distribution before filtering (what a policy-gradient loss recomputes), 0 after the row's end;
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
    """How a generation engine samples (``GenerationEngine``): every setting but the prompts and the
    seeds, checked on creation against ``check_sampling``'s ranges (a ``SamplingError``).

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


def seed_tensor(seeds: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """Row seeds (Python ints of any size, taken mod 2**64) as the int64 tensor ``uniform_noise`` takes."""
    return torch.tensor([_signed(int(seed) & _MASK64) for seed in seeds], dtype=torch.long, device=device)
