"""Tensor names between Hugging Face checkpoints and native models, for layered decoders.

Most families differ from HF only in module names: a few top-level modules (embedding, final
norm, head) and, inside each ``model.layers.N.``, a fixed set of submodules. A family plugin
declares those two tables; this class maps names both ways and refuses unknown tensors with a
one-line error. Tensors pass through unchanged (families that must also transform values, e.g.
permute q/k rows, wrap these functions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from posttune.errors import PosttuneError


def rename(key: str, top: Mapping[str, str], per_layer: Mapping[str, str], prefix: str,
           new_prefix: str) -> str | None:
    """``key`` with its module path mapped (a top-level module, or ``prefix``N.module); None if unknown."""
    module, _, param = key.rpartition(".")
    if module in top:
        return f"{top[module]}.{param}"
    if module.startswith(prefix):
        index, _, rest = module[len(prefix):].partition(".")
        if index.isdigit() and rest in per_layer:
            return f"{new_prefix}{index}.{per_layer[rest]}.{param}"
    return None


@dataclass(frozen=True)
class LayeredKeyMap:
    """``to_native``/``from_native`` for a ``CheckpointConverter`` built from two name tables."""

    family: str
    top: Mapping[str, str]  # HF module -> native module, outside the layers
    per_layer: Mapping[str, str]  # HF submodule -> native submodule, inside each layer
    hf_layers: str = "model.layers."
    native_layers: str = "layers."
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)  # cached tensors the model recomputes
    hint: str = ""  # appended to the unknown-tensor error
    _native_top: dict[str, str] = field(init=False, repr=False)
    _native_layer: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_native_top", {v: k for k, v in self.top.items()})
        object.__setattr__(self, "_native_layer", {v: k for k, v in self.per_layer.items()})

    def to_native(self, key: str, tensor: Any, hf_config: Mapping[str, Any]) -> tuple[str, Any] | None:
        """(native key, tensor) for an HF tensor; None for one the native model does not keep."""
        if key.endswith(self.ignored_suffixes):
            return None
        native = rename(key, self.top, self.per_layer, self.hf_layers, self.native_layers)
        if native is None:
            raise PosttuneError(f"checkpoint tensor '{key}' is not part of a {self.family} model "
                                f"({self._guess(key, hf_config)}{self.hint})")
        return native, tensor

    def _guess(self, key: str, hf_config: Mapping[str, Any]) -> str:
        """What an unknown tensor says of the checkpoint: a base model saved without its wrapper's prefix, a
        multimodal one (tensors outside the decoder and its head), or another family."""
        prefix = self.hf_layers.split(".")[0] + "."
        if not key.startswith(prefix) and rename(prefix + key, self.top, self.per_layer, self.hf_layers,
                                                 self.native_layers):
            return (f"its names lack the '{prefix}' prefix: a base model saved without its LM head; transformers "
                    "loads it as AutoModelForCausalLM, whose save_pretrained writes the names posttune reads")
        if not key.startswith(prefix) and key.partition(".")[0] not in {m.partition(".")[0] for m in self.top}:
            return ("outside the decoder and its head: from a multimodal checkpoint, export its text model alone "
                    "(its ForCausalLM class) and load that; else is this the right family?")
        kind = hf_config.get("model_type")
        written = f"; the checkpoint's config.json says model_type {kind}" if kind and kind != self.family else ""
        return f"is this the right family?{written}"

    def from_native(self, key: str, tensor: Any, hf_config: Mapping[str, Any]) -> tuple[str, Any]:
        """(HF key, tensor) for a native tensor."""
        hf_key = rename(key, self._native_top, self._native_layer, self.native_layers, self.hf_layers)
        if hf_key is None:
            raise PosttuneError(f"native tensor '{key}' has no Hugging Face name in the {self.family} family")
        return hf_key, tensor


#: the child under which a wrapping layer (an adapter) keeps the layer it wraps; checkpoints name
#: the wrapped tensors without it (``q_proj.base.weight`` is saved and loaded as ``q_proj.weight``)
BASE = "base"


def base_key(key: str) -> str:
    """The unwrapped native key: ``layers.0.attn.q_proj.base.weight`` -> ``layers.0.attn.q_proj.weight``.

    Other keys are returned unchanged (native models have no module named ``base``).
    """
    module, _, param = key.rpartition(".")
    if module == BASE or module.endswith(f".{BASE}"):
        return f"{module[:-len(BASE)]}{param}".lstrip(".")
    return key
