"""One spelling of dtypes everywhere: configs and every command accept the short names and torch's.

``bf16`` and ``bfloat16`` (and ``torch.bfloat16``) mean the same wherever a dtype is asked for:
a config's ``model.dtype``, ``posttune generate --dtype``, ``posttune.load_model(dtype=...)``.
Configs store the short name; torch-facing code converts with ``torch_name``. Torch-free.
"""

from __future__ import annotations

#: accepted spelling -> the config's short name
ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}
#: short name -> torch's attribute name
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def short_name(value: object) -> object:
    """The config's short name for any accepted spelling; anything else unchanged (for the caller's error)."""
    if isinstance(value, str):
        return ALIASES.get(value.lower().removeprefix("torch."), value)
    return value


def torch_name(value: str) -> str:
    """torch's attribute name for any accepted spelling (``bf16`` -> ``bfloat16``); others unchanged."""
    short = short_name(value)
    return TORCH_NAMES.get(short, value) if isinstance(short, str) else value
