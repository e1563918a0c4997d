"""What several commands check in their options: argparse types whose errors name the option, and the checks of a
checkpoint path given on the command line. Importing this module imports no torch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def dtype_argument(value: str) -> torch.dtype:
    """``--dtype`` as the torch dtype it names (bf16, float16, ...), read by argparse so that its error names the
    option."""
    from posttune.checkpoint.materialize import resolve_dtype
    from posttune.errors import PosttuneError

    try:
        return resolve_dtype(value)
    except PosttuneError:
        raise argparse.ArgumentTypeError(f"expected a floating-point dtype such as bf16, bfloat16, fp16 or fp32, got "
                                         f"{value!r}") from None


def check_causal(path: str, where: str) -> None:
    """``path`` names a language model: not a PEFT adapter or a run's output folder (the usual slips, each named
    with what to pass instead), and not a sequence classifier (a reward or value model scores text; its one-value
    head would generate nothing). ``where`` starts each message (``"generate: --model"``)."""
    from posttune.checkpoint.peft_config import ADAPTER_CONFIG, inside
    from posttune.checkpoint.score_head import checkpoint_labels
    from posttune.checkpoint.source import read_hf_config
    from posttune.errors import PosttuneError

    folder = Path(path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        if (folder / ADAPTER_CONFIG).is_file():
            raise PosttuneError(f"{where} {path} is a PEFT adapter ({ADAPTER_CONFIG}); pass it as --adapter")
        if (folder / "model" / "config.json").is_file():
            raise PosttuneError(f"{where} {path} is a run's output folder; its model is {folder / 'model'}")
        if hint := inside(folder, ADAPTER_CONFIG):
            raise PosttuneError(f"{where} {path} holds an adapter{hint}: pass that as --adapter")
    if checkpoint_labels(read_hf_config(path)) is not None:
        raise PosttuneError(f"{where} {path} is a sequence classifier (a reward or value model): it scores text and "
                            "generates none; give a causal language model")
