"""Helpers for the memory-technique tests: a tiny Llama, a batch, a fake session (composed runs:
``run_support``)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch

from run_support import compose_run, sft_config  # noqa: F401 - the memory tests compose runs through here



def tiny_llama(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """posttune-llama's ``tiny`` size (2 layers, hidden 64), fp32, randomly initialised from ``seed``."""
    from posttune_llama.model import build
    from posttune_llama.sizes import LLAMA_SIZES

    from posttune.training.compose import random_init

    model = build(**{**LLAMA_SIZES["tiny"], "tie_word_embeddings": False, **overrides})
    random_init(model, seed)
    return model.train()


def batch(vocab: int = 512, rows: int = 2, seq: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids and pre-shifted labels with an ignored prompt of a different length per row."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=generator)
    labels = torch.randint(3, vocab, (rows, seq), generator=generator)
    for row in range(rows):
        labels[row, : 4 + 3 * row] = -100
    return {"input_ids": ids, "labels": labels}


def fake_session(model: torch.nn.Module, **memory_options: Any) -> SimpleNamespace:
    """What a technique's ``apply(session, target)`` reads; ``session.target`` is the policy's target."""
    return SimpleNamespace(model=model, device=torch.device("cpu"), loss_kernel=None, before_final_save=[],
                           plan=SimpleNamespace(memory_options=memory_options),
                           target=SimpleNamespace(model=model, role="policy", trainable=True))


def twin(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
