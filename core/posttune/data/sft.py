"""`build_sft_loader`: the one call that turns a dataset config into SFT micro-batches."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

from posttune.config.schema import DataConfig, DatasetConfig
from posttune.data.collate import packed_batch, padded_batch
from posttune.data.loader import SFTLoader
from posttune.data.loading import check_columns, load_rows
from posttune.data.packing import pack
from posttune.data.samples import Sample, SampleMaker, SampleStore
from posttune.descriptors import DatasetFormat
from posttune.errors import PosttuneError


def build_sft_loader(dataset: DatasetConfig, *, data: DataConfig, fmt: DatasetFormat, tokenizer: Any,
                     batch_size: int, seed: int = 0, train_on_input: bool = False, shuffle: bool = True,
                     rank: int = 0, world_size: int = 1, where: str = "data.train") -> SFTLoader:
    """Load, tokenize (eagerly unless streaming) and batch one dataset for SFT.

    ``fmt`` is the registered `DatasetFormat` named by ``dataset.format``; ``where`` names the
    config section in errors (``data.validation`` for the validation set, with ``shuffle=False``).
    Every rank reads and tokenizes the whole dataset, so shuffling and packing agree across ranks
    without communication; each then keeps its own share of every global batch.
    """
    rows = load_rows(dataset, where=where)
    check_columns(rows, dataset.column_map, where)
    make = SampleMaker(fmt, tokenizer, max_seq_len=data.max_seq_len, train_on_input=train_on_input,
                       skip_bad_rows=data.skip_bad_rows, column_map=dataset.column_map, where=where)
    pad_id = _pad_id(tokenizer)
    collate = (partial(packed_batch, pad_id=pad_id, max_seq_len=data.max_seq_len) if data.packing
               else partial(padded_batch, pad_id=pad_id))
    common = dict(collate=collate, batch_size=batch_size, seed=seed, shuffle=shuffle, rank=rank,
                  world_size=world_size, skipped=make.skipped)
    if dataset.streaming:
        def open_stream(start_row: int) -> Iterator[list[Sample]]:
            samples = make.samples(rows.skip(start_row) if start_row else rows, start=start_row)
            return pack(samples, data.max_seq_len) if data.packing else ([sample] for sample in samples)

        return SFTLoader(open_stream=open_stream, **common)

    store = SampleStore.build(rows, make)
    if len(store) == 0:
        raise PosttuneError(f"{where}: no usable samples in {dataset.path!r} ({make.skipped.bad_rows} bad rows "
                            f"skipped, {make.skipped.untrained} with nothing to train on within "
                            f"max_seq_len={data.max_seq_len})")
    if data.packing:
        rows_of_indices = list(pack(range(len(store)), data.max_seq_len, length=store.length))
        return SFTLoader(num_items=len(rows_of_indices),
                         get_item=lambda i: [store[j] for j in rows_of_indices[i]], **common)
    return SFTLoader(num_items=len(store), get_item=lambda i: [store[i]], **common)


def _pad_id(tokenizer: Any) -> int:
    """The pad id, else eos, else 0: padded positions carry no target, so any valid id serves."""
    for candidate in (getattr(tokenizer, "pad_id", None), getattr(tokenizer, "eos_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0
