"""Load a Hugging Face checkpoint (config.json + single or sharded safetensors) as a native model.

The order is chosen so that every mistake is reported before memory is spent:

    config.json (for a hub id, that file alone) -> family (by `architectures`) -> converter
    (`FAMILY:hf`) -> build kwargs and dtype -> model on the meta device -> (hub: download)
    -> every shard the index names exists -> every tensor's native name and shape checked
    from the safetensors headers alone -> storage allocated once -> tensors streamed in, shard
    by shard, tensor by tensor -> nothing missing -> non-persistent buffers recomputed

``load_into`` runs the same checks and streaming for a model the trainer already built,
adapted and sharded.

A quantized checkpoint (config.json ``quantization_config.quant_method``, as transformers
writes it) is read by the plugin registered for that method (``QuantizedFormat``) and its
tensors assigned to the meta model as they are (``_load_quantized``); it is for inference, so
``load_into`` refuses it.

Peak memory is the model itself when the converter only renames tensors (they are read
straight into the parameters' storage), else the model plus the largest single tensor (and
its converted copy), plus the parts a many-to-one converter holds until its last part arrives
(convert.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttune.checkpoint import materialize as mat
from posttune.checkpoint.convert import Joiner, first_key
from posttune.checkpoint.keymap import BASE, base_key
from posttune.checkpoint.materialize import copy_into, holds
from posttune.checkpoint import score_head, source
from posttune.checkpoint.origin import ModelOrigin, attach, origin_of
from posttune.checkpoint.safetensors_io import Entry, fits, iter_tensors, read_header
from posttune.descriptors import CheckpointConverter, ModelFamily, QuantizedFormat
from posttune.errors import PosttuneError

FORMAT = "hf"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
SHOWN = 5  # names listed in one error line before "and N more"


def load_hf(path_or_id: str | Path, *, dtype: torch.dtype | str | None = None,
            device: torch.device | str | None = None, family: str | None = None) -> nn.Module:
    """A native model with the checkpoint's weights, in eval mode, remembering its origin."""
    ckpt = _open(path_or_id, family)
    kwargs = source.family_kwargs(ckpt.family, ckpt.hf_config)
    dtype = mat.resolve_dtype(dtype, ckpt.hf_config)
    model = mat.build(ckpt.family.build, kwargs, dtype, "meta")
    attach(model, ModelOrigin(ckpt.family.name, kwargs, ckpt.hf_config, source=ckpt.where))
    labels = score_head.checkpoint_labels(ckpt.hf_config)
    if labels is not None:
        score_head.add_score_head(model, labels)
        ckpt.converter = score_head.score_converter(ckpt.converter)
    if ckpt.quantized is not None:  # a plugin rebuilds the quantized tensors (checkpoint/quantized.py)
        ckpt.fetch()
        _load_quantized(model, ckpt.quantized, list(ckpt.headers), ckpt.converter, ckpt.hf_config, dtype,
                       device or "cpu", ckpt.where)
    else:
        loader = _Loader(model, ckpt.converter, ckpt.hf_config, ckpt.where)
        loader.precheck(ckpt.fetch())
        mat.materialize(model, device or "cpu")
        loader.load(ckpt.headers)
        mat.init_buffers(model)
    attach(model, ModelOrigin(ckpt.family.name, kwargs, ckpt.hf_config, generation_config(ckpt.directory),
                              ckpt.where, origin_of(model).extra))  # keeps the score head's labels
    return model.eval()


def load_into(model: nn.Module, path_or_id: str | Path, *, family: str | None = None) -> dict[str, torch.Tensor]:
    """Fill an already materialised model with a checkpoint's weights, in place.

    For the trainer, which builds, adapts and shards the model before loading (docs/architecture.md, "Composition"):
    adapter tensors (LoRA/DoRA) are not expected from the checkpoint and an adapted layer's
    ``base`` receives the base weight; DTensor (FSDP2/TP) parameters receive their own shard.
    Non-persistent buffers are the caller's (``posttune.modules.init_buffers``). A model with a score
    head (``checkpoint/score_head.py``) takes a sequence classifier's ``score``, or from a causal
    checkpoint nothing for its head: returned, those tensors by native name, for the caller to initialise.
    """
    ckpt = _open(path_or_id, family)
    fresh: set[str] = set()
    if score_head.score_labels(model) is not None:
        ckpt.converter = score_head.score_converter(ckpt.converter)
        if score_head.checkpoint_labels(ckpt.hf_config) is None:
            fresh.add(score_head.SCORE_HEAD)
    if ckpt.quantized is not None:
        raise PosttuneError(f"{ckpt.where}: a '{ckpt.quantized.name}'-quantized checkpoint is for inference "
                            f"(load_model, posttune generate); train from the float checkpoint it was exported from")
    loader = _Loader(model, ckpt.converter, ckpt.hf_config, ckpt.where, fresh)
    loader.precheck(ckpt.fetch())
    loader.load(ckpt.headers)
    return {name: loader.targets[name] for name in fresh}


@dataclass
class _Checkpoint:
    """A checkpoint whose config, family and converter are known; weights fetched on demand."""

    path_or_id: str | Path
    where: str
    hf_config: dict[str, Any]
    family: ModelFamily
    converter: CheckpointConverter
    quantized: QuantizedFormat | None = None  # the reader of config.json's quant_method, if it names one
    directory: Path | None = None
    headers: dict[Path, list[Entry]] | None = None

    def fetch(self) -> dict[Path, list[Entry]]:
        """Download (hub ids) and read every shard's header; only now that all else is known."""
        self.directory = source.local_dir(self.path_or_id)
        self.headers = {shard: read_header(shard) for shard in shard_files(self.directory, self.where)}
        return self.headers


def _open(path_or_id: str | Path, family: str | None) -> _Checkpoint:
    """config.json (for a hub id, that file alone), the family reading it and its converter."""
    from posttune.plugins import get_registry

    where = str(path_or_id)
    hf_config = source.read_hf_config(path_or_id)
    registry = get_registry()
    fam: ModelFamily = (registry.get("model_family", family) if family is not None
                        else source.family_for(hf_config, registry, where).descriptor)
    converter = registry.get("checkpoint_converter", f"{fam.name}:{FORMAT}")
    method = source.quant_method(hf_config, where)
    if method is not None and method not in registry.names("quantized_format"):  # say what to load instead
        unknown = registry.unknown("quantized_format", method)
        raise type(unknown)(f"{where}: config.json's quantization_config: {unknown}; or load the float checkpoint "
                            "it was made from (QLoRA quantizes one itself: docs/memory.md)")
    quantized = registry.get("quantized_format", method) if method is not None else None
    return _Checkpoint(path_or_id, where, hf_config, fam, converter, quantized)


def shard_files(directory: Path, where: str) -> list[Path]:
    """The safetensors files of a checkpoint, in order; every file the index names must exist. A single
    ``model.safetensors`` wins over an index beside it, as in transformers (a stale index must not pick old shards)."""
    index = directory / INDEX_FILE
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PosttuneError(f"{where}: unreadable {INDEX_FILE}: {type(exc).__name__}: {exc}") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise PosttuneError(f"{where}: shard {_names(missing)} listed in {INDEX_FILE} is missing")
        return files
    others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    hint = (f" (found {_names(others)}: posttune loads safetensors only, never pickles; transformers converts them: "
            "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder))") if others else ""
    raise PosttuneError(f"{where}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")


@dataclass
class _Loader:
    """Checks and copies checkpoint tensors into a model's state, tracking what was filled."""

    model: nn.Module
    converter: CheckpointConverter
    hf_config: Mapping[str, Any]
    where: str
    fresh: set[str] = field(default_factory=set)  # native names the caller initialises (a new score head)

    def __post_init__(self) -> None:
        self.targets = checkpoint_targets(self.model)
        # Tied weights appear under several names; any of them fills the one tensor.
        self.canonical = {base_key(name): base_key(group[0]) for group in mat.tie_groups(self.model)
                          for name in group}
        self.loaded: set[str] = set()
        #: checkpoint names whose tensor the converter passes through untouched, by native name:
        #: their bytes can go straight into the parameter
        self.renamed: dict[str, str] = {}
        self.sources: dict[str, str] = {}  # the checkpoint name that filled each native weight first

    def _joiner(self) -> Joiner:
        return Joiner(self.converter.to_native, self.hf_config)

    def precheck(self, headers: Mapping[Path, Iterable[Entry]]) -> None:
        """Every name and shape, from the headers alone, while the model is still on meta.

        Converters are plain tensor code, so they run on meta tensors; one that cannot is
        skipped here and checked tensor by tensor while streaming instead.
        """
        seen, unexpected, joiner = set(), [], self._joiner()
        for shard, entries in headers.items():
            for entry in entries:
                probe = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
                try:
                    converted = list(self._converted(joiner, entry.name, probe))
                except (NotImplementedError, RuntimeError):
                    self.renamed.clear()
                    return
                if len(converted) == 1 and converted[0][2] is probe:
                    self.renamed[entry.name] = converted[0][1]
                for hf_key, key, value in converted:
                    if key not in self.targets:
                        unexpected.append(_label(hf_key, key))
                        continue
                    self._check_shape(hf_key, shard, key, value)
                    seen.add(self._key(key))
        if unexpected:
            raise PosttuneError(f"{self.where}: unexpected tensor {_names(unexpected)} in the checkpoint: "
                                f"the model has no such weight")
        joiner.finish(f"{self.where}: the checkpoint is incomplete")
        self._check_missing(seen)

    def load(self, headers: Mapping[Path, Iterable[Entry]]) -> None:
        """Stream every shard in and check nothing is missing."""
        self.targets = checkpoint_targets(self.model)  # the real storage, after to_empty
        joiner = self._joiner()  # a join's parts may lie in different shards
        for shard, entries in headers.items():
            self.stream(shard, entries, joiner)
        joiner.finish(f"{self.where}: the checkpoint is incomplete")
        self._check_missing(self.loaded)

    def stream(self, shard: Path, entries: Iterable[Entry], joiner: Joiner) -> None:
        for entry, tensor in iter_tensors(shard, entries, into=self._in_place):
            key = self.renamed.get(entry.name)
            if key is not None and tensor is self.targets.get(key):  # read in place: nothing to copy
                self.loaded.add(self._key(key))
                self.sources.setdefault(self._key(key), entry.name)
                continue
            for hf_key, key, value in self._converted(joiner, entry.name, tensor):  # one at a time, as split
                if key not in self.targets:
                    raise PosttuneError(f"{self.where}: unexpected tensor {_label(hf_key, key)} in "
                                        f"{shard.name}: the model has no such weight")
                self._check_shape(hf_key, shard, key, value)
                if self._key(key) in self.loaded:  # a tied weight's second name: it must hold the same values
                    self._check_tied(hf_key, key, value)
                copy_into(self.targets[key], value)
                self.loaded.add(self._key(key))
                self.sources.setdefault(self._key(key), hf_key)
                del value
            del tensor

    def _converted(self, joiner: Joiner, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, str, Any]]:
        """What the converter makes of one checkpoint tensor; its refusal names this checkpoint."""
        try:
            yield from joiner(name, tensor)
        except PosttuneError as exc:
            raise PosttuneError(f"{self.where}: {exc}") from None

    def _in_place(self, entry: Entry) -> torch.Tensor | None:
        """The parameter to read ``entry`` into directly, when only its name changes."""
        key = self.renamed.get(entry.name)
        target = self.targets.get(key) if key is not None else None
        plain = target is not None and type(target.data) is torch.Tensor  # not a DTensor or quantised
        tied_again = key is not None and self._key(key) in self.loaded  # compared first, not read over the first
        return target if plain and not tied_again and fits(target, entry) else None

    def _check_tied(self, hf_key: str, key: str, value: torch.Tensor) -> None:
        """transformers unties weights a checkpoint stores twice with different values (a head trained apart from
        the embedding, config.json still tied); loading one over the other would lose a trained weight."""
        if not holds(self.targets[key], value):
            raise PosttuneError(f"{self.where}: the checkpoint holds '{self.sources[self._key(key)]}' and '{hf_key}' "
                                "with different values, but the model ties them into one weight (config.json's "
                                "tie_word_embeddings): set it to false in config.json to load both, as transformers "
                                "does")

    def _key(self, name: str) -> str:
        return self.canonical.get(name, name)

    def _check_shape(self, hf_key: str, shard: Path, key: str, value: torch.Tensor) -> None:
        want = tuple(self.targets[key].shape)
        if tuple(value.shape) != want:
            raise PosttuneError(f"{self.where}: tensor {_label(hf_key, key)} in {shard.name} has shape "
                                f"{list(value.shape)}; the model expects {list(want)}")

    def _check_missing(self, filled: set[str]) -> None:
        missing = sorted({self._key(name) for name in self.targets} - filled - self.fresh)
        if missing:
            labels = [_label(hf_name(self.converter, key, self.targets[key], self.hf_config), key) for key in missing]
            raise PosttuneError(f"{self.where}: missing tensor {_names(labels)}: the checkpoint does not "
                                f"provide {'it' if len(missing) == 1 else 'them'}")


def hf_name(converter: CheckpointConverter, key: str, target: torch.Tensor, hf_config: Mapping[str, Any]) -> str:
    """The checkpoint-side name of a native weight, for messages (the native name if unknown)."""
    try:
        return first_key(converter.from_native(key, torch.empty_like(target, device="meta"), hf_config)) or key
    except Exception:  # noqa: BLE001 - only a nicer message is at stake
        return key


def _load_quantized(model: nn.Module, reader: QuantizedFormat, files: list[Path], converter: CheckpointConverter,
                   hf_config: Mapping[str, Any], dtype: torch.dtype, device: torch.device | str,
                   where: str) -> None:
    """Fill a meta-device ``model`` with the tensors ``reader`` rebuilds from ``files``.

    Quantized weights are tensor subclasses of a quantization library (torchao's ``Int8Tensor``),
    stored as several plain tensors plus metadata that only that library can rebuild: the plugin
    registered under config.json's ``quant_method`` reads them (``QuantizedFormat``); names,
    shapes and completeness are checked here as for a float checkpoint. The model stays on the
    meta device and each tensor is *assigned* to its slot as a frozen parameter, never copied
    into float storage, so loading an int8 export needs about its own size in memory. Plain
    tensors (norms, embeddings, the output head) take ``dtype``; quantized ones keep what they hold.
    """
    targets = checkpoint_targets(model)
    groups = mat.tie_groups(model)
    canonical = {name: group[0] for group in groups for name in group}
    filled: set[str] = set()
    joiner = Joiner(converter.to_native, hf_config)
    for hf_key, key, value in (item for pair in reader.read(files) for item in joiner(*pair)):
        key = canonical.get(key, key)
        if key not in targets:
            raise PosttuneError(f"{where}: unexpected tensor {_label(hf_key, key)} in the checkpoint: the model "
                                f"has no such weight")
        if tuple(value.shape) != tuple(targets[key].shape):
            raise PosttuneError(f"{where}: tensor {_label(hf_key, key)} has shape {list(value.shape)}; the model "
                                f"expects {list(targets[key].shape)}")
        _assign(model, key, _placed(value, dtype, device))
        filled.add(key)
    joiner.finish(f"{where}: the checkpoint is incomplete")
    missing = sorted(set(canonical.get(name, name) for name in targets) - filled)
    if missing:
        labels = [_label(hf_name(converter, key, targets[key], hf_config), key) for key in missing]
        raise PosttuneError(f"{where}: missing tensor {_names(labels)}: the checkpoint does not provide "
                            f"{'it' if len(missing) == 1 else 'them'}")
    mat.retie(model, groups)  # tied weights share the one tensor assigned to the first name
    _materialize_buffers(model, device)


def _placed(value: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """On ``device``; a plain floating tensor in ``dtype``, a quantized one as it was stored."""
    value = value.to(device)
    if type(value) is torch.Tensor and value.is_floating_point():
        value = value.to(dtype)
    return value


def _assign(model: nn.Module, key: str, value: torch.Tensor) -> None:
    owner, _, attr = key.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


def _materialize_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Storage for the non-persistent buffers (RoPE tables) no checkpoint holds; then recompute them."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
    mat.init_buffers(model)


def checkpoint_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by the native name a checkpoint gives them.

    A wrapping layer (an adapter) keeps the wrapped weight under ``base`` (``q_proj.base.weight``
    is the checkpoint's ``q_proj.weight``); its own tensors (``q_proj.lora_A.weight``) are not in
    a base checkpoint. Told apart by that naming rule alone, so loading needs no adapter code.
    """
    state = model.state_dict(keep_vars=True)
    wrapped = tuple(f"{key.rsplit(f'.{BASE}.', 1)[0]}." for key in state if f".{BASE}." in f".{key}")
    targets = {}
    for key, tensor in state.items():
        native = base_key(key)
        if native == key and key.startswith(wrapped):
            continue  # the wrapper's own tensors: lora_A / lora_B / magnitude
        targets[native] = tensor
    return targets


def _label(hf_key: str, native_key: str) -> str:
    return f"'{hf_key}'" if hf_key == native_key else f"'{hf_key}' (native '{native_key}')"


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def generation_config(directory: Path) -> dict[str, Any] | None:
    """The checkpoint's generation_config.json (stop ids, sampling defaults), saved back with the model."""
    file = directory / GENERATION_CONFIG
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # optional file; a broken one is regenerated from config.json on save
