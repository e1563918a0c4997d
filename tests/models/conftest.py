"""Shared helpers for model tests: a native model carrying an HF model's weights.

Weights are copied in memory through the family's checkpoint converter (the file loader is
tested on its own), so these tests exercise exactly the key map and the architecture.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import posttune_llama
from posttune.modules import init_buffers
from posttune.testing.tiny import tiny_hf_model, tiny_llama_config

FAMILIES = {"llama": posttune_llama.LLAMA, "mistral": posttune_llama.MISTRAL}
CONVERTERS = {c.family: c for c in posttune_llama.CONVERTERS}


def native_from_hf(hf_model: nn.Module) -> nn.Module:
    """Build the native model from the HF config on the meta device, then stream the HF weights in."""
    config = hf_model.config.to_dict()
    family = FAMILIES[config["model_type"]]
    with torch.device("meta"):
        model = family.build(**family.from_hf_config(config))
    model.to_empty(device="cpu")
    init_buffers(model)
    converter = CONVERTERS[family.name]
    state = {}
    for key, tensor in hf_model.state_dict().items():
        mapped = converter.to_native(key, tensor, config)
        if mapped is not None:
            state[mapped[0]] = mapped[1]
    model.load_state_dict(state, strict=True)
    return model.to(hf_model.dtype).eval()


@pytest.fixture
def to_native() -> Callable[[nn.Module], nn.Module]:
    return native_from_hf


@pytest.fixture(scope="module")
def tiny_llama() -> nn.Module:
    """A native tiny Llama (GQA 4:2, hidden 64, vocab 512) with transformers-initialised weights."""
    return native_from_hf(tiny_hf_model(tiny_llama_config()))
