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

Fused modules: where the converter joins several native layers into one transformers layer by
stacking their rows (Phi-3's q/k/v into ``qkv_proj``, a ``Join``), the n adapters of rank r are
written as one adapter of rank n*r on the fused layer: ``lora_A`` the parts' A stacked, ``lora_B``
block-diagonal (part i's B in columns i*r..(i+1)*r, zeros elsewhere), the DoRA magnitudes
stacked, and ``rank_pattern``/``alpha_pattern`` giving the fused layer rank n*r and alpha n*alpha,
so PEFT's scale alpha/r is unchanged: the same update, row for row. A part without an adapter
gets zero blocks (LoRA only: a DoRA magnitude for it would be its weight's row norms). Loading
splits such an adapter back, and refuses one of rank n*r that is not block-diagonal. It also takes
PEFT's own adapter on the fused layer (rank r and lora_alpha, trained on the transformers model):
``B @ A`` restricted to a part's rows is that part's rows of B times A, so each part gets a copy of
A and its rows of B at the same rank and scale; DoRA's magnitude and row norm are per output row,
so they split by rows too, exactly.

A targeted ``lm_head`` (an "embedding layer" to PEFT) makes PEFT save its base weight beside the
adapter (``lm_head.base_layer.weight``, for a resized vocabulary) and load it over the model's.
Loading checks that it is this model's head and skips it; another head is refused, since PEFT would
compute with that head, not this one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttune.plugin import (ADAPTER_CONFIG, HF_SCORE, SCORE_HEAD, Fused, Planned, PosttuneError, adapted_modules,
                             copy_into, family_io, hf_modules, iter_tensors, pairs, score_labels,
                             write_file)
from posttune_lora.layer import LoRALinear, apply_lora
from posttune_lora.peft_config import ADAPTER_WEIGHTS, UNSUPPORTED, read_config, settings_of

PREFIX = "base_model.model."
#: PEFT's tensor suffix for each native adapter tensor of a LoRALinear
PEFT_SUFFIX = {"lora_A.weight": "lora_A.weight", "lora_B.weight": "lora_B.weight",
               "magnitude": "lora_magnitude_vector"}
NATIVE_SUFFIX = {**{v: k for k, v in PEFT_SUFFIX.items()},
                 "lora_magnitude_vector.weight": "magnitude"}  # spelling of older PEFT releases
ROW_INDEXED = ("lora_B.weight", "magnitude")  # tensors indexed by the weight's output rows
Convert = Callable[[str, torch.Tensor, Mapping[str, Any]], Any]


def save_peft_adapter(model: nn.Module, directory: Path, *,
                      state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write the model's adapters into ``directory`` so ``peft.PeftModel.from_pretrained(hf_model, directory)``
    loads them (``AdapterKind.save``: the core's ``save_adapter`` gives a fresh folder, adds the tokenizer and
    makes it atomic). ``base_model_name_or_path``: where the model was loaded from (its origin).
    ``state_dict`` (adapter tensors by model key, e.g. gathered from FSDP2/TP shards) replaces
    the layers' own tensors.
    """
    layers = adapted_modules(model)
    if not layers:
        raise PosttuneError("save_peft_adapter: the model has no adapters (apply_adapters first)")
    _require_real(model, "save_peft_adapter")
    settings = _uniform_settings(layers)
    origin, converter, hf_config = family_io(model)
    hf_names, fused = hf_modules(model, converter.from_native, hf_config)
    tensors: dict[str, torch.Tensor] = {}

    def adapter_tensor(name: str, suffix: str) -> torch.Tensor:
        layer = layers[name]
        tensor = state_dict[f"{name}.{suffix}"] if state_dict is not None else _layer_tensors(layer)[suffix]
        if suffix in ROW_INDEXED:
            tensor = _row_map(converter.from_native, f"{name}.weight", layer.base.weight, hf_config)(tensor)
        return tensor.detach().to("cpu")

    for name, layer in layers.items():
        if hf_names[name] not in fused:
            for suffix in _layer_tensors(layer):
                tensors[f"{PREFIX}{hf_names[name]}.{PEFT_SUFFIX[suffix]}"] = adapter_tensor(name, suffix).contiguous()
    patterns = {}
    for hf_name, group in fused.items():
        if any(part in layers for part in group.parts):
            tensors.update(_fused_tensors(model, hf_name, group, layers, adapter_tensor, settings["rank"]))
            patterns[hf_name] = len(group.parts)
    task = "CAUSAL_LM"
    if score_labels(model) is not None:  # the score head, trained whole: PEFT's modules_to_save of SEQ_CLS
        head = state_dict[SCORE_HEAD] if state_dict is not None else model.get_parameter(SCORE_HEAD)
        tensors[f"{PREFIX}{HF_SCORE}"] = head.detach().to("cpu").contiguous()
        task = "SEQ_CLS"
    config = {
        **UNSUPPORTED, "peft_type": "LORA", "task_type": task,
        "base_model_name_or_path": _where_from(origin.source),
        "r": settings["rank"], "lora_alpha": settings["alpha"], "lora_dropout": settings["dropout_p"],
        "use_dora": settings["kind"] == "dora", "use_rslora": settings["rslora"],
        "target_modules": peft_targets([hf_names[n] for n in layers], hf_names.values()),
        "exclude_modules": None, "init_lora_weights": True, "inference_mode": True, "revision": None,
        **fused_patterns(patterns, hf_names.values(), settings["rank"], settings["alpha"], settings["rslora"]),
    }
    if task == "SEQ_CLS":
        config["modules_to_save"] = [HF_SCORE.removesuffix(".weight")]
    planned = [Planned(key, t.dtype, tuple(t.shape)) for key, t in sorted(tensors.items())]
    directory.mkdir(parents=True, exist_ok=True)
    write_file(directory / ADAPTER_WEIGHTS, planned, tensors.__getitem__)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return directory


def load_peft_adapter(model: nn.Module, adapter_dir: str | Path) -> list[str]:
    """Load a PEFT LoRA/DoRA adapter into ``model``; returns the adapted module names.

    A model without adapters gets them (targets, rank, alpha, dropout and kind from
    ``adapter_config.json``); a model that has them (resuming) must have the same ones.
    """
    directory = Path(adapter_dir)
    _require_real(model, "load_peft_adapter")
    config = read_config(directory)
    _, converter, hf_config = family_io(model)
    hf_names, fused = hf_modules(model, converter.from_native, hf_config)
    targets = [name for name, hf_name in hf_names.items() if peft_targets_match(config, hf_name)]
    if not targets:
        raise PosttuneError(f"{directory}: target_modules {config.get('target_modules')!r} match no linear "
                            f"layer of this model")
    settings = settings_of(config)
    ranks = _check_patterns(directory, config, {hf_names[name] for name in targets}, fused, settings)
    layers = adapted_modules(model)
    if layers:  # resuming: a fused layer's adapter may cover parts the model leaves unadapted (zero blocks)
        targets = [name for name in targets if name in layers or hf_names[name] not in fused]
    else:  # fp32 adapters on a half-precision base, as PEFT's autocast_adapter_dtype (its merge is then ours)
        half = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
        apply_lora(model, targets=targets, rank=settings["rank"], alpha=settings["alpha"],
                   dropout=settings["dropout_p"], kind=settings["kind"], rslora=settings["rslora"],
                   dtype=torch.float32 if half else None)  # exact native names
        layers = adapted_modules(model)
    _check_same(directory, layers, targets, settings)
    _copy_tensors(model, directory, layers, hf_names, converter.to_native, hf_config, fused, ranks)
    return list(layers)


def _fused_tensors(model: nn.Module, hf_name: str, group: Fused, layers: Mapping[str, LoRALinear],
                   adapter_tensor: Callable[[str, str], torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """One PEFT adapter of rank n*r for the fused layer ``hf_name`` (the module docstring's layout)."""
    count = len(group.parts)
    missing = [part for part in group.parts if part not in layers]
    kind = next(layers[part].kind for part in group.parts if part in layers)
    if missing and kind == "dora":
        raise PosttuneError(f"save_peft_adapter: DoRA on part of the fused '{hf_name}' (no adapter on {missing}): "
                            f"adapt all of {list(group.parts)} or none")
    a_blocks, b_blocks, magnitudes = [], [], []
    for index, part in enumerate(group.parts):
        rows, width = model.get_submodule(part).weight.shape if part in missing else layers[part].base.weight.shape
        b_block = torch.zeros(rows, count * rank)
        if part in missing:
            a_blocks.append(torch.zeros(rank, width))
        else:
            a_blocks.append(adapter_tensor(part, "lora_A.weight"))
            b_block = b_block.to(a_blocks[-1].dtype)
            b_block[:, index * rank:(index + 1) * rank] = adapter_tensor(part, "lora_B.weight")
            if kind == "dora":
                magnitudes.append(adapter_tensor(part, "magnitude"))
        b_blocks.append(b_block)
    out = {"lora_A.weight": torch.cat([a.to(a_blocks[0].dtype) for a in a_blocks]),
           "lora_B.weight": group.join([b.to(b_blocks[0].dtype) for b in b_blocks])}
    if magnitudes:
        out["magnitude"] = group.join(magnitudes)
    rows = sum(block.shape[0] for block in b_blocks)
    if tuple(out["lora_B.weight"].shape) != (rows, count * rank):
        raise PosttuneError(f"save_peft_adapter: the converter's join for '{hf_name}' does not stack rows, so its "
                            f"adapters cannot be fused (merge the adapters and save the full model instead)")
    return {f"{PREFIX}{hf_name}.{PEFT_SUFFIX[suffix]}": tensor.contiguous() for suffix, tensor in out.items()}


def fused_patterns(counts: Mapping[str, int], all_linear: Any, rank: int, alpha: Any,
                   rslora: bool = False) -> dict[str, Any]:
    """``rank_pattern``/``alpha_pattern`` giving each fused layer (name -> its number of parts) rank n*r
    and the alpha that keeps its parts' scale (`fused_alpha`); keyed by the last name part (PEFT matches
    a key as a dotted suffix) when every layer of that name is fused from the same number of parts, else
    by the full name."""
    keys: dict[str, int] = {}
    everything = list(all_linear)
    for name, count in counts.items():
        leaf = name.rpartition(".")[2]
        same_leaf = {n for n in everything if n == leaf or n.endswith(f".{leaf}")}
        uniform = same_leaf <= set(counts) and {counts[n] for n in same_leaf} == {count}
        keys[leaf if uniform else name] = count
    return {"rank_pattern": {key: count * rank for key, count in sorted(keys.items())},
            "alpha_pattern": {key: fused_alpha(count, alpha, rslora) for key, count in sorted(keys.items())}}


def fused_alpha(count: int, alpha: Any, rslora: bool) -> Any:
    """The alpha of a layer fused from ``count`` parts of rank r each (rank count*r) whose scale is each
    part's: ``count * alpha`` keeps ``alpha / r``; rank-stabilised, ``sqrt(count) * alpha`` keeps
    ``alpha / sqrt(r)``."""
    return math.sqrt(count) * alpha if rslora else count * alpha


def _pattern_value(patterns: Mapping[str, Any] | None, hf_name: str, default: Any) -> Any:
    """PEFT's rule for ``rank_pattern``/``alpha_pattern``: the first key that matches as a dotted suffix regex."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", hf_name):
            return value
    return default


def _check_patterns(directory: Path, config: Mapping[str, Any], adapted: set[str], fused: Mapping[str, Fused],
                    settings: Mapping[str, Any]) -> dict[str, int]:
    """Every adapted layer's rank and alpha, after PEFT's patterns, are r and alpha (one rank and alpha: all that
    posttune's per-layer adapters hold), or, on a layer fused from n native ones, n*r and `fused_alpha` (posttune's
    block-diagonal export). Without patterns nothing can differ. Returns each fused layer's rank in the file."""
    ranks = {}
    for hf_name in sorted(adapted):
        count = len(fused[hf_name].parts) if hf_name in fused else 1
        rank = _pattern_value(config.get("rank_pattern"), hf_name, settings["rank"])
        alpha = _pattern_value(config.get("alpha_pattern"), hf_name, settings["alpha"])
        forms = {count * settings["rank"]: fused_alpha(count, settings["alpha"], settings["rslora"]),
                 settings["rank"]: settings["alpha"]}
        if rank not in forms or not math.isclose(float(alpha), forms[rank], rel_tol=1e-9):
            times = f"sqrt({count})" if settings["rslora"] else str(count)
            joined = f", or (fused from {count} layers) rank {count} x r and alpha {times} x lora_alpha" * (count > 1)
            raise PosttuneError(f"{directory / ADAPTER_CONFIG}: '{hf_name}' has rank {rank} and alpha {alpha:g} after "
                                f"rank_pattern/alpha_pattern; expected rank r and lora_alpha{joined} (posttune's "
                                f"adapters share one rank and alpha)")
        if hf_name in fused:
            ranks[hf_name] = rank
    return ranks


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


def _layer_tensors(layer: LoRALinear) -> dict[str, torch.Tensor]:
    tensors = {"lora_A.weight": layer.lora_A.weight, "lora_B.weight": layer.lora_B.weight}
    if layer.magnitude is not None:
        tensors["magnitude"] = layer.magnitude
    return tensors


def _uniform_settings(layers: Mapping[str, LoRALinear]) -> dict[str, Any]:
    """One rank/alpha/dropout/kind for all layers: what one adapter_config.json can express here."""
    found = {(layer.rank, layer.alpha, layer.dropout_p, layer.kind, layer.rslora) for layer in layers.values()}
    if len(found) > 1:
        raise PosttuneError(f"save_peft_adapter: adapters differ in (rank, alpha, dropout, kind, rslora): "
                            f"{sorted(found)}; the PEFT format written here needs one setting for all layers")
    rank, alpha, dropout, kind, rslora = found.pop()
    return {"rank": rank, "alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "dropout_p": dropout, "kind": kind, "rslora": rslora}


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
        mine = {"rank": layer.rank, "alpha": layer.alpha, "dropout_p": layer.dropout_p, "kind": layer.kind,
                "rslora": layer.rslora}
        same = ("rank", "alpha", "kind", "rslora")
        if {k: mine[k] for k in same} != {k: settings[k] for k in same}:
            raise PosttuneError(f"{directory}: adapter settings {dict(settings)} differ from the model's "
                                f"'{name}' {mine}")


@torch.no_grad()
def _copy_tensors(model: nn.Module, directory: Path, layers: Mapping[str, LoRALinear], hf_names: Mapping[str, str],
                  to_native: Convert, hf_config: Mapping[str, Any], fused: Mapping[str, Fused],
                  ranks: Mapping[str, int]) -> None:
    native_of = {hf: native for native, hf in hf_names.items() if native in layers and hf not in fused}
    expected = {(name, suffix) for name, layer in layers.items() for suffix in _layer_tensors(layer)}
    filled = set()
    score = score_labels(model) is not None
    held: dict[str, dict[str, torch.Tensor]] = {}  # a fused layer's tensors, split once all are read
    for entry, tensor in iter_tensors(directory / ADAPTER_WEIGHTS):
        key = entry.name.removeprefix(PREFIX)
        if score and key == HF_SCORE:  # a score head saved whole (modules_to_save)
            _copy_whole(model.get_parameter(SCORE_HEAD), tensor, directory, entry.name)
            filled.add((SCORE_HEAD, ""))
            continue
        hf_module, _, param = key.partition(".base_layer.")
        if param and hf_module in native_of:  # PEFT's copy of a targeted head's base weight
            _check_base_copy(directory, entry.name, getattr(layers[native_of[hf_module]].base, param, None),
                             _converted(to_native, f"{hf_module}.{param}", tensor, hf_config))
            continue
        hf_module, suffix = _split_peft_key(key)
        name = native_of.get(hf_module)
        native_suffix = NATIVE_SUFFIX.get(suffix)
        if hf_module in fused and native_suffix is not None:
            held.setdefault(hf_module, {})[native_suffix] = tensor
            continue
        if name is None or (name, native_suffix) not in expected:
            module = re.sub(r"\.(base_layer|lora_\w+)(\.\w+)*$", "", hf_module)  # the module, not its tensor
            why = (f": '{module}' is no linear layer posttune adapts (an embedding, say; adapter_config.json "
                   "target_modules names it)" if name is None else "")
            raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: tensor '{entry.name}' belongs to no adapter "
                                f"of this model{why}")
        layer = layers[name]
        target = _layer_tensors(layer)[native_suffix]
        if native_suffix in ROW_INDEXED:
            tensor = _row_map(to_native, f"{hf_module}.weight", layer.base.weight, hf_config)(tensor)
        if tuple(tensor.shape) != tuple(target.shape):
            raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: '{entry.name}' has shape {list(tensor.shape)}, "
                                f"the model's adapter {list(target.shape)}")
        copy_into(target, tensor)  # a sharded (FSDP2, TP) adapter takes its own shard
        filled.add((name, native_suffix))
    for hf_module, tensors in held.items():
        filled |= _copy_fused(directory, hf_module, fused[hf_module], tensors, layers, to_native, hf_config,
                              ranks[hf_module])
    if score:
        expected.add((SCORE_HEAD, ""))
    missing = sorted(expected - filled)
    if missing:
        shown = ", ".join(f"{name}.{suffix}" for name, suffix in missing[:3])
        raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: missing {len(missing)} adapter tensors ({shown}...)")


def _copy_fused(directory: Path, hf_module: str, group: Fused, tensors: Mapping[str, torch.Tensor],
                layers: Mapping[str, LoRALinear], to_native: Convert, hf_config: Mapping[str, Any], file_rank: int
                ) -> set[tuple[str, str]]:
    """Split one fused layer's adapter of rank ``file_rank`` into its parts' (the module docstring's layouts:
    block-diagonal of rank n*r, or PEFT's own dense one of rank r); what was filled."""
    where = f"{directory / ADAPTER_WEIGHTS}: '{hf_module}'"
    adapted = [part for part in group.parts if part in layers]
    rank = layers[adapted[0]].rank if adapted else 0
    if not adapted or "lora_A.weight" not in tensors or "lora_B.weight" not in tensors:
        raise PosttuneError(f"{where}: an adapter on a layer this model does not adapt, or missing lora_A/lora_B")
    a, b = tensors["lora_A.weight"], tensors["lora_B.weight"]
    if a.shape[0] != file_rank or b.shape[1] != file_rank:
        raise PosttuneError(f"{where}: lora_A has rank {a.shape[0]} and lora_B {b.shape[1]}; {ADAPTER_CONFIG} "
                            f"gives it rank {file_rank}")
    dense = file_rank == rank  # PEFT's own: every part takes all of A

    def split(tensor: torch.Tensor) -> dict[str, torch.Tensor]:  # row-indexed tensor -> each part's rows
        return {key.removesuffix(".weight"): value for key, value in pairs(to_native(f"{hf_module}.weight", tensor,
                                                                                      hf_config))}

    rows_b = split(b)
    magnitudes = split(tensors["magnitude"]) if "magnitude" in tensors else {}
    filled = set()
    for index, part in enumerate(group.parts):
        block = slice(None) if dense else slice(index * rank, (index + 1) * rank)
        outside = rows_b[part].clone()
        outside[:, block] = 0
        if outside.count_nonzero():
            raise PosttuneError(f"{where}: lora_B is not block-diagonal over {list(group.parts)} (rank {file_rank} "
                                f"on the fused layer itself); posttune adapts each part at rank {rank}: merge this "
                                f"adapter into the model with PEFT instead")
        if part not in layers:
            if rows_b[part].count_nonzero() or magnitudes:
                raise PosttuneError(f"{where}: the adapter changes '{part}', which this model does not adapt; "
                                    f"adapt all of {list(group.parts)}")
            continue
        mine = _layer_tensors(layers[part])
        values = {"lora_A.weight": a[block], "lora_B.weight": rows_b[part][:, block]}
        if "magnitude" in mine:
            if part not in magnitudes:
                raise PosttuneError(f"{where}: no lora_magnitude_vector for the DoRA adapter of '{part}'")
            values["magnitude"] = magnitudes[part]
        for suffix, value in values.items():
            if tuple(value.shape) != tuple(mine[suffix].shape):
                raise PosttuneError(f"{where}: '{part}' {suffix} has shape {list(value.shape)}, the model's adapter "
                                    f"{list(mine[suffix].shape)}")
            copy_into(mine[suffix], value)
            filled.add((part, suffix))
    return filled


def _check_base_copy(directory: Path, key: str, base: torch.Tensor | None, saved: torch.Tensor) -> None:
    """PEFT's copy of a targeted head's base weight (the module docstring) must be this model's: PEFT loads it
    over the model's head, so another one (a resized vocabulary, another base) would compute something else.
    Compared to the rounding of the coarser dtype, as either side may have been cast; a DTensor as a whole."""
    if base is None:
        raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: tensor '{key}' belongs to no adapter of this model")
    full = base.full_tensor() if hasattr(base, "full_tensor") else base
    eps = max(torch.finfo(saved.dtype).eps, torch.finfo(full.dtype).eps)
    if saved.shape != full.shape or not torch.allclose(saved.to(full), full, rtol=eps, atol=1e-6):
        raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: '{key}', PEFT's copy of the base layer (which PEFT loads "
                            f"over the model's), differs from this model's: the adapter was saved on another base "
                            f"(or a resized vocabulary); load it on that one")


def _copy_whole(target: torch.Tensor, tensor: torch.Tensor, directory: Path, name: str) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise PosttuneError(f"{directory / ADAPTER_WEIGHTS}: '{name}' has shape {list(tensor.shape)}, "
                            f"the model's score head {list(target.shape)}")
    copy_into(target, tensor)  # under _copy_tensors' no_grad


def _split_peft_key(key: str) -> tuple[str, str]:
    for suffix in NATIVE_SUFFIX:
        if key.endswith(f".{suffix}"):
            return key[:-len(suffix) - 1], suffix
    return key, ""


def _where_from(source: str | None) -> str | None:
    """The base model as a later command can find it from any folder: a local checkpoint by its absolute
    path (``model.path: tiny`` would name whatever ``tiny`` is where `posttune generate` runs), a hub id as it is."""
    if source is None or not Path(source).expanduser().is_dir():
        return source
    return str(Path(source).expanduser().resolve())


def _require_real(model: nn.Module, what: str) -> None:
    """Copies into meta tensors silently do nothing: refuse instead of losing an adapter."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise PosttuneError(f"{what}: the model is still on the meta device; materialise and load it first")
