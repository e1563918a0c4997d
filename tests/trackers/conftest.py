"""Fixtures for tracker tests: posttune-llama and posttune-sft registered in the test's isolated
plugin set (the tracker plugin beside them), and `posttune train` run in this process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_sft
import pytest
import yaml


@pytest.fixture
def llama_sft(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


@pytest.fixture
def train(llama_sft, posttune_cli) -> Callable[..., Path]:
    """``train(config_path, *overrides)`` runs `posttune train` here and returns the output directory."""

    def run(path: Path, *overrides: str) -> Path:
        result = posttune_cli("train", str(path), *overrides)
        assert result.exit_code == 0, result.stderr[-3000:]
        return Path(yaml.safe_load(path.read_text())["checkpoint"]["output_dir"])

    return run
