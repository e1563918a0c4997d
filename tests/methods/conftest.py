"""Fixtures for method tests (the helpers live in tests/method_support.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from run_support import dpo_config

import posttune_dpo
import posttune_llama
import posttune_generate
import posttune_lora
import posttune_memory
import posttune_sft


@pytest.fixture
def llama_dpo(register_plugin):
    """posttune-llama, posttune-sft, posttune-dpo and posttune-memory registered in the test's isolated plugin set."""
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_dpo, distribution="posttune-dpo", version="0.1.0")
    register_plugin(posttune_memory, distribution="posttune-memory", version="0.1.0")


@pytest.fixture
def llama_sft(register_plugin):
    """posttune-llama and posttune-sft registered in the test's isolated plugin set."""
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


@pytest.fixture
def make_dpo_config() -> Callable[..., dict]:
    return dpo_config
