"""A PEFT LoRA folder's ``adapter_config.json``: checked and compared, without torch.

``posttune validate`` checks ``adapter.init_from`` against the run's ``adapter:`` section with
these (under a second, before any weight loads), and the loader (``peft_format``) reads the same
file through them, so both refuse the same folders with the same words.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttune.plugin import ADAPTER_CONFIG, ConfigError, PosttuneError, read_adapter_config

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


def read_config(directory: Path) -> dict[str, Any]:
    """``adapter_config.json`` of a folder posttune can load (LoRA/DoRA, safetensors weights present)."""
    path = directory / ADAPTER_CONFIG
    config = read_adapter_config(directory)
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
