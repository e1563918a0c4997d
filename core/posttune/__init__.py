"""posttune: PyTorch-native post-training of large language models, as a core plus plugins.

The Python API (``train``, ``load_model``, ``save_model``, ``build_model``, ``load_tokenizer``) is
exported lazily: ``import posttune`` (and ``posttune --version``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from posttune.plugins import PLUGIN_API, hookimpl

from posttune.version import __version__

_LAZY = {
    "train": "posttune.runs",
    "load_model": "posttune.api",
    "save_model": "posttune.api",
    "build_model": "posttune.api",
    "load_tokenizer": "posttune.api",
}

__all__ = ["PLUGIN_API", "__version__", "hookimpl", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'posttune' has no attribute '{name}'")
    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
