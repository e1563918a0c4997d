"""LoRA / DoRA adapters in PEFT's format, both ways, for any family with an ``hf`` converter.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose
keys are the transformers model's module names under ``base_model.model.``::

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight     [rank, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight     [out, rank]
    base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector   [out]  (DoRA)

Module names go through the family's registered ``FAMILY:hf`` checkpoint converter (the same
one that saves full checkpoints), applied to the layer's ``.weight`` key. A converter may also
change a weight's values (e.g. a RoPE row permutation of q/k): it is then applied to
``lora_B`` and the DoRA magnitude (row-indexed, like the weight) and ``lora_A`` is left as is,
which is exact for any converter that only mixes rows; any other converter is refused with a
clear error (merge the adapters and save the full model instead).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttune.adapters.inject import adapted_modules, apply_adapters
from posttune.adapters.lora import LoRALinear
from posttune.checkpoint.atomic import atomic_dir
from posttune.checkpoint.peft_config import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, UNSUPPORTED, adapter_base, read_config,
                                             saved_settings, settings_of)
from posttune.checkpoint.safetensors_io import Planned, iter_tensors, write_file
from posttune.checkpoint.score_head import HEAD, HF_SCORE, score_labels
from posttune.errors import PosttuneError

PREFIX = "base_model.model."
#: PEFT's tensor suffix for each native adapter tensor of a LoRALinear
PEFT_SUFFIX = {"lora_A.weight": "lora_A.weight", "lora_B.weight": "lora_B.weight",
               "magnitude": "lora_magnitude_vector"}
NATIVE_SUFFIX = {**{v: k for k, v in PEFT_SUFFIX.items()},
                 "lora_magnitude_vector.weight": "magnitude"}  # spelling of older PEFT releases
ROW_INDEXED = ("lora_B.weight", "magnitude")  # tensors indexed by the weight's output rows
#: adapter_config.json fields whose non-default values posttune cannot reproduce
Convert = Callable[[str, torch.Tensor, Mapping[str, Any]], Any]


def save_peft_adapter(model: nn.Module, out_dir: str | Path, *,
                      base_model_name_or_path: str | None = None,
                      state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write the model's adapters so ``peft.PeftModel.from_pretrained(hf_model, out_dir)`` loads them.

    ``base_model_name_or_path`` defaults to where the model was loaded from (its origin).
    Atomic, like ``save_model``: ``out_dir`` holds the old adapter or the complete new one.
    ``state_dict`` (adapter tensors by model key, e.g. gathered from FSDP2/TP shards) replaces
    the layers' own tensors.
    """
    layers = adapted_modules(model)
    if not layers:
        raise PosttuneError("save_peft_adapter: the model has no adapters (apply_adapters first)")
    _require_real(model, "save_peft_adapter")
    settings = _uniform_settings(layers)
    origin, converter, hf_config = _family_io(model)
    hf_names = hf_module_names(model, converter.from_native, hf_config)
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        rows = _row_map(converter.from_native, f"{name}.weight", layer.base.weight, hf_config)
        for suffix, tensor in _layer_tensors(layer).items():
            tensor = state_dict[f"{name}.{suffix}"] if state_dict is not None else tensor
            value = rows(tensor) if suffix in ROW_INDEXED else tensor
            tensors[f"{PREFIX}{hf_names[name]}.{PEFT_SUFFIX[suffix]}"] = value.detach().to("cpu").contiguous()
    task = "CAUSAL_LM"
    if score_labels(model) is not None:  # the score head, trained whole: PEFT's modules_to_save of SEQ_CLS
        head = state_dict[HEAD] if state_dict is not None else model.get_parameter(HEAD)
        tensors[f"{PREFIX}{HF_SCORE}"] = head.detach().to("cpu").contiguous()
        task = "SEQ_CLS"
    config = {
        **UNSUPPORTED, "peft_type": "LORA", "task_type": task,
        "base_model_name_or_path": base_model_name_or_path or origin.source,
        "r": settings["rank"], "lora_alpha": settings["alpha"], "lora_dropout": settings["dropout_p"],
        "use_dora": settings["kind"] == "dora",
        "target_modules": peft_targets([hf_names[n] for n in layers], hf_names.values()),
        "exclude_modules": None, "init_lora_weights": True, "inference_mode": True, "revision": None,
    }
    if task == "SEQ_CLS":
        config["modules_to_save"] = [HF_SCORE.removesuffix(".weight")]
    planned = [Planned(key, t.dtype, tuple(t.shape)) for key, t in sorted(tensors.items())]
    with atomic_dir(out_dir, replaceable=(ADAPTER_CONFIG, ADAPTER_WEIGHTS)) as tmp:
        write_file(tmp / ADAPTER_WEIGHTS, planned, tensors.__getitem__)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return Path(out_dir)


def load_peft_adapter(model: nn.Module, adapter_dir: str | Path) -> list[str]:
    """Load a PEFT LoRA/DoRA adapter into ``model``; returns the adapted module names.

    A model without adapters gets them (targets, rank, alpha, dropout and kind from
    ``adapter_config.json``); a model that has them (resuming) must have the same ones.
    """
    directory = Path(adapter_dir)
    _require_real(model, "load_peft_adapter")
    config = read_config(directory)
    _, converter, hf_config = _family_io(model)
    hf_names = hf_module_names(model, converter.from_native, hf_config)
    targets = [name for name, hf_name in hf_names.items() if peft_targets_match(config, hf_name)]
    if not targets:
        raise PosttuneError(f"{directory}: target_modules {config.get('target_modules')!r} match no linear "
                            f"layer of this model")
    settings = settings_of(config)
    layers = adapted_modules(model)
    if not layers:
        apply_adapters(model, targets=targets, rank=settings["rank"], alpha=settings["alpha"],
                       dropout=settings["dropout_p"], kind=settings["kind"])
        layers = adapted_modules(model)
    _check_same(directory, layers, targets, settings)
    _copy_tensors(model, directory, layers, hf_names, converter.to_native, hf_config)
    return list(layers)


def hf_module_names(model: nn.Module, from_native: Convert, hf_config: Mapping[str, Any]) -> dict[str, str]:
    """Native -> transformers module name for every linear layer (adapted or not)."""
    names = {}
    for name, module in _linear_layers(model).items():
        answer = from_native(f"{name}.weight", module.weight.detach(), hf_config)
        hf_key = answer[0] if isinstance(answer, tuple) and len(answer) == 2 else None
        if not isinstance(hf_key, str):  # a fused or stacked tensor (checkpoint/convert.py)
            raise PosttuneError(f"converter splits or joins '{name}.weight': a PEFT adapter needs one Hugging Face "
                                f"module per linear layer (merge the adapters and save the model instead)")
        if not hf_key.endswith(".weight"):
            raise PosttuneError(f"converter maps '{name}.weight' to '{hf_key}', not a module's .weight")
        names[name] = hf_key.removesuffix(".weight")
    return names


def _linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Linear layers of the base model: adapted ones by their own name, not their inner Linears."""
    inner = {id(m) for layer in adapted_modules(model).values() for m in layer.modules() if m is not layer}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, LoRALinear) or (isinstance(m, nn.Linear) and id(m) not in inner)}


def peft_targets(adapted: list[str], all_linear: Any) -> list[str]:
    """PEFT ``target_modules``: a layer's last name part (``q_proj``) when every linear layer of
    that name is adapted (PEFT matches list entries as dotted suffixes), else its full name."""
    adapted_set, everything = set(adapted), list(all_linear)
    targets = set()
    for name in adapted:
        leaf = name.rpartition(".")[2]
        same_leaf = [n for n in everything if n == leaf or n.endswith(f".{leaf}")]
        targets.add(leaf if set(same_leaf) <= adapted_set else name)
    return sorted(targets)


def peft_targets_match(config: Mapping[str, Any], hf_name: str) -> bool:
    """PEFT's own rule: a string is a full regex match, a list entry an exact name or dotted suffix."""
    def hit(patterns: Any) -> bool:
        if not patterns:
            return False
        if isinstance(patterns, str):
            if patterns == "all-linear":  # PEFT: every linear layer except the output head
                return hf_name.rpartition(".")[2] != "lm_head"
            return re.fullmatch(patterns, hf_name) is not None
        return any(hf_name == p or hf_name.endswith(f".{p}") for p in patterns)

    return hit(config.get("target_modules")) and not hit(config.get("exclude_modules"))


def _require_real(model: nn.Module, what: str) -> None:
    """Copies into meta tensors silently do nothing: refuse instead of losing an adapter."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise PosttuneError(f"{what}: the model is still on the meta device; materialise and load it first")


def _layer_tensors(layer: LoRALinear) -> dict[str, torch.Tensor]:
    tensors = {"lora_A.weight": layer.lora_A.weight, "lora_B.weight": layer.lora_B.weight}
    if layer.magnitude is not None:
        tensors["magnitude"] = layer.magnitude
    return tensors


def _uniform_settings(layers: Mapping[str, LoRALinear]) -> dict[str, Any]:
    """One rank/alpha/dropout/kind for all layers: what one adapter_config.json can express here."""
    found = {(layer.rank, layer.alpha, layer.dropout_p, layer.kind) for layer in layers.values()}
    if len(found) > 1:
        raise PosttuneError(f"save_peft_adapter: adapters differ in (rank, alpha, dropout, kind): {sorted(found)}; "
                            f"the PEFT format written here needs one setting for all layers")
    rank, alpha, dropout, kind = found.pop()
    return {"rank": rank, "alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "dropout_p": dropout, "kind": kind}


def _family_io(model: nn.Module) -> tuple[Any, Any, dict[str, Any]]:
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


def _row_map(convert: Convert, key: str, weight: torch.Tensor, hf_config: Mapping[str, Any]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``convert`` does to the rows of tensor ``key`` (shaped like ``weight``), as a function
    on row-indexed tensors ([out] or [out, k]).

    A converter that hands the weight back as the same object only renames (the usual case).
    Otherwise it is probed with a random tensor: an unchanged probe means a rename too; a
    change that commutes with shuffling columns mixes rows only, so a zero-padded [out, k]
    tensor goes through it exactly. Anything else cannot be followed by a low-rank factor.
    """
    shape = tuple(weight.shape)
    if weight.device.type != "meta":
        plain = weight.detach()
        if _converted(convert, key, plain, hf_config) is plain:  # a rename: the cheap, usual answer
            return lambda tensor: tensor
    probe = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    converted = _converted(convert, key, probe, hf_config)
    if converted.shape == probe.shape and torch.equal(converted, probe):
        return lambda tensor: tensor
    rolled = _converted(convert, key, probe.roll(1, dims=1), hf_config)
    if converted.shape != probe.shape or not torch.allclose(rolled, converted.roll(1, dims=1)):
        raise PosttuneError(f"the checkpoint converter changes '{key}' in a way adapters cannot follow "
                            f"(it mixes columns or changes the shape); merge the adapters "
                            f"(merge_adapters) and save the full model instead")

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.detach().reshape(shape[0], -1)
        out = torch.empty_like(flat)
        for start in range(0, flat.shape[1], shape[1]):  # chunks of the weight's width
            chunk = flat[:, start:start + shape[1]]
            padded = flat.new_zeros(shape)
            padded[:, :chunk.shape[1]] = chunk
            out[:, start:start + chunk.shape[1]] = _converted(convert, key, padded, hf_config)[:, :chunk.shape[1]]
        return out.reshape(tensor.shape)

    return rows


def _converted(convert: Convert, key: str, tensor: torch.Tensor, hf_config: Mapping[str, Any]) -> torch.Tensor:
    result = convert(key, tensor, hf_config)
    if result is None:
        raise PosttuneError(f"the checkpoint converter drops '{key}', which holds an adapter")
    return result[1]


def _check_same(directory: Path, layers: Mapping[str, LoRALinear], targets: list[str],
                settings: Mapping[str, Any]) -> None:
    """A model that already has adapters must have exactly the ones in the directory."""
    if sorted(layers) != sorted(targets):
        missing, extra = sorted(set(targets) - set(layers)), sorted(set(layers) - set(targets))
        raise PosttuneError(f"{directory}: the adapter targets differ from the model's adapters "
                            f"(only in the file: {missing[:3]}; only in the model: {extra[:3]})")
    for name, layer in layers.items():
        mine = {"rank": layer.rank, "alpha": layer.alpha, "dropout_p": layer.dropout_p, "kind": layer.kind}
        if {k: mine[k] for k in ("rank", "alpha", "kind")} != {k: settings[k] for k in ("rank", "alpha", "kind")}:
            raise PosttuneError(f"{directory}: adapter settings {dict(settings)} differ from the model's "
                                f"'{name}' {mine}")


@torch.no_grad()
def _copy_tensors(model: nn.Module, directory: Path, layers: Mapping[str, LoRALinear], hf_names: Mapping[str, str],
                  to_native: Convert, hf_config: Mapping[str, Any]) -> None:
    native_of = {hf: native for native, hf in hf_names.items() if native in layers}
    expected = {(name, suffix) for name, layer in layers.items() for suffix in _layer_tensors(layer)}
    filled = set()
    score = score_labels(model) is not None
    for entry, tensor in iter_tensors(directory / ADAPTER_WEIGHTS):
        key = entry.name.removeprefix(PREFIX)
        if score and key == HF_SCORE:  # a score head saved whole (modules_to_save)
            _copy_whole(model.get_parameter(HEAD), tensor, directory, entry.name)
            filled.add((HEAD, ""))
            continue
        hf_module, suffix = _split_peft_key(key)
        name = native_of.get(hf_module)
        native_suffix = NATIVE_SUFFIX.get(suffix)
        if name is None or (name, native_suffix) not in expected:
            raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: tensor '{entry.name}' belongs to no adapter "
                                f"of this model")
        layer = layers[name]
        target = _layer_tensors(layer)[native_suffix]
        if native_suffix in ROW_INDEXED:
            tensor = _row_map(to_native, f"{hf_module}.weight", layer.base.weight, hf_config)(tensor)
        if tuple(tensor.shape) != tuple(target.shape):
            raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: '{entry.name}' has shape {list(tensor.shape)}, "
                                f"the model's adapter {list(target.shape)}")
        target.copy_(tensor)
        filled.add((name, native_suffix))
    if score:
        expected.add((HEAD, ""))
    missing = sorted(expected - filled)
    if missing:
        shown = ", ".join(f"{name}.{suffix}" for name, suffix in missing[:3])
        raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: missing {len(missing)} adapter tensors ({shown}...)")


def _copy_whole(target: torch.Tensor, tensor: torch.Tensor, directory: Path, name: str) -> None:
    from posttune.checkpoint.materialize import copy_into

    if tuple(tensor.shape) != tuple(target.shape):
        raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: '{name}' has shape {list(tensor.shape)}, "
                            f"the model's score head {list(target.shape)}")
    copy_into(target, tensor)  # under _copy_tensors' no_grad


def _split_peft_key(key: str) -> tuple[str, str]:
    for suffix in NATIVE_SUFFIX:
        if key.endswith(f".{suffix}"):
            return key[:-len(suffix) - 1], suffix
    return key, ""
