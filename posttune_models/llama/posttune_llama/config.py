"""config.json <-> build kwargs for the llama and mistral families.

The fields every Llama-like decoder shares (sizes, both RoPE spellings) are read and written by
``posttune.plugin.decoder_kwargs`` / ``decoder_hf_config``; here is what Llama adds: biases, the
activation, and Mistral's sliding window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttune.plugin import PosttuneError, decoder_hf_config, decoder_kwargs

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
NATIVE_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def from_hf_config(config: Mapping[str, Any], family: str = "llama") -> dict[str, Any]:
    """Build kwargs for ``posttune_llama.model.build`` from a config.json dict."""
    kwargs = decoder_kwargs(config, family, max_position_embeddings=2048, windowed=family == "mistral")
    act = config.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise PosttuneError(f"config.json: hidden_act '{act}' is not supported by the {family} family "
                            f"(supported: {', '.join(sorted(HF_ACTIVATIONS))})")
    kwargs.update(attention_bias=bool(config.get("attention_bias", False)),
                  mlp_bias=bool(config.get("mlp_bias", False)), activation=HF_ACTIVATIONS[act])
    if family == "mistral":
        kwargs["sliding_window"] = config.get("sliding_window")
    return kwargs


def to_hf_config(kwargs: Mapping[str, Any], family: str = "llama") -> dict[str, Any]:
    """A config.json dict that ``transformers`` loads as the same architecture."""
    config = decoder_hf_config(kwargs, ARCHITECTURES[family], family, max_position_embeddings=8192, norm_eps=1e-5)
    config["hidden_act"] = NATIVE_ACTIVATIONS[kwargs.get("activation", "silu")]
    if family == "llama":
        config.update(attention_bias=bool(kwargs.get("attention_bias", False)),
                      mlp_bias=bool(kwargs.get("mlp_bias", False)))
    elif kwargs.get("attention_bias") or kwargs.get("mlp_bias"):
        raise PosttuneError("mistral: transformers' MistralForCausalLM has no attention or MLP bias")
    else:
        config["sliding_window"] = kwargs.get("sliding_window")
    return config
