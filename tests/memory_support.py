"""Helpers for the memory-technique tests: a tiny Llama, a fake session, and a composed SFT run."""

from __future__ import annotations

import copy
import json
import random
import string
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import posttune_llama



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
    return SimpleNamespace(model=model, state={}, device=torch.device("cpu"),
                           plan=SimpleNamespace(memory_options=memory_options))


def twin(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reversal_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        word = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(3, 6)))
        rows.append({"messages": [{"role": "user", "content": f"Reverse: {word}"},
                                  {"role": "assistant", "content": word[::-1]}]})
    return rows


def sft_config(tmp_path: Path, *, rows: int = 16, **sections: Any) -> dict:
    """A tiny Llama SFT run config (sections merged over the defaults); the data file is written."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in reversal_rows(rows)))
    config: dict[str, Any] = {
        "model": {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384}},
        "tokenizer": {"path": str(Path(posttune_llama.__file__).parent / "demo" / "tokenizer")},
        "method": {"name": "sft"},
        "data": {"train": {"path": str(train), "format": "chat"}, "max_seq_len": 48},
        "train": {"epochs": 1, "batch_size": 2, "lr": 1e-3, "seed": 0, "device": "cpu"},
        "checkpoint": {"output_dir": str(tmp_path / "out")},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


def compose_run(config: dict) -> Any:
    from posttune.config import validate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry
    from posttune.training.compose import compose

    return compose(resolve_plan(validate(config), get_registry()))
