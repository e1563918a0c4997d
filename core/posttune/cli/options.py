"""argparse types for options that several commands share, so each error names the option it came from."""

from __future__ import annotations

import argparse
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
