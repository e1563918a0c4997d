"""config.json <-> build kwargs for the phi3 family.

The fields every Llama-like decoder shares are read by ``posttune.plugin.decoder_kwargs``; here is
what ``Phi3Config`` does its own way:

- ``partial_rotary_factor`` (top level, or inside ``rope_parameters`` in transformers 5): the
  fraction of each head RoPE rotates (Phi-4-mini: 0.75).
- LongRoPE (``rope_type: longrope``; old files spell it ``su``, and transformers reads Phi-3's
  ``yarn`` as LongRoPE too): ``short_factor``/``long_factor`` hold one factor per rotated
  frequency; the switch point is the top-level ``original_max_position_embeddings``, which
  ``Phi3Config`` always has (default 4096) and which wins over a value inside the RoPE dict.
- ``sliding_window`` applies to every layer (Phi-3-mini-4k: 2047); ``rms_norm_eps`` defaults to
  1e-5.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttune.plugin import PosttuneError, decoder_hf_config, decoder_kwargs

ARCHITECTURE = "Phi3ForCausalLM"
#: Phi3Config's defaults where ``decoder_kwargs``' differ
ORIGINAL_MAX_POSITIONS, MAX_POSITIONS, NORM_EPS = 4096, 4096, 1e-5
#: rope types transformers' Phi3Config reads as LongRoPE (older releases' spellings)
LONGROPE_ALIASES = ("su", "yarn")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Build kwargs for ``posttune_phi3.model.build`` from a config.json dict."""
    config = _longrope_spelling(config)
    kwargs = decoder_kwargs(config, "phi3", max_position_embeddings=MAX_POSITIONS, windowed=True, partial_rotary=True)
    act = config.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise PosttuneError(f"config.json: hidden_act '{act}' is not supported by the phi3 family "
                            f"(supported: {', '.join(sorted(ACTIVATIONS))})")
    kwargs.update(norm_eps=config.get("rms_norm_eps") or NORM_EPS, activation=ACTIVATIONS[act],
                  sliding_window=config.get("sliding_window") or None)
    scaling = kwargs["rope_scaling"]
    if scaling is not None and scaling["rope_type"] == "longrope":
        rotated = int(kwargs["head_dim"] * kwargs["partial_rotary_factor"]) // 2
        for name in ("short_factor", "long_factor"):
            if len(scaling[name]) != rotated:
                raise PosttuneError(f"config.json: rope_scaling.{name} must list {rotated} factors (head_dim "
                                    f"{kwargs['head_dim']} x partial_rotary_factor {kwargs['partial_rotary_factor']} "
                                    f"/ 2), got {len(scaling[name])}")
    return kwargs


def _longrope_spelling(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with LongRoPE named ``longrope`` and the switch point Phi3Config uses."""
    config = dict(config)
    config["original_max_position_embeddings"] = (config.get("original_max_position_embeddings")
                                                  or ORIGINAL_MAX_POSITIONS)
    for field in ("rope_parameters", "rope_scaling"):
        rope = config.get(field)
        if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) in LONGROPE_ALIASES:
            config[field] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "longrope"}
    return config


def to_hf_config(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json dict that ``transformers`` loads as the same ``Phi3ForCausalLM``."""
    config = decoder_hf_config(kwargs, ARCHITECTURE, "phi3", max_position_embeddings=MAX_POSITIONS, norm_eps=NORM_EPS)
    partial = float(kwargs.get("partial_rotary_factor", 1.0))
    scaling = kwargs.get("rope_scaling") or {}
    config["rope_parameters"]["partial_rotary_factor"] = partial
    config.update(hidden_act="silu" if kwargs.get("activation", "silu") == "silu" else "gelu_pytorch_tanh",
                  partial_rotary_factor=partial, sliding_window=kwargs.get("sliding_window"),
                  original_max_position_embeddings=scaling.get("original_max_position_embeddings")
                  or min(config["max_position_embeddings"], ORIGINAL_MAX_POSITIONS))
    return config
