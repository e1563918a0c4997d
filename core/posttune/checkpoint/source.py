"""Where a Hugging Face checkpoint comes from, and which installed family reads it.

Torch-free on purpose: `posttune plan` and `posttune validate` use these to refuse a run in a
second, before torch or any weight is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttune import first_party, hub
from posttune.checkpoint.hf_config_check import check_hf_config
from posttune.errors import ConfigError, PosttuneError, first_line
from posttune.registry import Registered, Registry

#: What `snapshot_download` fetches for a hub id: weights, configs and tokenizer files only
#: (never *.bin / *.pt pickles, never other frameworks' weights).
HUB_PATTERNS = (
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.model",  # sentencepiece tokenizers
    "*.tiktoken",
    "*.jinja",  # chat templates shipped as separate files
    "*.txt",  # merges.txt / vocab.txt of BPE tokenizers
)


def is_hub_id(path_or_id: str) -> bool:
    """True for `owner/name` that is not an existing local path.

    Anything that looks like a path (``./x``, ``/x``, ``~/x``, ``a/b/c``) is treated as local, so
    a typo in a local path is reported as a missing directory rather than a hub 404.
    """
    text = str(path_or_id)
    if Path(text).expanduser().exists() or text.startswith((".", "/", "~")) or hub.first_part_exists(text):
        return False
    return text.count("/") == 1


def read_hf_config(path: str | Path | None) -> dict[str, Any]:
    """``config.json`` of a local checkpoint directory, or of a hub repository (config only).

    Its values are checked here (``hf_config_check``), so every reader refuses a malformed file in
    one line naming the file and the field, before anything is built from it.
    """
    local = Path(str(path)).expanduser()
    if local.is_dir():
        file = local / "config.json"
        if not file.is_file():
            raise PosttuneError(f"{path}: not a Hugging Face checkpoint (no config.json)")
    elif not is_hub_id(str(path)):
        raise PosttuneError(no_directory(path))
    else:
        file = _hub_config(str(path))
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
        raise PosttuneError(f"{file}: unreadable config.json: {type(exc).__name__}: {first_line(str(exc))}") from None
    return check_hf_config(config, str(file))


def no_directory(path: str | Path) -> str:
    """Why ``path`` is no checkpoint: a file (torchtune's checkpointer names weight files), or nothing there."""
    if Path(str(path)).expanduser().is_file():
        return f"{path}: is a file; give the checkpoint folder that holds config.json and the weights"
    return f"{path}: no such checkpoint directory"


def local_dir(path_or_id: str | Path) -> Path:
    """A local directory holding the checkpoint: the path itself, or a hub snapshot of it.

    The hub branch is a thin call into huggingface_hub (no network in tests).
    """
    local = Path(str(path_or_id)).expanduser()
    if local.is_dir():
        return local
    if not is_hub_id(str(path_or_id)):
        raise PosttuneError(no_directory(path_or_id))
    from huggingface_hub import snapshot_download

    reach = _reach()
    try:
        return Path(snapshot_download(str(path_or_id), allow_patterns=list(HUB_PATTERNS), **reach))
    except Exception as exc:  # noqa: BLE001 - network, auth and not-found errors alike
        if reach:
            raise hub.unreachable(str(path_or_id), "checkpoint") from None
        raise PosttuneError(f"{path_or_id}: cannot download from the hub: "
                            f"{type(exc).__name__}: {first_line(str(exc))}") from None


def _hub_config(repo_id: str) -> Path:
    from huggingface_hub import hf_hub_download

    reach = _reach()
    try:
        return Path(hf_hub_download(repo_id, "config.json", **reach))
    except Exception as exc:  # noqa: BLE001 - network, auth and not-found errors alike
        if reach:
            raise hub.unreachable(repo_id, "checkpoint") from None
        raise PosttuneError(f"{repo_id}: cannot fetch config.json from the hub: "
                            f"{type(exc).__name__}: {first_line(str(exc))}") from None


def _reach() -> dict[str, bool]:
    """Extra arguments of a huggingface_hub download: the cache only when the hub cannot be reached
    (docs/config.md, "Hub ids offline"). Empty online, and with HF_HUB_OFFLINE=1, which the library honours."""
    return {} if hub.offline_requested() or hub.reachable() else {"local_files_only": True}


def multimodal_hint(hf_config: Mapping[str, Any]) -> str:
    """What to say of a multimodal checkpoint (its text model's fields under ``text_config``), else nothing."""
    if not isinstance(hf_config.get("text_config"), Mapping):
        return ""
    return ("; this is a multimodal checkpoint (its text model's fields are under text_config): posttune trains "
            "the text model, so export it alone (its ForCausalLM class) and load that")


def family_kwargs(family: Any, hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """``family.from_hf_config(hf_config)``; a refusal of a multimodal checkpoint's config says what it is."""
    try:
        return family.from_hf_config(hf_config)
    except ConfigError as exc:
        raise ConfigError(exc.path, exc.problem + multimodal_hint(hf_config)) from None
    except PosttuneError as exc:
        raise PosttuneError(f"{exc}{multimodal_hint(hf_config)}") from None


def family_for(hf_config: Mapping[str, Any], registry: Registry, where: str) -> Registered:
    """The installed family whose ``architectures`` include the checkpoint's.

    Looked up through what plugins registered, never by name in the core; a miss names the
    installed readers and, for a first-party architecture, the `pip install` line.
    """
    from posttune.checkpoint.score_head import causal_architectures

    architectures = causal_architectures(hf_config.get("architectures"))  # a reward model reads as its LM
    for item in registry.items("model_family"):
        if set(architectures) & set(item.descriptor.architectures):
            return item
    readers = [f"{r.descriptor.name} ({', '.join(r.descriptor.architectures)})"
               for r in registry.items("model_family")]
    if not architectures:
        names = ", ".join(r.descriptor.name for r in registry.items("model_family")) or "none"
        raise PosttuneError(f"{where}: config.json names no architectures: name the family to read it with "
                            "(model.family in a config, family= in Python, or add architectures to config.json; "
                            f"installed: {names})")
    wanted = ", ".join(architectures)
    hint = next((first_party.install_hint(first_party.ARCHITECTURES[a]) for a in architectures
                 if a in first_party.ARCHITECTURES), "")
    raise PosttuneError(f"{where}: no installed model family reads architecture {wanted} "
                        f"(installed: {'; '.join(readers) or 'none'}){hint}{multimodal_hint(hf_config)}")


def quant_method(hf_config: Mapping[str, Any], where: str) -> str | None:
    """The ``quantization_config.quant_method`` config.json names (as transformers writes it), or None
    for a float checkpoint; it picks the plugin that reads the weights (``QuantizedFormat``)."""
    settings = hf_config.get("quantization_config")
    if settings is None:
        return None
    method = settings.get("quant_method") if isinstance(settings, Mapping) else None
    if not isinstance(method, str) or not method:
        raise PosttuneError(f"{where}: config.json quantization_config names no quant_method")
    return method


#: bytes read from each safetensors file for its fingerprint: this many evenly spaced pieces of this size
PIECES, PIECE = 64, 16 * 1024


def weights_fingerprint(folder: Path) -> str | None:
    """A cheap fingerprint of a local checkpoint's weights, to tell a moved copy (accepted on resume) from other
    weights (a fine-tuned or merged model of the same shapes, refused): every safetensors file's header and
    ``PIECES`` evenly spaced pieces of its data (the whole of a small file), about 1 MiB a file at most. None
    for a hub id or a folder without safetensors files (nothing to compare)."""
    import hashlib

    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            size = file.stat().st_size
            if size <= PIECES * PIECE:
                digest.update(handle.read())
                continue
            header = int.from_bytes(handle.read(8), "little")
            digest.update(handle.read(min(header, size - 8)))
            start, span = 8 + header, max(0, size - 8 - header - PIECE)
            for index in range(PIECES):
                handle.seek(start + span * index // max(1, PIECES - 1))
                digest.update(handle.read(PIECE))
    return digest.hexdigest()[:16]
