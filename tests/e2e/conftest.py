"""Fixtures for end-to-end runs: a tiny Llama SFT config over a small dataset written per test."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

import posttune_llama
import posttune_sft

TOKENIZER = "package:posttune_llama/demo/tokenizer"


def reversal_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        word = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(3, 6)))
        rows.append({"messages": [{"role": "user", "content": f"Reverse: {word}"},
                                  {"role": "assistant", "content": word[::-1]}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tiny_config(tmp_path: Path, *, rows: int = 24, **sections) -> dict:
    train = write_jsonl(tmp_path / "train.jsonl", reversal_rows(rows))
    config = {
        "model": {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384}},
        "tokenizer": {"path": TOKENIZER},
        "method": {"name": "sft"},
        "data": {"train": {"path": str(train), "format": "chat"}, "max_seq_len": 48},
        "train": {"epochs": 1, "batch_size": 4, "lr": 1e-3, "seed": 0},
        "checkpoint": {"output_dir": str(tmp_path / "out")},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


@pytest.fixture
def make_config() -> Callable[..., dict]:
    """``make_config(tmp_path, rows=24, **sections)`` -> a tiny SFT config mapping (data written)."""
    return tiny_config


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    """``write_config(**sections)`` -> path of a tiny SFT config (sections merged over the defaults)."""

    def write(name: str = "run.yaml", **sections) -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(tiny_config(tmp_path, **sections)))
        return path

    return write


@pytest.fixture
def llama_sft(register_plugin):
    """posttune-llama and posttune-sft registered in the test's isolated plugin set."""
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")

