"""The values of a checkpoint's config.json, checked before anything is built from them.

A hand-edited or corrupted config.json (a negative layer count, a size written as a string, a
RoPE dict written as a name, a JSON list) would otherwise surface as a traceback from deep in the
build, or as a multi-terabyte allocation. The fields checked here are the Hugging Face format's
own conventions (``PretrainedConfig`` and the RoPE dicts of ``modeling_rope_utils``), not any
model family's: every reader of config.json (``posttune validate``/``plan``/``train``,
``load_model``, ``merge``, ``generate``) gets the same one-line error naming the file and the
field, torch-free and before any weight is read. A field that is absent is the family's business
(its default, or its own one-line "missing"); what only a family knows stays in its
``from_hf_config``.

Integers are JSON integers: ``64.0`` is refused as transformers 5 refuses it, and ``true`` is a
boolean, not 1. Each size has a ceiling far above any released model but low enough that the
build cannot be asked for an absurd allocation (docs/checkpoints.md lists them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from posttune.errors import PosttuneError


@dataclass(frozen=True)
class Count:
    """An integer field: ``low`` <= value <= ``high``; ``nullable``: null means "absent" (the family's default).

    Only the four sizes without which no causal language model can be built refuse null.
    """

    low: int = 1
    high: int = 2**31 - 1
    nullable: bool = True


#: integer fields, by the name transformers gives them. Ceilings, with the largest released value we know
#: of in brackets: vocab 2**22 [~262k], hidden 2**17 [~18k], MLP 2**20 [~74k], layers and heads 4096
#: [~128], head_dim 2**14 [512], context and window 2**26 = 67M [10M].
COUNTS: dict[str, Count] = {
    "vocab_size": Count(high=2**22, nullable=False),
    "hidden_size": Count(high=2**17, nullable=False),
    "intermediate_size": Count(high=2**20),  # null: GPT-Neo's "4 x hidden_size"
    "num_hidden_layers": Count(high=4096, nullable=False),
    "num_attention_heads": Count(high=4096, nullable=False),
    "num_key_value_heads": Count(high=4096),
    "head_dim": Count(low=0, high=2**14),  # 0 or null: hidden_size // num_attention_heads
    "max_position_embeddings": Count(high=2**26),
    "original_max_position_embeddings": Count(high=2**26),
    "sliding_window": Count(low=0, high=2**26),  # null, or 0 as transformers 5 writes it: no window
    "sliding_window_pattern": Count(high=4096),
    "max_window_layers": Count(low=0),  # 0: every layer slides
}
#: fields transformers lets hold one value per layer (Gemma 3n's MLP widths)
PER_LAYER = frozenset({"intermediate_size"})
#: number fields that must be finite and > 0, or null
POSITIVE = ("rms_norm_eps",  # null: a LayerNorm (Cohere 2)
            "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
            "attn_logit_softcapping", "final_logit_softcapping")  # null: no cap; 0 would divide by zero
FRACTIONS = ("partial_rotary_factor",)  # in (0, 1]
BOOLEANS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")  # "false" reads as true
STRINGS = ("hidden_act", "hidden_activation", "dtype", "torch_dtype", "model_type")
STRING_LISTS = ("architectures", "layer_types")
ROPE_DICTS = ("rope_scaling", "rope_parameters")
#: inside a RoPE dict: positive numbers, finite numbers, and what each rope_type cannot do without
ROPE_POSITIVE = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor",
                 "beta_fast", "beta_slow")
ROPE_FINITE = ("mscale", "mscale_all_dim")
ROPE_LISTS = ("short_factor", "long_factor")  # LongRoPE: one positive factor per rotated frequency
ROPE_REQUIRES = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor",
                                                                          "high_freq_factor"),
                 "longrope": ("short_factor", "long_factor")}


def check_hf_config(config: Any, where: str) -> dict[str, Any]:
    """``config`` (parsed config.json) if its values are usable; else a PosttuneError ``where: field: problem``."""
    if not isinstance(config, dict):
        raise PosttuneError(f"{where}: expected a JSON object of settings, got {_kind(config)}")
    _check_fields(config, where, "")
    text = config.get("text_config")  # multimodal checkpoints keep the language model's settings here
    if text is not None:
        if not isinstance(text, dict):
            _refuse(where, "text_config", "an object", text)
        _check_fields(text, where, "text_config.")
    return config


def _check_fields(config: Mapping[str, Any], where: str, prefix: str) -> None:
    for name, count in COUNTS.items():
        if name in config:
            _check_count(config[name], count, where, prefix + name, per_layer=name in PER_LAYER)
    for name in POSITIVE:
        if config.get(name) is not None:
            _check_number(config[name], where, prefix + name, positive=True)
    for name in FRACTIONS:
        _check_fraction(config.get(name), where, prefix + name)
    for name in BOOLEANS:
        if config.get(name) is not None and not isinstance(config[name], bool):
            _refuse(where, prefix + name, "true or false", config[name])
    for name in STRINGS:
        if config.get(name) is not None and not isinstance(config[name], str):
            _refuse(where, prefix + name, "a string", config[name])
    for name in STRING_LISTS:
        value = config.get(name)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            _refuse(where, prefix + name, "a list of strings", value)
    for name in ROPE_DICTS:
        _check_rope(config.get(name), where, prefix + name)
    _check_quantization(config.get("quantization_config"), where, prefix + "quantization_config")
    _check_heads(config, where, prefix)


def _check_count(value: Any, count: Count, where: str, field: str, *, per_layer: bool = False) -> None:
    if value is None and count.nullable:
        return
    if per_layer and isinstance(value, list) and value:
        for index, item in enumerate(value):
            _check_count(item, replace(count, nullable=False), where, f"{field}[{index}]")
        return
    if not _is_int(value) or value < count.low:
        wanted = "a positive integer" if count.low == 1 else f"an integer >= {count.low}"
        if per_layer:
            wanted += " (or a list of them, one per layer)"
        _refuse(where, field, wanted + (" or null" if count.nullable else ""), value)
    if value > count.high:
        raise PosttuneError(f"{where}: {field}: {value} is larger than any real model's "
                            f"(posttune accepts at most {count.high})")


def _check_number(value: Any, where: str, field: str, *, positive: bool) -> None:
    if not (_is_number(value) and math.isfinite(value) and (value > 0 or not positive)):
        _refuse(where, field, ("a positive number" if positive else "a finite number") + " or null", value)


def _check_fraction(value: Any, where: str, field: str) -> None:
    if value is not None and not (_is_number(value) and 0 < value <= 1):
        _refuse(where, field, "a number in (0, 1]", value)


def _check_rope(value: Any, where: str, field: str) -> None:
    """A RoPE dict (``rope_type`` and its parameters), or one per layer type (``full_attention``: {...})."""
    if value is None:
        return
    if not isinstance(value, dict):
        _refuse(where, field, "an object (a RoPE dict such as {\"rope_type\": \"linear\", \"factor\": 2.0})", value)
    for key, item in value.items():
        if key.endswith("_attention"):  # transformers 5 keys Gemma 3's RoPE by layer type
            _check_rope(item, where, f"{field}.{key}")
    for key in ("rope_type", "type"):
        if value.get(key) is not None and not isinstance(value[key], str):
            _refuse(where, f"{field}.{key}", "a string", value[key])
    for key in ROPE_POSITIVE:
        if value.get(key) is not None:
            _check_number(value[key], where, f"{field}.{key}", positive=True)
    for key in ROPE_FINITE:
        if value.get(key) is not None:
            _check_number(value[key], where, f"{field}.{key}", positive=False)
    if "original_max_position_embeddings" in value:
        _check_count(value["original_max_position_embeddings"], COUNTS["original_max_position_embeddings"],
                     where, f"{field}.original_max_position_embeddings")
    _check_fraction(value.get("partial_rotary_factor"), where, f"{field}.partial_rotary_factor")
    for key in ROPE_LISTS:
        items = value.get(key)
        if items is not None and not (isinstance(items, list) and items):
            _refuse(where, f"{field}.{key}", "a list of numbers", items)
        for item in items or ():
            _check_number(item, where, f"{field}.{key}", positive=True)
    kind = value.get("rope_type") or value.get("type")
    for key in ROPE_REQUIRES.get(kind, ()):
        if value.get(key) is None:
            raise PosttuneError(f"{where}: {field}.{key}: missing (rope_type '{kind}' needs it)")


def _check_quantization(value: Any, where: str, field: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        _refuse(where, field, "an object", value)
    method = value.get("quant_method")
    if not isinstance(method, str) or not method:
        _refuse(where, f"{field}.quant_method", "a non-empty string naming the quantization method", method)


def _check_heads(config: Mapping[str, Any], where: str, prefix: str) -> None:
    """Grouped-query attention shares each key/value head among a whole number of query heads.

    (hidden_size need not divide by the heads: without head_dim, transformers and the families
    alike take hidden_size // num_attention_heads, and the weights' shapes follow.)
    """
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise PosttuneError(f"{where}: {prefix}num_attention_heads: {heads} is not a multiple of "
                            f"{prefix}num_key_value_heads ({kv_heads})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _refuse(where: str, field: str, wanted: str, value: Any) -> NoReturn:
    raise PosttuneError(f"{where}: {field}: expected {wanted}, got {_shown(value)}")


def _shown(value: Any) -> str:
    """The value as config.json spells it (null, true, "64"), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    kinds = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return f"{kinds.get(type(value), 'a number')} ({_shown(value)})"


def refuse_unbuildable(config: Mapping[str, Any], family: str, *, windowed: bool = False) -> None:
    """What ``check`` accepts but a decoder with one MLP width for every layer and RMSNorm cannot
    build, in one line each; ``windowed``: the family reads ``sliding_window``, where 0 tokens would
    hide every position from attention (for transformers 5, 0 may mean "no window" elsewhere)."""
    if isinstance(config.get("intermediate_size"), list):  # transformers allows one width per layer (Gemma 3n)
        raise PosttuneError(f"config.json: intermediate_size: the {family} family builds one MLP width for every "
                            "layer, got a list")
    if "rms_norm_eps" in config and config["rms_norm_eps"] is None:  # elsewhere null means LayerNorm (Cohere 2)
        raise PosttuneError(f"config.json: rms_norm_eps: expected a positive number for the {family} family's "
                            "RMSNorm, got null")
    if windowed and config.get("sliding_window") == 0:
        raise PosttuneError(f"config.json: sliding_window: a window of 0 tokens hides every position from the "
                            f"{family} family's attention (null: no window)")
