"""config.json <-> build kwargs for the qwen2 and qwen3 families.

The fields every Llama-like decoder shares (sizes, both RoPE spellings: every Qwen2.5 and Qwen3
release writes the older one) are read and written by ``posttune.plugin.decoder_kwargs`` /
``decoder_hf_config``; here is what Qwen adds.

Sliding windows follow transformers 5 exactly: the window exists only when
``use_sliding_window`` is true; each layer's kind comes from ``layer_types`` when the config
lists it, else layers ``>= max_window_layers`` slide. Natively this is ``sliding_window``
(None: no layer slides) plus ``layer_types`` (None: every layer attends fully).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttune.plugin import PosttuneError, decoder_hf_config, decoder_kwargs

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
FULL, SLIDING = "full_attention", "sliding_attention"
#: transformers' Qwen3Config default; Qwen2Config and Qwen3MoeConfig have none: their attention takes
#: hidden_size // heads when config.json names no head_dim
DEFAULT_HEAD_DIM = {"qwen3": 128}
#: config.json's mixture-of-experts fields -> build kwargs, with transformers' defaults where a field is absent
MOE_FIELDS = {"num_experts": ("num_experts", None), "num_experts_per_tok": ("top_k", None),
              "moe_intermediate_size": ("moe_intermediate_size", None), "norm_topk_prob": ("norm_topk_prob", None),
              "decoder_sparse_step": ("decoder_sparse_step", 1), "mlp_only_layers": ("mlp_only_layers", []),
              "router_aux_loss_coef": ("aux_loss_coef", 0.001), "router_z_loss_coef": ("z_loss_coef", 0.0)}
#: what the two releases' configs default to when a field is absent (transformers' config classes)
MOE_DEFAULTS = {"qwen2_moe": {"norm_topk_prob": False}, "qwen3_moe": {"norm_topk_prob": False}}


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
    kwargs = decoder_kwargs(config, family, max_position_embeddings=32768, head_dim=DEFAULT_HEAD_DIM.get(family))
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise PosttuneError(f"config.json: hidden_act '{config['hidden_act']}' is not supported by the {family} "
                            f"family (supported: silu)")
    kwargs["sliding_window"], kwargs["layer_types"] = read_sliding(config, kwargs["num_layers"])
    if family in ("qwen3", "qwen3_moe"):
        kwargs["attention_bias"] = bool(config.get("attention_bias", False))
    if family in MOE_DEFAULTS:
        kwargs.update(read_moe(config, family, kwargs["num_layers"]))
    return kwargs


def read_moe(config: Mapping[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts build kwargs (``num_experts`` is also spelled ``num_local_experts``)."""
    found = {**MOE_DEFAULTS[family], "num_experts": config.get("num_experts") or config.get("num_local_experts")}
    kwargs = {}
    for field, (kwarg, default) in MOE_FIELDS.items():
        value = config.get(field, found.get(field, default)) if field != "num_experts" else found[field]
        if value is None:
            raise PosttuneError(f"config.json: '{field}' is missing (needed by the {family} family)")
        kwargs[kwarg] = value
    if not 1 <= kwargs["top_k"] <= kwargs["num_experts"]:
        raise PosttuneError(f"config.json: num_experts_per_tok must be between 1 and num_experts "
                            f"({kwargs['num_experts']}), got {kwargs['top_k']}")
    if any(not isinstance(i, int) or not 0 <= i < num_layers for i in kwargs["mlp_only_layers"]):
        raise PosttuneError(f"config.json: mlp_only_layers must list layer indices below {num_layers}, "
                            f"got {kwargs['mlp_only_layers']}")
    kwargs["mlp_only_layers"] = tuple(kwargs["mlp_only_layers"])
    if family == "qwen2_moe":
        if config.get("shared_expert_intermediate_size") == 0:  # transformers keeps zero-size tensors and a gate
            raise PosttuneError("config.json: shared_expert_intermediate_size 0 (no shared expert) is not supported "
                                "by the qwen2_moe family: transformers still stores the shared expert's empty "
                                "tensors and its gate; a Qwen2-MoE without one is a qwen3_moe-shaped model")
        kwargs["shared_expert_intermediate_size"] = config.get("shared_expert_intermediate_size") or 0
        kwargs["attention_bias"] = bool(config.get("qkv_bias", True))
    return kwargs


def _leading_full_layers(kinds: Sequence[str]) -> int:
    """``max_window_layers`` for transformers 4, which knows no ``layer_types``: the full-attention prefix."""
    return next((i for i, kind in enumerate(kinds) if kind == SLIDING), len(kinds))


def to_hf_config(kwargs: Mapping[str, Any], family: str = "qwen2") -> dict[str, Any]:
    """A config.json dict that ``transformers`` loads as the same architecture."""
    window, num_layers = kwargs.get("sliding_window"), kwargs["num_layers"]
    kinds = list(kwargs.get("layer_types") or [SLIDING] * num_layers) if window else [FULL] * num_layers
    config = decoder_hf_config(kwargs, ARCHITECTURES[family], family, max_position_embeddings=32768, norm_eps=1e-6)
    config.update(hidden_act="silu", use_sliding_window=bool(window), sliding_window=window,
                  max_window_layers=_leading_full_layers(kinds), layer_types=kinds)
    if family in ("qwen3", "qwen3_moe"):
        config["attention_bias"] = bool(kwargs.get("attention_bias", False))
    if family in MOE_DEFAULTS:
        config.update({field: kwargs[kwarg] for field, (kwarg, _) in MOE_FIELDS.items() if kwarg in kwargs},
                      mlp_only_layers=list(kwargs.get("mlp_only_layers", ())), output_router_logits=False)
        if family == "qwen2_moe":
            config.update(shared_expert_intermediate_size=kwargs.get("shared_expert_intermediate_size", 0),
                          qkv_bias=bool(kwargs.get("attention_bias", True)))
    return config
