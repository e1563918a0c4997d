"""config.json <-> build kwargs for the gemma, gemma2 and gemma3 families.

Spellings read (transformers 5 and older files alike):

- RoPE: transformers 5 writes ``rope_parameters`` with ``rope_theta`` inside; older files write
  ``rope_theta`` and ``rope_scaling``. Gemma 3 keys its ``rope_parameters`` by layer type
  (``full_attention`` / ``sliding_attention``); its older files write the global base as
  ``rope_theta`` (with ``rope_scaling`` for it alone) and the local one as ``rope_local_base_freq``.
- Local/global layers: ``layer_types`` (transformers >= 4.53); without it Gemma 2 alternates
  (even layers local) and Gemma 3 repeats ``sliding_window_pattern`` (default 6: five local,
  then one global).
- Activation: Gemma 1 writes ``hidden_act`` (its legacy "gelu" means the tanh approximation,
  as transformers reads it), Gemma 2/3 write ``hidden_activation``.

``to_hf_config`` writes both spellings, so transformers 4 and 5 read the same model.
Gemma 3's ``attn_logit_softcapping`` is read as transformers' Gemma3ForCausalLM uses it, i.e.
not at all (no released Gemma 3 sets it); Gemma 2 applies both caps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttune.plugin import PosttuneError, decoder_hf_config, decoder_kwargs

ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPES = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text"}
SLIDING, FULL = "sliding_attention", "full_attention"
#: RoPE bases transformers assumes when a Gemma 3 config.json names none
GEMMA3_THETA = {"global": 1_000_000.0, "local": 10_000.0}
HF_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
NATIVE_ACTIVATIONS = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def from_hf_config(config: Mapping[str, Any], family: str = "gemma") -> dict[str, Any]:
    """Build kwargs for ``posttune_gemma.model.build`` from a config.json dict."""
    if config.get("use_bidirectional_attention"):
        raise PosttuneError(f"config.json: use_bidirectional_attention is not supported by the {family} family "
                            f"(posttune trains causal language models)")
    kwargs = decoder_kwargs(config, family, max_position_embeddings=8192, tie_word_embeddings=True,
                            windowed=family != "gemma")
    kwargs.update(attention_bias=bool(config.get("attention_bias", False)), activation=_activation(config, family))
    if family == "gemma":
        return kwargs
    return {
        **kwargs,
        **(_gemma3_rope(config) if family == "gemma3" else {}),
        "query_pre_attn_scalar": config.get("query_pre_attn_scalar") or 256,
        "post_norms": True,
        "qk_norm": family == "gemma3",
        "layer_types": _layer_types(config, family, kwargs["num_layers"]),
        "sliding_window": config.get("sliding_window"),
        "attn_softcap": config.get("attn_logit_softcapping") if family == "gemma2" else None,
        "final_softcap": config.get("final_logit_softcapping"),
    }


def _activation(config: Mapping[str, Any], family: str) -> str:
    name = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if family == "gemma" and name == "gelu":  # Gemma 1's legacy spelling of the tanh approximation
        return "gelu_tanh"
    if name not in HF_ACTIVATIONS:
        raise PosttuneError(f"config.json: hidden_activation '{name}' is not supported by the {family} family "
                            f"(supported: {', '.join(sorted(HF_ACTIVATIONS))})")
    return HF_ACTIVATIONS[name]


def _gemma3_rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's global and local RoPE (its own defaults: a base of 1M globally, 10k locally)."""
    from posttune.modules import split_rope_parameters  # torch is imported only when a config is read

    params = config.get("rope_parameters") or None
    if params is not None and (FULL in params or SLIDING in params):  # transformers 5: one dict per layer type
        theta, scaling = split_rope_parameters(params.get(FULL), default_theta=GEMMA3_THETA["global"])
        local_theta, local_scaling = split_rope_parameters(params.get(SLIDING), default_theta=GEMMA3_THETA["local"])
    else:
        theta, scaling = split_rope_parameters(params or config.get("rope_scaling"), theta=config.get("rope_theta"),
                                               default_theta=GEMMA3_THETA["global"])
        local_theta, local_scaling = float(config.get("rope_local_base_freq") or GEMMA3_THETA["local"]), None
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local_theta,
            "local_rope_scaling": local_scaling}


def _layer_types(config: Mapping[str, Any], family: str, num_layers: int) -> tuple[str, ...]:
    types = config.get("layer_types")
    if types is None:
        every = 2 if family == "gemma2" else int(config.get("sliding_window_pattern") or 6)
        types = [SLIDING if (index + 1) % every else FULL for index in range(num_layers)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown or len(types) != num_layers:
        raise PosttuneError(f"config.json: layer_types must list {num_layers} entries of '{SLIDING}' or '{FULL}' "
                            f"(got {len(types)}{', unknown ' + repr(unknown[0]) if unknown else ''})")
    return tuple(types)


def to_hf_config(kwargs: Mapping[str, Any], family: str = "gemma") -> dict[str, Any]:
    """A config.json dict that ``transformers`` loads as the same architecture."""
    activation = kwargs.get("activation", "gelu_tanh")
    if family == "gemma" and activation != "gelu_tanh":
        raise PosttuneError("gemma: transformers' GemmaForCausalLM always uses the tanh approximation of GELU")
    config = decoder_hf_config(kwargs, ARCHITECTURES[family], MODEL_TYPES[family], max_position_embeddings=8192,
                               norm_eps=1e-6, tie_word_embeddings=True, head_dim=256)
    config["attention_bias"] = bool(kwargs.get("attention_bias", False))
    config["hidden_act" if family == "gemma" else "hidden_activation"] = NATIVE_ACTIVATIONS[activation]
    if family == "gemma":
        return config
    if family == "gemma3" and kwargs.get("attn_softcap") is not None:
        raise PosttuneError("gemma3: transformers' Gemma3ForCausalLM does not apply attention soft-capping")
    layer_types = list(kwargs.get("layer_types") or [FULL] * kwargs["num_layers"])
    config.update({
        "query_pre_attn_scalar": kwargs.get("query_pre_attn_scalar") or 256,
        "sliding_window": kwargs.get("sliding_window"),
        "layer_types": layer_types,
        "attn_logit_softcapping": kwargs.get("attn_softcap"),
        "final_logit_softcapping": kwargs.get("final_softcap"),
    })
    if family == "gemma3":
        local_theta = float(kwargs.get("local_rope_theta") or GEMMA3_THETA["local"])
        local = {"rope_type": "default", **(kwargs.get("local_rope_scaling") or {}), "rope_theta": local_theta}
        config.update(rope_local_base_freq=local_theta,
                      rope_parameters={FULL: config["rope_parameters"], SLIDING: local})
        if (every := _period(layer_types)) is not None:
            config["sliding_window_pattern"] = every  # what transformers < 4.53 reads instead of layer_types
    return config


def _period(layer_types: list[str]) -> int | None:
    """n when the layers repeat (n-1 local, then one global), else None."""
    if FULL not in layer_types:
        return None
    every = layer_types.index(FULL) + 1
    expected = [SLIDING if (index + 1) % every else FULL for index in range(len(layer_types))]
    return every if expected == layer_types else None
