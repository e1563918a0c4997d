"""A saved adapter folder's ``adapter_config.json`` (PEFT's layout, whatever the kind), without torch: read,
and the base model and tokenizer it names for the commands given ``--adapter``. What the rest of it means
is the adapter kind's (``AdapterKind.reads``, ``load``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttune.errors import PosttuneError

ADAPTER_CONFIG = "adapter_config.json"


def inside(folder: str | Path, file: str) -> str:
    """``"; it is in X"``: where a run's output folder or a checkpoint holds ``file`` one level down (``adapter/``,
    ``model/``: a LoRA run's checkpoint keeps its adapter in ``model/``), for a path given one level too high."""
    for sub in ("adapter", "model"):
        if (Path(folder).expanduser() / sub / file).is_file():
            return f"; it is in {Path(folder) / sub}"
    return ""


def what_folder(folder: str | Path) -> str:
    """``"; it is ..."``: what a folder given as a model but without config.json is, when it is one of the usual
    slips (a PEFT adapter, a run's output folder, a LoRA run's folder or checkpoint): "" otherwise."""
    path = Path(folder).expanduser()
    if (path / ADAPTER_CONFIG).is_file():
        return f"; it is a PEFT adapter ({ADAPTER_CONFIG}): its base model goes here, the adapter in adapter.init_from"
    if (path / "model" / "config.json").is_file():
        return f"; it is a run's output folder: its model is {Path(folder) / 'model'}"
    if hint := inside(folder, ADAPTER_CONFIG):
        return f"; it holds an adapter{hint}: its base model goes here, the adapter in adapter.init_from"
    return ""


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """A saved adapter folder's ``adapter_config.json`` as written; a missing or unreadable one is one line."""
    path = directory / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if not Path(directory).expanduser().exists():  # moved or deleted: not a folder of another kind
            raise PosttuneError(f"{directory}: no such adapter directory (no {ADAPTER_CONFIG} there)") from None
        raise PosttuneError(f"{directory}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)"
                            f"{inside(directory, ADAPTER_CONFIG)}") from None
    except (OSError, ValueError) as exc:
        raise PosttuneError(f"{path}: unreadable: {type(exc).__name__}: {exc}") from None
    if not isinstance(config, dict):
        raise PosttuneError(f"{path}: not a JSON object")
    return config


def adapter_base(adapter_dir: str | Path, command: str) -> str:
    """The base model ``adapter_dir``'s adapter_config.json names (``base_model_name_or_path``), for a
    command given ``--adapter`` alone; a missing or unreadable name is one line naming ``command``."""
    config = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except FileNotFoundError:
        raise PosttuneError(f"{command}: --adapter {adapter_dir}: no {config.name} there"
                            f"{inside(adapter_dir, config.name)}") from None
    except (OSError, ValueError) as exc:
        raise PosttuneError(f"{command}: --adapter {adapter_dir}: cannot read {config.name} ({exc})") from None
    if not base:
        raise PosttuneError(f"{command}: --adapter {adapter_dir}: {config.name} names no base_model_name_or_path; "
                            "give --model")
    from posttune.checkpoint.source import is_hub_id

    if not Path(str(base)).expanduser().is_dir() and not is_hub_id(str(base)):
        raise PosttuneError(f"{command}: --adapter {adapter_dir}: the base model its {config.name} names, {base!r}, "
                            "is no folder here (a path relative to where it was trained?); give --model")
    return str(base)


def other_base(adapter_dir: str | Path, model: str) -> str | None:
    """The local base folder ``adapter_dir``'s adapter_config.json names when it is another than ``model``; None
    when they agree, or when it names a hub id or a folder not here (moved, or another machine's: nothing to
    compare). An adapter merged into or run on another base computes something else, silently: PEFT allows it,
    a command warns."""
    try:
        config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    named = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(named, str) or not Path(named).expanduser().is_dir():
        return None
    same = Path(named).expanduser().resolve() == Path(model).expanduser().resolve()
    return None if same else named


def warn_of_other_base(command: str, adapter_dir: str | Path, model: str, consequence: str = "") -> None:
    """One warning line on stderr when ``--model`` is another local base than the one the adapter names."""
    import sys

    trained_on = other_base(adapter_dir, model)
    if trained_on is not None:
        print(f"{command}: warning: {adapter_dir} was trained on {trained_on}, not on --model {model}{consequence}",
              file=sys.stderr)


def warn_of_init_from_base(config: Any) -> None:
    """``adapter.init_from`` trained on another local base than ``model.path`` (unless it holds the same weights, a
    moved copy): one warning line. On a model the adapter was merged into, its update counts twice; on another,
    it computes something it never learned. PEFT allows both, as `posttune merge` and `generate` do with a warning."""
    import sys

    from posttune.checkpoint.source import weights_fingerprint

    adapter, model = config.adapter, config.model.path
    if adapter is None or adapter.init_from is None or model is None:
        return
    trained_on = other_base(adapter.init_from, model)
    if trained_on is None:
        return
    theirs = weights_fingerprint(Path(trained_on).expanduser())
    if theirs is not None and theirs == weights_fingerprint(Path(model).expanduser()):
        return
    print(f"posttune: warning: adapter.init_from: {adapter.init_from} was trained on {trained_on}, not on model.path "
          f"{model}: its update is added to other weights (to a model it was merged into, a second time)",
          file=sys.stderr)


def tokenizer_source(base: str, adapter_dir: str | Path | None = None) -> str:
    """Where a command given ``--adapter`` reads the tokenizer: the adapter's folder when a run saved one
    there (with the run's chat template, which may not be the base's), else the base model's."""
    if adapter_dir is not None and (Path(adapter_dir) / "tokenizer.json").is_file():
        return str(adapter_dir)
    return base
