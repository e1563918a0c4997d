"""A PEFT adapter folder's ``adapter_config.json``: read, checked and compared, without torch.

``posttune validate`` checks ``adapter.init_from`` against the run's ``adapter:`` section with
these (under a second, before any weight loads), and the loader (posttune.adapters.peft_format)
reads the same file through them, so both refuse the same folders with the same words.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttune.errors import ConfigError, PosttuneError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT options posttune's adapters do not implement, with the value that means "not used"
UNSUPPORTED: dict[str, Any] = {"bias": "none", "fan_in_fan_out": False, "lora_bias": False,
                               "modules_to_save": None, "layers_to_transform": None, "target_parameters": None,
                               "trainable_token_indices": None, "layer_replication": None,
                               "alora_invocation_tokens": None, "use_qalora": False, "use_bdlora": None,
                               "kasa_config": None, "arrow_config": None, "monteclora_config": None}
#: ``init_lora_weights`` after which PEFT's base is no longer the checkpoint's: it subtracts the adapter's initial
#: product from the base weights (or quantises them), at init and again at every load, so the saved A and B mean
#: nothing on the unchanged base. PEFT can save such an adapter as a plain LoRA on the original base instead.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
#: per-layer rank and alpha: loadable only where a layer is fused from several native ones (its rank and
#: alpha are then n times r and lora_alpha); the loader checks each layer against the model
PATTERNS = ("rank_pattern", "alpha_pattern")


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


def read_config(directory: Path) -> dict[str, Any]:
    """``adapter_config.json`` of a folder posttune can load (LoRA/DoRA, safetensors weights present)."""
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
    if config.get("peft_type") != "LORA":
        raise PosttuneError(f"{path}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for key, default in UNSUPPORTED.items():
        if key == "modules_to_save" and config.get("task_type") == "SEQ_CLS" \
                and set(config.get(key) or ()) <= {"score", "classifier"}:
            continue  # a reward model's score head, saved whole (checkpoint/score_head.py)
        if config.get(key, default) not in (default, None, {}, [], False):
            raise PosttuneError(f"{path}: {key}={config[key]!r} is not supported by posttune's adapters")
    if isinstance(init := config.get("init_lora_weights"), str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise PosttuneError(f"{path}: init_lora_weights={init!r} is not supported by posttune's adapters: its weights "
                            "apply to a base PEFT changes when it loads them; save it from PEFT with "
                            "path_initial_model_for_weight_conversion (a plain LoRA on the original base)")
    for key in PATTERNS:
        if not isinstance(config.get(key) or {}, dict):
            raise PosttuneError(f"{path}: {key} must map module names to numbers, got {config[key]!r}")
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise PosttuneError(f"{directory}: no {ADAPTER_WEIGHTS} (posttune loads safetensors only, never pickles)")
    return config


def settings_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """Rank, alpha, dropout, kind and rslora as posttune's ``adapter:`` section spells them."""
    return {"rank": int(config["r"]), "alpha": float(config.get("lora_alpha", 8)),
            "dropout_p": float(config.get("lora_dropout") or 0.0),
            "kind": "dora" if config.get("use_dora") else "lora", "rslora": bool(config.get("use_rslora"))}


def check_init_from(adapter: Any) -> None:
    """``adapter.init_from`` must be a loadable adapter folder with this run's rank, alpha and kind:
    the adapters are injected from ``adapter:`` first, so a different shape could not be copied in.
    The targets and every tensor are checked when the weights load."""
    if adapter is None or adapter.init_from is None:
        return
    path = Path(adapter.init_from).expanduser()
    try:
        saved = settings_of(read_config(path))  # checked as a load would
    except PosttuneError as exc:
        raise ConfigError("adapter.init_from", str(exc)) from None
    mine = {"rank": adapter.rank, "alpha": float(adapter.alpha), "kind": adapter.kind, "rslora": adapter.rslora}
    differ = [f"{key} {saved[key]} (saved) vs {mine[key]} (adapter.{key})" for key in mine if saved[key] != mine[key]]
    if differ:
        raise ConfigError("adapter.init_from", f"{path} does not match this run's adapter: {'; '.join(differ)}")


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
