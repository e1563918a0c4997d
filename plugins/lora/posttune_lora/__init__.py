"""posttune-lora: LoRA and DoRA adapters for any registered model family, saved in PEFT's format
(docs/training.md, "Full fine-tuning, LoRA, DoRA").

    adapter: {kind: lora, rank: 16, alpha: 32, targets: all-linear}     # or kind: dora

    layer.py        the adapted layer (LoRALinear, an AdaptedLinear), its math and its state-dict names
    peft_format.py  adapter_config.json + adapter_model.safetensors, both ways (the kinds' save and load)
    peft_config.py  a PEFT LoRA folder's adapter_config.json, checked without torch (validate, init_from)

Importing this module does not import torch: the layer and the PEFT format load when a run adapts a layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttune.plugin import AdapterKind, registering

POSTTUNE_PLUGIN_API = 2


def wrap(linear: Any, adapter: Any, dtype: Any) -> Any:
    """One ``LoRALinear`` around ``linear`` from the run's ``adapter:`` section."""
    from posttune_lora.layer import LoRALinear

    return LoRALinear(linear, rank=adapter.rank, alpha=adapter.alpha, dropout=adapter.dropout, kind=adapter.kind,
                      dtype=dtype, rslora=adapter.rslora)


def save(model: Any, directory: Path, *, state_dict: Any = None) -> Path:
    from posttune_lora.peft_format import save_peft_adapter

    return save_peft_adapter(model, directory, state_dict=state_dict)


def load(model: Any, directory: Path) -> list[str]:
    from posttune_lora.peft_format import load_peft_adapter

    return load_peft_adapter(model, directory)


def validate(adapter: Any) -> None:
    """``adapter.init_from``: a loadable PEFT LoRA folder of this run's rank, alpha, kind and rslora."""
    from posttune_lora.peft_config import check_init_from

    check_init_from(adapter)


def _reads(dora: bool) -> Any:
    return lambda config: config.get("peft_type") == "LORA" and bool(config.get("use_dora")) == dora


KINDS = (
    AdapterKind("lora", wrap, save, load, _reads(False), validate,
                description="LoRA (Hu et al. 2021): a trained low-rank update B A beside each frozen linear layer"),
    AdapterKind("dora", wrap, save, load, _reads(True), validate,
                description="DoRA (Liu et al. 2024): LoRA on each weight's direction, plus a trained magnitude"),
)

posttune_register_adapter_kinds = registering(KINDS)
