"""The Hugging Face module name of each of a model's linear layers, through its family's ``hf`` converter.

What lets ``adapter.targets`` be written in either naming (``lm_head`` or ``output``), and what an adapter
kind's saved folder keys its tensors by (PEFT's layout: the transformers model's module names). Fused
layers (Phi-3's ``qkv_proj``: several native layers' rows joined into one) are reported with their join.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttune.adapters.inject import adapted_modules
from posttune.adapters.layer import AdaptedLinear
from posttune.checkpoint.convert import Join, pairs
from posttune.checkpoint.score_head import score_labels
from posttune.errors import PosttuneError

Convert = Callable[[str, torch.Tensor, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Fused:
    """A transformers linear layer whose rows are several native layers' (Phi-3's ``qkv_proj``)."""

    parts: tuple[str, ...]  # the native layers, in the order the converter stacks their rows
    join: Callable[[list[torch.Tensor]], torch.Tensor]


def hf_modules(model: nn.Module, from_native: Convert, hf_config: Mapping[str, Any]
               ) -> tuple[dict[str, str], dict[str, Fused]]:
    """Native -> transformers module name for every linear layer (adapted or not), and the
    transformers layers that several native ones are joined into, by name."""
    names, fused = {}, {}
    for name, module in linear_layers(model).items():
        names[name], join = hf_module(name, module.weight.detach(), from_native, hf_config)
        if join is not None:
            fused[names[name]] = Fused(tuple(p.removesuffix(".weight") for p in join.parts), join.join)
    return names, fused


def checkpoint_module_names(model: nn.Module) -> dict[str, str]:
    """Native -> Hugging Face module name of each linear layer, as a saved PEFT adapter names them, so that
    ``adapter.targets`` copied from a PEFT config (``lm_head``, ``self_attn.q_proj``) or from a saved
    ``adapter_config.json`` select what they select there. Names only: the converter sees meta tensors of
    the weights' shapes (no copy of a real model's weights). Empty for a model with no ``hf`` converter
    (or not built by posttune); a layer the converter cannot name on its own (split) is left out."""
    try:
        _, converter, hf_config = family_io(model)
    except PosttuneError:  # no origin, no converter, or no config.json to convert with: native names only
        return {}
    names = {}
    for name, module in linear_layers(model).items():
        weight = torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta")
        try:
            names[name] = hf_module(name, weight, converter.from_native, hf_config)[0]
        except (PosttuneError, RuntimeError, NotImplementedError):  # split, dropped, or not computable on meta
            continue
    return names


def hf_module(name: str, weight: torch.Tensor, from_native: Convert, hf_config: Mapping[str, Any]
              ) -> tuple[str, Join | None]:
    """The transformers module holding native linear layer ``name``, and the join when it is fused."""
    answer = list(pairs(from_native(f"{name}.weight", weight, hf_config)))
    hf_key = answer[0][0] if len(answer) == 1 else None
    join = hf_key if isinstance(hf_key, Join) else None
    if join is not None:
        hf_key = join.key
    if not isinstance(hf_key, str):  # one tensor split into several
        raise PosttuneError(f"converter splits '{name}.weight': a PEFT adapter needs one Hugging Face module "
                            f"per linear layer or a join of several (merge the adapters and save the model instead)")
    if not hf_key.endswith(".weight"):
        raise PosttuneError(f"converter maps '{name}.weight' to '{hf_key}', not a module's .weight")
    return hf_key.removesuffix(".weight"), join


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Linear layers of the base model: adapted ones by their own name, not their inner Linears."""
    inner = {id(m) for layer in adapted_modules(model).values() for m in layer.modules() if m is not layer}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, AdaptedLinear) or (isinstance(m, nn.Linear) and id(m) not in inner)}


def family_io(model: nn.Module) -> tuple[Any, Any, dict[str, Any]]:
    """(origin, the family's hf converter, config.json) for a model posttune built or loaded."""
    from posttune.checkpoint.hf_save import hf_config_for
    from posttune.checkpoint.origin import origin_of
    from posttune.plugins import get_registry

    origin = origin_of(model)
    registry = get_registry()
    family = registry.get("model_family", origin.family)
    converter = registry.get("checkpoint_converter", f"{origin.family}:hf")
    if score_labels(model) is not None:
        from posttune.checkpoint.score_head import score_converter

        converter = score_converter(converter)
    return origin, converter, hf_config_for(origin, family, ())
