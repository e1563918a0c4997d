"""config.json <-> build kwargs for the qwen2 and qwen3 families.

RoPE settings arrive in two spellings: transformers 5 writes ``rope_parameters`` (with
``rope_type`` and ``rope_theta`` inside); older checkpoints (every Qwen2.5 and Qwen3 release)
write ``rope_theta`` at the top level and ``rope_scaling`` with ``type`` or ``rope_type``.
Both are read, and ``to_hf_config`` writes both.

Sliding windows follow transformers 5 exactly: the window exists only when
``use_sliding_window`` is true; each layer's kind comes from ``layer_types`` when the config
lists it, else layers ``>= max_window_layers`` slide. Natively this is ``sliding_window``
(None: no layer slides) plus ``layer_types`` (None: every layer attends fully).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttune.plugin import PosttuneError, refuse_unbuildable

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FULL, SLIDING = "full_attention", "sliding_attention"
#: transformers' Qwen3Config default; Qwen2Config has none and uses hidden_size // heads
DEFAULT_HEAD_DIM = {"qwen3": 128}


def read_sliding(config: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, per-layer kinds) as transformers 5 resolves them; (None, None) when no layer slides."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    kinds = config.get("layer_types")
    if kinds is None:
        first = config.get("max_window_layers")
        first = num_layers if first is None else first
        kinds = [SLIDING if i >= first else FULL for i in range(num_layers)]
    kinds = tuple(kinds)
    if len(kinds) != num_layers or not set(kinds) <= {FULL, SLIDING}:
        raise PosttuneError(f"config.json: layer_types must list '{FULL}' or '{SLIDING}' for each of the "
                            f"{num_layers} layers, got {list(kinds)}")
    if window is None or SLIDING not in kinds:
        return None, None
    if window == 0:  # transformers 5 writes 0 for a disabled window; here use_sliding_window enables it
        raise PosttuneError("config.json: sliding_window: use_sliding_window is true but the window is 0 tokens, "
                            "which hides every position from attention")
    return int(window), kinds


def from_hf_config(config: Mapping[str, Any], family: str = "qwen2") -> dict[str, Any]:
    """Build kwargs for ``posttune_qwen.model.build_<family>`` from a config.json dict."""
    def need(key: str) -> Any:
        if config.get(key) is None:
            raise PosttuneError(f"config.json: '{key}' is missing (needed by the {family} family)")
        return config[key]

    refuse_unbuildable(config, family)
    hidden_size, num_heads, num_layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise PosttuneError(f"config.json: hidden_act '{act}' is not supported by the {family} family "
                            f"(supported: silu)")
    from posttune.modules.rope import read_rope  # torch is imported only when a config is read

    theta, scaling = read_rope(config, family)
    window, kinds = read_sliding(config, num_layers)
    kwargs = {
        "vocab_size": need("vocab_size"),
        "hidden_size": hidden_size,
        "intermediate_size": need("intermediate_size"),
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": config.get("num_key_value_heads") or num_heads,
        "head_dim": config.get("head_dim") or DEFAULT_HEAD_DIM.get(family) or hidden_size // num_heads,
        "max_position_embeddings": config.get("max_position_embeddings") or 32768,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "sliding_window": window,
        "layer_types": kinds,
    }
    if family == "qwen3":
        kwargs["attention_bias"] = bool(config.get("attention_bias", False))
    return kwargs


def _leading_full_layers(kinds: Sequence[str]) -> int:
    """``max_window_layers`` for transformers 4, which knows no ``layer_types``: the full-attention prefix."""
    return next((i for i, kind in enumerate(kinds) if kind == SLIDING), len(kinds))


def to_hf_config(kwargs: Mapping[str, Any], family: str = "qwen2") -> dict[str, Any]:
    """A config.json dict that ``transformers`` loads as the same architecture.

    Token ids (bos/eos/pad) are not build kwargs: whoever saves a checkpoint copies them from
    the source config.json or the tokenizer.
    """
    hidden_size, num_heads, num_layers = kwargs["hidden_size"], kwargs["num_heads"], kwargs["num_layers"]
    theta, scaling = float(kwargs.get("rope_theta", 10000.0)), kwargs.get("rope_scaling")
    window = kwargs.get("sliding_window")
    kinds = list(kwargs.get("layer_types") or [SLIDING] * num_layers) if window else [FULL] * num_layers
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": kwargs["vocab_size"],
        "hidden_size": hidden_size,
        "intermediate_size": kwargs["intermediate_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": kwargs.get("num_kv_heads") or num_heads,
        "head_dim": kwargs.get("head_dim") or hidden_size // num_heads,
        "max_position_embeddings": kwargs.get("max_position_embeddings", 32768),
        "rms_norm_eps": kwargs.get("norm_eps", 1e-6),
        "tie_word_embeddings": bool(kwargs.get("tie_word_embeddings", False)),
        "hidden_act": "silu",
        "rope_theta": theta,
        "rope_scaling": dict(scaling) if scaling else None,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta},
        "use_sliding_window": bool(window),
        "sliding_window": window,
        "max_window_layers": _leading_full_layers(kinds),
        "layer_types": kinds,
    }
    if family == "qwen3":
        config["attention_bias"] = bool(kwargs.get("attention_bias", False))
    return config
