"""The Hugging Face spelling of ``posttune.modules``' decoder, shared by the Llama-like families.

Llama's checkpoints fixed the names Mistral, Qwen, Gemma and most decoders since have kept: the
tensors (``model.layers.N.self_attn.q_proj.weight``, ...) and the config.json fields
(``num_key_value_heads``, both RoPE spellings, ...). Each family stays its own distribution
(``pip install posttune-qwen``), so the common part lives here, on the public surface; a family
adds only what it does differently. Torch-free: a family's plugin module imports this.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from posttune.checkpoint.convert import Join
from posttune.checkpoint.hf_config_check import refuse_unbuildable
from posttune.checkpoint.keymap import LayeredKeyMap
from posttune.errors import PosttuneError

#: HF module -> native module outside the layers, and inside each ``model.layers.N``
HF_TOP = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "output"}
HF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
            **{f"self_attn.{name}": f"attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
            **{f"mlp.{name}": f"mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")}}


def decoder_keys(family: str, per_layer: Mapping[str, str] | None = None, *, hint: str = "") -> LayeredKeyMap:
    """Llama's tensor names, both ways; ``per_layer`` adds or renames submodules inside each layer
    (Qwen 3's q/k norms; Gemma 2, whose ``post_attention_layernorm`` follows attention)."""
    return LayeredKeyMap(family, HF_TOP, {**HF_LAYER, **(per_layer or {})}, hint=hint)


def decoder_kwargs(config: Mapping[str, Any], family: str, *, max_position_embeddings: int,
                   tie_word_embeddings: bool = False, head_dim: int | None = None,
                   windowed: bool = False, partial_rotary: bool = False) -> dict[str, Any]:
    """The build kwargs every decoder of ``posttune.modules`` takes, from a config.json dict.

    Absent fields default as transformers' config classes do (key/value heads = query heads,
    ``head_dim`` = hidden / heads, ``rms_norm_eps`` 1e-6); the family names its own defaults.
    RoPE is read in both spellings (transformers 5's ``rope_parameters``, older ``rope_theta`` +
    ``rope_scaling``), so a non-default base is never lost. ``windowed``: as ``refuse_unbuildable``.
    ``partial_rotary``: the family builds partial rotary embeddings, read as ``partial_rotary_factor``
    (else a config.json that asks for them is refused).
    """
    def need(key: str) -> Any:
        if config.get(key) is None:
            raise PosttuneError(f"config.json: '{key}' is missing (needed by the {family} family)")
        return config[key]

    refuse_unbuildable(config, family, windowed=windowed)
    from posttune.modules.rope import read_rope, rotary_fraction  # torch is imported only when a config is read

    hidden_size, num_heads = need("hidden_size"), need("num_attention_heads")
    theta, scaling = read_rope(config, family, partial=partial_rotary)
    partial = {"partial_rotary_factor": rotary_fraction(config)} if partial_rotary else {}
    return {**partial,
        "vocab_size": need("vocab_size"), "hidden_size": hidden_size, "intermediate_size": need("intermediate_size"),
        "num_layers": need("num_hidden_layers"), "num_heads": num_heads,
        "num_kv_heads": config.get("num_key_value_heads") or num_heads,
        "head_dim": config.get("head_dim") or head_dim or hidden_size // num_heads,
        "max_position_embeddings": config.get("max_position_embeddings") or max_position_embeddings,
        "rope_theta": theta, "rope_scaling": scaling, "norm_eps": config.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", tie_word_embeddings)),
    }


def decoder_hf_config(kwargs: Mapping[str, Any], architecture: str, model_type: str, *,
                      max_position_embeddings: int, norm_eps: float, tie_word_embeddings: bool = False,
                      head_dim: int | None = None) -> dict[str, Any]:
    """config.json's common fields for build kwargs (``decoder_kwargs`` reads them back).

    An absent kwarg is written as the family's builder defaults it (named here). RoPE goes in
    both spellings, so transformers 4 and 5 read the same. Token ids (bos/eos/pad) are not build
    kwargs: whoever saves a checkpoint copies them from the source config.json or the tokenizer.
    """
    hidden_size, num_heads = kwargs["hidden_size"], kwargs["num_heads"]
    theta, scaling = float(kwargs.get("rope_theta", 10000.0)), kwargs.get("rope_scaling")
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": kwargs["vocab_size"],
        "hidden_size": hidden_size, "intermediate_size": kwargs["intermediate_size"],
        "num_hidden_layers": kwargs["num_layers"], "num_attention_heads": num_heads,
        "num_key_value_heads": kwargs.get("num_kv_heads") or num_heads,
        "head_dim": kwargs.get("head_dim") or head_dim or hidden_size // num_heads,
        "max_position_embeddings": kwargs.get("max_position_embeddings", max_position_embeddings),
        "rms_norm_eps": kwargs.get("norm_eps", norm_eps),
        "tie_word_embeddings": bool(kwargs.get("tie_word_embeddings", tie_word_embeddings)),
        "rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta},
    }


#: ``posttune.modules.Experts``' stacked parameters, each one nn.Linear-shaped slab per expert
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def _stack(parts: list[Any]) -> Any:
    import torch

    return torch.stack(parts)


@dataclass(frozen=True)
class ExpertKeys:
    """A converter's two functions for a mixture-of-experts decoder: per-expert HF tensors
    (``model.layers.N.<block>.experts.E.<name>.weight``) stack into ``layers.N.mlp.experts.<native>``
    on load (a ``Join``: each held until its last expert arrives) and split back on save; every
    other tensor goes through ``keys`` (which maps the router, shared experts and dense layers).

    ``names``: HF name -> native stacked parameter (``{"w1": "gate_proj", "w3": "up_proj",
    "w2": "down_proj"}`` for a family with its own names); ``count_fields``: where config.json gives the expert count
    (the first present wins).
    """

    keys: LayeredKeyMap
    count_fields: tuple[str, ...] = ("num_experts",)
    block: str = "mlp"  # the HF submodule of a layer that holds ``experts``
    names: Mapping[str, str] = field(default_factory=lambda: {name: name for name in EXPERT_WEIGHTS})
    _hf: re.Pattern = field(init=False, repr=False)
    _native: re.Pattern = field(init=False, repr=False)
    _hf_names: dict[str, str] = field(init=False, repr=False)  # native stacked parameter -> HF name
    _parts: dict[tuple[str, str, int], tuple[str, ...]] = field(init=False, repr=False)  # built once per stack

    def __post_init__(self) -> None:
        hf = (re.escape(f"{self.keys.hf_layers}") + r"(\d+)\." + re.escape(self.block)
              + r"\.experts\.(\d+)\.(\w+)\.weight")
        native = re.escape(self.keys.native_layers) + r"(\d+)\.mlp\.experts\.(\w+)"
        object.__setattr__(self, "_hf", re.compile(hf))
        object.__setattr__(self, "_native", re.compile(native))
        object.__setattr__(self, "_hf_names", {native: hf for hf, native in self.names.items()})
        object.__setattr__(self, "_parts", {})

    def count(self, hf_config: Mapping[str, Any]) -> int:
        count = next((hf_config[f] for f in self.count_fields if hf_config.get(f) is not None), None)
        if not isinstance(count, int) or count < 1:
            raise PosttuneError(f"config.json: '{self.count_fields[0]}' must be the number of experts, got {count!r}")
        return count

    def hf_key(self, layer: str, expert: int, native: str) -> str:
        return f"{self.keys.hf_layers}{layer}.{self.block}.experts.{expert}.{self._hf_names[native]}.weight"

    def to_native(self, key: str, tensor: Any, hf_config: Mapping[str, Any]) -> Any:
        match = self._hf.fullmatch(key)
        if match is None or match.group(3) not in self.names:
            return self.keys.to_native(key, tensor, hf_config)
        layer, expert, name = match.groups()
        count, native = self.count(hf_config), self.names[name]
        if int(expert) >= count:
            raise PosttuneError(f"checkpoint tensor '{key}': expert {expert} of a model with {count} experts "
                                f"(config.json '{self.count_fields[0]}')")
        parts = self._parts.get((layer, native, count))
        if parts is None:  # every expert's tensor names the same parts: build them once, not once per expert
            parts = self._parts[layer, native, count] = tuple(self.hf_key(layer, e, native) for e in range(count))
        return Join(f"{self.keys.native_layers}{layer}.mlp.experts.{native}", parts, _stack), tensor

    def from_native(self, key: str, tensor: Any, hf_config: Mapping[str, Any]) -> Any:
        match = self._native.fullmatch(key)
        if match is None or match.group(2) not in self.names.values():
            return self.keys.from_native(key, tensor, hf_config)
        layer, native = match.groups()
        return self._split(layer, native, tensor)

    def _split(self, layer: str, native: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        for expert in range(tensor.shape[0]):
            yield self.hf_key(layer, expert, native), tensor[expert]
