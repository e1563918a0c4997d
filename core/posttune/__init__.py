"""posttune: PyTorch-native post-training of large language models, as a core plus plugins."""

from posttune.plugins import PLUGIN_API, hookimpl

__version__ = "0.1.0"

__all__ = ["PLUGIN_API", "__version__", "hookimpl"]
