"""Shared helpers for model tests: a native model carrying an HF model's weights.

Weights are copied in memory through the family's checkpoint converter (the file loader is
tested on its own), so these tests exercise exactly the key map and the architecture.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from torch import nn

import posttune_llama
from posttune.testing.tiny import tiny_hf_model, tiny_llama_config
from posttune.testing.tiny import native_from_hf as shared_native_from_hf

FAMILIES = {"llama": posttune_llama.LLAMA, "mistral": posttune_llama.MISTRAL}
CONVERTERS = {c.family: c for c in posttune_llama.CONVERTERS}


def native_from_hf(hf_model: nn.Module) -> nn.Module:
    """The native llama/mistral model carrying an HF model's weights."""
    family = FAMILIES[hf_model.config.model_type]
    return shared_native_from_hf(hf_model, family, CONVERTERS[family.name])


@pytest.fixture
def to_native() -> Callable[[nn.Module], nn.Module]:
    return native_from_hf


@pytest.fixture(scope="module")
def tiny_llama() -> nn.Module:
    """A native tiny Llama (GQA 4:2, hidden 64, vocab 512) with transformers-initialised weights."""
    return native_from_hf(tiny_hf_model(tiny_llama_config()))
