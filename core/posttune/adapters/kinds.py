"""Adapter kinds by name: wrap a run's layers with the kind ``adapter.kind`` names, save a model's adapters
with the kind its layers are, load a folder with the kind that reads it (docs/architecture.md, "Adapter kinds")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from posttune import first_party
from posttune.adapters.inject import adapted_modules
from posttune.checkpoint.peft_config import ADAPTER_CONFIG, read_adapter_config
from posttune.descriptors import AdapterKind
from posttune.errors import PosttuneError


def adapter_kind(name: str) -> AdapterKind:
    from posttune.plugins import get_registry

    return get_registry().get("adapter_kind", name)


def wrapper(adapter: Any, dtype: Any = None) -> Callable[[nn.Linear], nn.Module]:
    """What wraps one linear layer for the run's ``adapter:`` section (``apply_adapters``'s ``wrap``), the
    adapters in ``dtype`` (None: each base layer's)."""
    kind = adapter_kind(adapter.kind)
    return lambda linear: kind.wrap(linear, adapter, dtype)


def save_adapter(model: nn.Module, directory: str | Path, *, state_dict: Any = None, tokenizer: Any = None) -> Path:
    """The model's adapters as a folder, written by the kind its layers are (one kind a model); atomic, like
    ``save_model``: ``directory`` holds the old adapter or the complete new one.

    ``state_dict``: the adapter tensors by model key, gathered whole (FSDP2/TP shards), instead of the layers'.
    ``tokenizer``: its files beside the adapter, as TRL saves them (a run's chat template may not be the base's),
    with the base's stop tokens (commands read the tokenizer there, eos ids included).
    """
    kinds = sorted({layer.kind for layer in adapted_modules(model).values()})
    if not kinds:
        raise PosttuneError("save_adapter: the model has no adapters (apply_adapters first)")
    if len(kinds) > 1:
        raise PosttuneError(f"save_adapter: the model has adapters of several kinds ({', '.join(kinds)}); "
                            "one folder holds one kind")
    from posttune.checkpoint.atomic import atomic_dir, fsync_file

    with atomic_dir(directory, replaceable=(ADAPTER_CONFIG,)) as tmp:
        adapter_kind(kinds[0]).save(model, tmp, state_dict=state_dict)
        if tokenizer is not None:
            _save_tokenizer(model, tokenizer, tmp)
        for path in tmp.iterdir():  # the kind's files too: a crash after the swap must not find them unwritten
            if path.is_file():
                fsync_file(path)
    return Path(directory)


def _save_tokenizer(model: nn.Module, tokenizer: Any, directory: Path) -> None:
    import json

    from posttune.checkpoint.hf_load import GENERATION_CONFIG
    from posttune.checkpoint.hf_save import generation_config_for, save_tokenizer
    from posttune.checkpoint.module_names import family_io

    origin, _, hf_config = family_io(model)
    save_tokenizer(tokenizer, directory)
    (directory / GENERATION_CONFIG).write_text(json.dumps(generation_config_for(origin, hf_config or {}), indent=2)
                                               + "\n", encoding="utf-8")


def load_adapter(model: nn.Module, directory: str | Path) -> list[str]:
    """A saved adapter folder into ``model`` (applied first when it has none); returns the adapted layers."""
    return saved_kind(directory).load(model, Path(directory))


def saved_kind(directory: str | Path) -> AdapterKind:
    """The installed kind that reads the folder's ``adapter_config.json``; none is one line with the install hint."""
    from posttune.plugins import get_registry

    config = read_adapter_config(Path(directory))
    entries = get_registry().items("adapter_kind")
    for entry in entries:
        if entry.descriptor.reads(config):
            return entry.descriptor
    peft_type = config.get("peft_type")
    hint = first_party.install_hint(first_party.PEFT_TYPES.get(str(peft_type)))
    installed = ", ".join(entry.descriptor.name for entry in entries) or "none"
    raise PosttuneError(f"{directory}: an adapter of peft_type {peft_type!r} that no installed adapter kind reads "
                        f"(installed: {installed}){hint}")
