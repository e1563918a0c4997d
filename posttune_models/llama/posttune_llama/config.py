"""config.json <-> build kwargs for the llama, mistral, mixtral and smollm3 families.

The fields every Llama-like decoder shares (sizes, both RoPE spellings) are read and written by
``posttune.plugin.decoder_kwargs`` / ``decoder_hf_config``; here is what Llama adds: biases, the
activation, Mistral's sliding window, and Mixtral's mixture of experts.

Mixtral's ``intermediate_size`` is each expert's width. Its routing fields become the build
kwargs ``num_experts`` (``num_local_experts``), ``top_k`` (``num_experts_per_tok``),
``aux_loss_coef`` (``router_aux_loss_coef``) and ``z_loss_coef`` (``router_z_loss_coef``, not a
transformers field: 0 unless a config.json sets it). ``output_router_logits`` is ignored: it
only asks transformers to return the router logits, and posttune records the routing of every
forward that builds a graph. ``router_jitter_noise`` (transformers multiplies each MoE input by
uniform noise while training) is refused unless 0: posttune adds no jitter, and fine-tuning a
checkpoint without the noise its config.json asks for should be a choice made by editing the
file, not a silent difference.

SmolLM3 is Llama (with its biases) plus ``no_rope_layers``: one 0/1 flag per layer, 0 for a NoPE
layer; absent, every ``no_rope_layer_interval``-th layer (default 4) is NoPE, as transformers
derives it. Its optional sliding window (``use_sliding_window``, NoPE layers only) is refused: no
released SmolLM3 turns it on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from posttune.plugin import PosttuneError, decoder_hf_config, decoder_kwargs

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM"}
#: SmolLM3Config's defaults where they differ from Llama's
SMOLLM3_THETA, SMOLLM3_MAX_POSITIONS = 2_000_000.0, 32768
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
NATIVE_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
#: what ``build_mixtral`` defaults to, which are MixtralConfig's own defaults (4096 * 32 positions, RMSNorm
#: eps 1e-5, RoPE base 1e6): a config.json read or written without one of these fields means the same model
MIXTRAL_DEFAULTS: dict[str, Any] = {"max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_scaling": None,
                                    "norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
                                    "activation": "silu", "aux_loss_coef": 0.001, "z_loss_coef": 0.0}
#: config.json's mixture-of-experts fields -> build kwargs, with the default for an absent field (None: required,
#: as the expert count also tells the converter how many tensors to stack)
MOE_FIELDS = {"num_local_experts": ("num_experts", None), "num_experts_per_tok": ("top_k", None),
              "router_aux_loss_coef": ("aux_loss_coef", 0.001), "router_z_loss_coef": ("z_loss_coef", 0.0)}


def from_hf_config(config: Mapping[str, Any], family: str = "llama") -> dict[str, Any]:
    """Build kwargs for ``posttune_llama.model.build`` (``build_mixtral`` for mixtral) from a config.json dict."""
    if family == "smollm3":
        return smollm3_kwargs(config)
    kwargs = decoder_kwargs(config, family, max_position_embeddings=2048, windowed=family != "llama")
    kwargs["activation"] = read_activation(config, family)
    if family in ("mistral", "mixtral"):
        check_layer_types(config, family)
    if family == "mixtral":
        return {**kwargs, **mixtral_defaults(config), **read_moe(config),
                "sliding_window": config.get("sliding_window")}
    kwargs.update(attention_bias=bool(config.get("attention_bias", False)),
                  mlp_bias=bool(config.get("mlp_bias", False)))
    if family == "mistral":
        kwargs["sliding_window"] = config.get("sliding_window")
    return kwargs


def check_layer_types(config: Mapping[str, Any], family: str) -> None:
    """Mistral and Mixtral build one kind of layer (every one slides when ``sliding_window`` is set); a config.json
    whose ``layer_types`` mixes kinds is read per layer by transformers, so it is refused rather than built
    otherwise."""
    kinds, window = config.get("layer_types"), config.get("sliding_window")
    built = "sliding_attention" if window else "full_attention"
    if kinds is not None and (not isinstance(kinds, list) or any(kind != built for kind in kinds)):
        raise PosttuneError(f"config.json: layer_types: the {family} family builds every layer as {built} "
                            f"(sliding_window: {window}), got {kinds!r}; drop layer_types, or use a family that "
                            "reads it per layer (qwen2, qwen3)")


def smollm3_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """Build kwargs for a SmolLM3 config.json: Llama's, with its NoPE layers."""
    if config.get("use_sliding_window") and config.get("sliding_window"):
        raise PosttuneError("config.json: use_sliding_window: the smollm3 family builds no sliding window "
                            "(no released SmolLM3 uses one); set it to false")
    kwargs = decoder_kwargs(config, "smollm3", max_position_embeddings=SMOLLM3_MAX_POSITIONS, tie_word_embeddings=True)
    if not (config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")):
        kwargs["rope_theta"] = SMOLLM3_THETA
    layers, flags = kwargs["num_layers"], config.get("no_rope_layers")
    if flags is None:
        every = config.get("no_rope_layer_interval", 4)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise PosttuneError(f"config.json: no_rope_layer_interval must be a positive integer, got {every!r}")
        flags = [int((index + 1) % every != 0) for index in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(flag not in (0, 1) for flag in flags):
        raise PosttuneError(f"config.json: no_rope_layers must list 0 (no RoPE) or 1 for each of the {layers} layers, "
                            f"got {flags!r}")
    return {**kwargs, "activation": read_activation(config, "smollm3"), "no_rope_layers": tuple(flags),
            "attention_bias": bool(config.get("attention_bias", False)),
            "mlp_bias": bool(config.get("mlp_bias", False))}


def read_activation(config: Mapping[str, Any], family: str) -> str:
    """The native name of config.json's ``hidden_act`` (the MLP's, or every expert's)."""
    act = config.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise PosttuneError(f"config.json: hidden_act '{act}' is not supported by the {family} family "
                            f"(supported: {', '.join(sorted(HF_ACTIVATIONS))})")
    return HF_ACTIVATIONS[act]


def mixtral_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """MixtralConfig's defaults where ``decoder_kwargs``' differ, for the fields config.json leaves out."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    found = {"max_position_embeddings": config.get("max_position_embeddings"), "norm_eps": config.get("rms_norm_eps"),
             "rope_theta": config.get("rope_theta") or rope.get("rope_theta")}
    return {kwarg: MIXTRAL_DEFAULTS[kwarg] for kwarg, value in found.items() if value is None}


def read_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    """Mixtral's mixture-of-experts build kwargs, each field checked (one line naming it) before any build."""
    if config.get("router_jitter_noise"):
        raise PosttuneError(f"config.json: router_jitter_noise: posttune's mixtral router adds no jitter noise, got "
                            f"{config['router_jitter_noise']!r} (set it to 0 to fine-tune without it)")
    kwargs = {}
    for field, (kwarg, default) in MOE_FIELDS.items():
        value = config.get(field, default)
        if value is None:
            raise PosttuneError(f"config.json: '{field}' is missing (needed by the mixtral family)")
        kwargs[kwarg] = value
    for field in ("num_local_experts", "num_experts_per_tok"):
        if isinstance(config[field], bool) or not isinstance(config[field], int) or config[field] < 1:
            raise PosttuneError(f"config.json: {field} must be a positive integer, got {config[field]!r}")
    if kwargs["top_k"] > kwargs["num_experts"]:
        raise PosttuneError(f"config.json: num_experts_per_tok must be between 1 and num_local_experts "
                            f"({kwargs['num_experts']}), got {kwargs['top_k']}")
    for field in ("router_aux_loss_coef", "router_z_loss_coef"):
        value = config.get(field, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise PosttuneError(f"config.json: {field} must be a finite number >= 0, got {value!r}")
    return kwargs


def to_hf_config(kwargs: Mapping[str, Any], family: str = "llama") -> dict[str, Any]:
    """A config.json dict that ``transformers`` loads as the same architecture."""
    if family == "mixtral":
        return mixtral_hf_config({**MIXTRAL_DEFAULTS, **kwargs})
    if family == "smollm3":
        return smollm3_hf_config(kwargs)
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


def mixtral_hf_config(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """config.json for ``build_mixtral``'s kwargs (defaults filled in): no jitter, no returned router logits."""
    config = decoder_hf_config(kwargs, ARCHITECTURES["mixtral"], "mixtral",
                               max_position_embeddings=MIXTRAL_DEFAULTS["max_position_embeddings"],
                               norm_eps=MIXTRAL_DEFAULTS["norm_eps"])
    config.update({field: kwargs[kwarg] for field, (kwarg, _) in MOE_FIELDS.items()},
                  hidden_act=NATIVE_ACTIVATIONS[kwargs["activation"]], sliding_window=kwargs["sliding_window"],
                  router_jitter_noise=0.0, output_router_logits=False)
    return config


def smollm3_hf_config(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """config.json for SmolLM3 build kwargs: every layer full attention, its NoPE flags listed."""
    config = decoder_hf_config({"rope_theta": SMOLLM3_THETA, **kwargs}, ARCHITECTURES["smollm3"], "smollm3",
                               max_position_embeddings=SMOLLM3_MAX_POSITIONS, norm_eps=1e-6, tie_word_embeddings=True)
    flags = kwargs.get("no_rope_layers")
    layers = kwargs["num_layers"]
    config.update(hidden_act=NATIVE_ACTIVATIONS[kwargs.get("activation", "silu")],
                  attention_bias=bool(kwargs.get("attention_bias", False)),
                  mlp_bias=bool(kwargs.get("mlp_bias", False)),
                  no_rope_layers=[int(flag) for flag in flags] if flags is not None else [1] * layers,
                  use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * layers)
    return config
