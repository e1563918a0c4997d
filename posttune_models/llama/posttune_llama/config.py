"""config.json <-> build kwargs for the llama and mistral families.

RoPE settings arrive in two spellings: transformers 5 writes ``rope_parameters`` (with
``rope_type`` and ``rope_theta`` inside); older checkpoints write ``rope_theta`` at the top level
and ``rope_scaling`` with ``type`` or ``rope_type``. Both are read. ``to_hf_config`` writes both
too, so transformers 4 and 5 read the same RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttune.plugin import PosttuneError, refuse_unbuildable

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
NATIVE_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def from_hf_config(config: Mapping[str, Any], family: str = "llama") -> dict[str, Any]:
    """Build kwargs for ``posttune_llama.model.build`` from a config.json dict."""
    def need(key: str) -> Any:
        if config.get(key) is None:
            raise PosttuneError(f"config.json: '{key}' is missing (needed by the {family} family)")
        return config[key]

    refuse_unbuildable(config, family, windowed=family == "mistral")
    hidden_size, num_heads = need("hidden_size"), need("num_attention_heads")
    act = config.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise PosttuneError(f"config.json: hidden_act '{act}' is not supported by the {family} family "
                            f"(supported: {', '.join(sorted(HF_ACTIVATIONS))})")
    from posttune.modules.rope import read_rope  # torch is imported only when a config is read

    theta, scaling = read_rope(config, family)
    kwargs = {
        "vocab_size": need("vocab_size"),
        "hidden_size": hidden_size,
        "intermediate_size": need("intermediate_size"),
        "num_layers": need("num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": config.get("num_key_value_heads") or num_heads,
        "head_dim": config.get("head_dim") or hidden_size // num_heads,
        "max_position_embeddings": config.get("max_position_embeddings") or 2048,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "attention_bias": bool(config.get("attention_bias", False)),
        "mlp_bias": bool(config.get("mlp_bias", False)),
        "activation": HF_ACTIVATIONS[act],
    }
    if family == "mistral":
        kwargs["sliding_window"] = config.get("sliding_window")
    return kwargs


def to_hf_config(kwargs: Mapping[str, Any], family: str = "llama") -> dict[str, Any]:
    """A config.json dict that ``transformers`` loads as the same architecture.

    Token ids (bos/eos/pad) are not build kwargs: whoever saves a checkpoint copies them from
    the source config.json or the tokenizer.
    """
    hidden_size, num_heads = kwargs["hidden_size"], kwargs["num_heads"]
    theta, scaling = float(kwargs.get("rope_theta", 10000.0)), kwargs.get("rope_scaling")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": kwargs["vocab_size"],
        "hidden_size": hidden_size,
        "intermediate_size": kwargs["intermediate_size"],
        "num_hidden_layers": kwargs["num_layers"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": kwargs.get("num_kv_heads") or num_heads,
        "head_dim": kwargs.get("head_dim") or hidden_size // num_heads,
        "max_position_embeddings": kwargs.get("max_position_embeddings", 8192),
        "rms_norm_eps": kwargs.get("norm_eps", 1e-5),
        "tie_word_embeddings": bool(kwargs.get("tie_word_embeddings", False)),
        "hidden_act": NATIVE_ACTIVATIONS[kwargs.get("activation", "silu")],
        "rope_theta": theta,
        "rope_scaling": dict(scaling) if scaling else None,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta},
    }
    if family == "llama":
        config["attention_bias"] = bool(kwargs.get("attention_bias", False))
        config["mlp_bias"] = bool(kwargs.get("mlp_bias", False))
    else:
        if kwargs.get("attention_bias") or kwargs.get("mlp_bias"):
            raise PosttuneError("mistral: transformers' MistralForCausalLM has no attention or MLP bias")
        config["sliding_window"] = kwargs.get("sliding_window")
    return config
