"""The Hugging Face checkpoint format: config.json + (sharded) safetensors, both ways.

    source.py          local directory or hub id; config.json; which family reads it (no torch)
    safetensors_io.py  the file format, streamed one tensor at a time
    materialize.py     build on meta, allocate once, keep tied weights tied
    hf_load.py         checkpoint -> native model (checked from headers before allocating); a
                       quantized one's tensors rebuilt by the plugin of its quant_method
    hf_save.py         native model -> checkpoint transformers loads
    convert.py         what a converter answers (one, several, or a part of a joined tensor), streamed
    keymap.py          name maps from two tables; hf_decoder.py: Llama's names and config.json fields
    atomic.py          write a directory so a crash never leaves half of one
    origin.py          what a model remembers (family, build kwargs, source config) for saving

Exports are lazy so that importing this package (as `posttune plan` does) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_hf": "posttune.checkpoint.hf_load",
    "save_hf": "posttune.checkpoint.hf_save",
    "ModelOrigin": "posttune.checkpoint.origin",
    "origin_of": "posttune.checkpoint.origin",
    "atomic_dir": "posttune.checkpoint.atomic",
    "read_hf_config": "posttune.checkpoint.source",
    "family_for": "posttune.checkpoint.source",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'posttune.checkpoint' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
