"""A toy model family: each token predicts the next through an embedding and one linear map.

torch is imported inside ``build``: the plugin module is imported by every `posttune` command.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def build(vocab_size: int, hidden_size: int) -> Any:
    from torch import nn

    class BigramLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab_size, hidden_size)
            self.proj = nn.Linear(hidden_size, vocab_size, bias=False)

        def forward(self, input_ids: Any, **_: Any) -> Any:
            return self.proj(self.embed(input_ids))

    return BigramLM()


def from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"]}


def to_hf_config(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {"architectures": ["PosttuneBigramForCausalLM"], "model_type": "posttune_bigram", **kwargs}


def same_key(key: str, tensor: Any, config: Mapping[str, Any]) -> tuple[str, Any]:
    """A checkpoint converter direction for a family whose HF names are its native names."""
    return key, tensor
