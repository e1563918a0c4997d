"""Save a native model as a Hugging Face checkpoint that transformers loads.

Writes, into a temporary directory renamed into place (see atomic.py):
``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards plus
``model.safetensors.index.json`` when the weights exceed ``max_shard_size``), ``config.json``
(the source config with its dtype updated, or the family's ``to_hf_config``),
``generation_config.json``, and the tokenizer's files when a tokenizer is given.

Tensors are converted to HF names one at a time, twice: once to plan the shards (names,
shapes, dtypes, for the headers) and once while writing, in the same order, so at most one
converted tensor exists at a time (and, for a many-to-one converter, the parts it holds until
the last arrives: views of the model's own tensors).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttune.checkpoint import score_head
from posttune.checkpoint.atomic import atomic_dir
from posttune.checkpoint.convert import Joiner
from posttune.checkpoint.hf_load import FORMAT, GENERATION_CONFIG, INDEX_FILE, SINGLE_FILE
from posttune.checkpoint.origin import ModelOrigin, origin_of
from posttune.checkpoint.safetensors_io import Planned, write_file
from posttune.descriptors import CheckpointConverter, ModelFamily
from posttune.errors import PosttuneError

#: Shards of at most 5 GB by default: what the hub and transformers 4.x use, small enough to
#: download and resume comfortably (transformers 5 defaults to 50 GB).
DEFAULT_MAX_SHARD_SIZE = "5GB"
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def save_hf(model: nn.Module, out_dir: str | Path, *, tokenizer: Any = None,
            max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
            state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` (built by posttune) as an HF checkpoint at ``out_dir``; return the path.

    ``state_dict`` replaces the model's own tensors, for a sharded model whose full state was
    gathered first (``posttune.training.distributed.full_state_dict``); the model still gives
    the family, config and tied weights.
    """
    from posttune.plugins import get_registry

    origin = origin_of(model)
    registry = get_registry()
    family: ModelFamily = registry.get("model_family", origin.family)
    converter: CheckpointConverter = registry.get("checkpoint_converter", f"{origin.family}:{FORMAT}")
    tensors = native_tensors(model, state_dict)
    config = hf_config_for(origin, family, tensors.values())
    if origin.hf_config is None and tokenizer is not None:  # built from a size: the run's tokenizer has the ids
        config = {**config, **{key: value for key, value in _token_ids(tokenizer).items() if config.get(key) is None}}
    labels = origin.extra.get(score_head.LABELS)
    if labels is not None:  # a reward or value model: saved as transformers' sequence classifier
        converter = score_head.score_converter(converter)
        config = score_head.score_config(config, labels, _pad_id(tokenizer))
    planned = _plan(tensors, converter, config)
    shards = split_shards(planned, parse_size(max_shard_size))
    stream = converted(tensors, converter, config)  # shards are written in plan order

    def produce(hf_key: str) -> torch.Tensor:
        _, key, value = next(stream)
        if key != hf_key:
            raise RuntimeError(f"converter '{converter.name}' gave '{key}' where it planned '{hf_key}'")
        return value

    with atomic_dir(out_dir, replaceable=("config.json", SINGLE_FILE, INDEX_FILE)) as tmp:
        names = shard_names(len(shards))
        for name, shard in zip(names, shards, strict=True):
            write_file(tmp / name, shard, produce)
        if len(shards) > 1:
            _write_json(tmp / INDEX_FILE, _index(shards, names))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / GENERATION_CONFIG, generation_config_for(origin, config))
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
    return Path(out_dir)


def native_tensors(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
    """The state to save, each tensor once: a tied weight is kept under its first name only.

    transformers drops tied duplicates (``lm_head.weight`` when ``tie_word_embeddings``) the
    same way and re-ties them on load. A gathered ``state_dict`` holds copies, so its tied
    duplicates are found by the model's tie groups instead of by identity.
    """
    if state_dict is not None:
        from posttune.checkpoint.materialize import tie_groups

        duplicates = {name for group in tie_groups(model) for name in group[1:]}
        return {name: tensor for name, tensor in state_dict.items() if name not in duplicates}
    seen: set[int] = set()
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        kept[name] = tensor
    return kept


def hf_config_for(origin: ModelOrigin, family: ModelFamily, tensors: Any) -> dict[str, Any]:
    """config.json: the source's own (keeps fields posttune does not model), dtype updated."""
    if origin.hf_config is not None:
        config = dict(origin.hf_config)
    elif family.to_hf_config is not None:
        config = dict(family.to_hf_config(origin.build_kwargs))
    else:
        raise PosttuneError(f"model family '{family.name}' cannot write config.json (it has no to_hf_config); "
                            f"load the model from a checkpoint to save it")
    dtype = _main_dtype(tensors)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
        if "torch_dtype" in config:  # older transformers read only this key
            config["torch_dtype"] = config["dtype"]
    return config


def _main_dtype(tensors: Any) -> torch.dtype | None:
    """The floating dtype holding most bytes: the checkpoint's dtype as transformers reads it."""
    weights: Counter[torch.dtype] = Counter()
    for tensor in tensors:
        if tensor.is_floating_point():
            weights[tensor.dtype] += tensor.numel() * tensor.element_size()
    return weights.most_common(1)[0][0] if weights else None


def generation_config_for(origin: ModelOrigin, config: Mapping[str, Any]) -> dict[str, Any]:
    """The source's generation_config.json, or one derived from config.json's token ids."""
    if origin.generation_config is not None:
        return dict(origin.generation_config)
    derived: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            derived[key] = config[key]
    return derived


def hf_tensors(family: str, state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for a plain native state dict of ``family`` (``plain_state_dict``), made one at
    a time by the family's converter (splits and joins included): for an engine that loads a
    family's weights under Hugging Face names (an inference engine's copy), with no checkpoint written."""
    from posttune.plugins import get_registry

    converter: CheckpointConverter = get_registry().get("checkpoint_converter", f"{family}:{FORMAT}")
    for _, hf_key, tensor in converted(state, converter, hf_config):
        yield hf_key, tensor


def converted(tensors: Mapping[str, torch.Tensor], converter: CheckpointConverter,
              config: Mapping[str, Any]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(native key, HF key, tensor) for every HF tensor, in a fixed order, made one at a time."""
    joiner = Joiner(converter.from_native, config)
    for key, tensor in tensors.items():
        yield from joiner(key, tensor.detach())
    joiner.finish(f"converter '{converter.name}': the model is incomplete")


def _plan(tensors: Mapping[str, torch.Tensor], converter: CheckpointConverter,
          config: Mapping[str, Any]) -> list[Planned]:
    planned, native_of = [], {}
    for key, hf_key, value in converted(tensors, converter, config):
        if hf_key in native_of:
            raise PosttuneError(f"converter '{converter.name}' maps both '{native_of[hf_key]}' and '{key}' "
                                f"to '{hf_key}'")
        planned.append(Planned(hf_key, value.dtype, tuple(value.shape)))
        native_of[hf_key] = key
        del value
    return planned


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or "5GB" / "500MB" / "2GiB" as transformers writes them."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if not match or float(match[1]) <= 0:
        raise PosttuneError(f"max_shard_size: expected bytes or a size like '5GB', got {size!r}")
    return int(float(match[1]) * UNITS[(match[2] or "").upper()])


def split_shards(planned: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Consecutive tensors packed greedily; a tensor larger than the limit gets a shard alone."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for item in planned:
        if shards[-1] and size + item.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _index(shards: list[list[Planned]], names: list[str]) -> dict[str, Any]:
    total = sum(item.nbytes for shard in shards for item in shard)
    weight_map = {item.name: name for name, shard in zip(names, shards, strict=True) for item in shard}
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def _token_ids(tokenizer: Any) -> dict[str, Any]:
    """config.json's bos/eos/pad ids from a posttune tokenizer (every stop token: Llama 3's ``[eos, eot]``), so that
    transformers' ``generate`` stops where ``posttune generate`` does (LlamaConfig's defaults are 1 and 2)."""
    eos = list(getattr(tokenizer, "eos_ids", []) or [])
    token_id = getattr(tokenizer, "token_id", lambda name: None)
    ids = {"bos_token_id": getattr(tokenizer, "bos_id", None), "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
           "pad_token_id": token_id("pad_token")}
    return {key: value for key, value in ids.items() if value is not None}


def _pad_id(tokenizer: Any) -> int | None:
    if tokenizer is None:
        return None
    from posttune.data import pad_id

    return pad_id(tokenizer)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """posttune's Tokenizer has ``save(dir)``; an HF tokenizer has ``save_pretrained(dir)``."""
    save = getattr(tokenizer, "save", None) or getattr(tokenizer, "save_pretrained", None)
    if save is None:
        raise PosttuneError(f"tokenizer: {type(tokenizer).__name__} has no save() or save_pretrained()")
    save(str(directory))
