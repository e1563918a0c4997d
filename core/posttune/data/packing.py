"""Greedy packing: consecutive samples share a row of ``max_seq_len`` tokens.

Samples are taken in order and a row is closed as soon as the next sample does not fit, so the
packing of a stream depends only on where it starts: a resumed streaming run that restarts at the
first sample of an unfinished row packs exactly as the uninterrupted run did. Attention and
positions are kept per sample by the ``document_ids`` the collate writes (see `collate.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def pack(samples: Iterable[T], max_seq_len: int, length: Callable[[T], int] = len) -> Iterator[list[T]]:
    """Rows of consecutive samples, each row's total length at most ``max_seq_len``.

    Every sample must already be truncated to ``max_seq_len``.
    """
    row: list[T] = []
    used = 0
    for sample in samples:
        size = length(sample)
        if size > max_seq_len:
            raise ValueError(f"a sample of {size} tokens cannot be packed into rows of {max_seq_len}")
        if row and used + size > max_seq_len:
            yield row
            row, used = [], 0
        row.append(sample)
        used += size
    if row:
        yield row
