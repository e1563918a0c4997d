"""Autoregressive generation with a KV cache: one prefill forward, then one token per step.

Works with any model that follows the native contract (``model(ids, kv_cache=cache)``).
Greedy by default; with ``temperature > 0`` it samples (optionally top-k / top-p filtered)
from a ``torch.Generator`` seeded by ``seed``, so a seeded run repeats exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from posttune.modules.kv_cache import KVCache


@torch.inference_mode()
def generate(model: nn.Module, input_ids: list[int] | torch.Tensor, *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_token_ids: Iterable[int] = ()) -> list[int]:
    """The new tokens for one prompt (the first end-of-sequence token included, if produced)."""
    device = _device_of(model)
    prompt = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
    if prompt.shape[1] == 0:
        raise ValueError("generate needs a non-empty prompt")
    stop = set(eos_token_ids)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    cache = KVCache(prompt.shape[1] + max_new_tokens)
    next_input, new_tokens = prompt, []
    for _ in range(max_new_tokens):
        logits = model(next_input, kv_cache=cache)[:, -1]
        token = next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        new_tokens.append(int(token))
        if new_tokens[-1] in stop:
            break
        next_input = token.reshape(1, 1)
    return new_tokens


def next_token(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token id from ``logits`` [batch, vocab]; returns [batch]."""
    logits = logits.float()
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        logits = _top_p_filter(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # mass before this token already enough
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _device_of(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
