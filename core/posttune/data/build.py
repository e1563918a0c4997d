"""`build_loader`: a dataset config -> tokenized sample groups -> a resumable, sharded loader.

The part of a method's ``data`` callback every method shares: load the rows, turn each into a
group of samples with a *maker* (``SampleMaker`` for SFT, ``PairMaker`` for preference pairs, or
a method's own), keep them (map-style) or stream them, optionally pack single samples into rows
of ``max_seq_len``, and batch them per data-parallel rank with a resumable order. What a group
becomes in a batch is the method's ``collate``.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from posttune.config.mixture import dataset_sources
from posttune.config.schema import DatasetConfig
from posttune.data.loader import BatchLoader
from posttune.data.loading import check_columns, load_rows
from posttune.data.local_files import guarded
from posttune.data.packing import pack
from posttune.data.samples import Sample, SampleStore
from posttune.errors import PosttuneError
from posttune.plugins import get_registry


def build_loader(session: Any, dataset: DatasetConfig, split: str, *, make: Any,
                 collate: Callable[[list[list[Sample]]], dict[str, Any]], packing: bool = False) -> BatchLoader:
    """The loader of one split of the run (``"train"`` shuffled per epoch unless ``data.shuffle`` is false,
    anything else in order).

    ``make(row, index)`` returns ``(ids, labels)``, a list of them (a group), a list of groups (a row in
    pieces), or None (`made_groups`), and keeps ``make.skipped`` (``SampleMaker`` does all of that). Sharded by
    the data-parallel coordinate: the ranks that split one data-parallel replica's weights or sequence read the
    same batches. ``data.group_by_length`` applies here.
    """
    from posttune.training.distributed import data_rank

    rank, world = data_rank(session)
    train = session.config.train
    return make_loader(dataset, make=make, collate=collate, max_seq_len=session.config.data.max_seq_len,
                       batch_size=train.batch_size, seed=train.seed, shuffle=shuffled(session, split), rank=rank,
                       world_size=world, packing=packing, where=f"data.{split}",
                       group_by_length=session.config.data.group_by_length)


def shuffled(session: Any, split: str) -> bool:
    """Whether this split's epochs are shuffled: the training split's, unless ``data.shuffle`` is false."""
    return split == "train" and session.config.data.shuffle


def make_loader(dataset: DatasetConfig, *, make: Any, collate: Callable[[list[list[Sample]]], dict[str, Any]],
                max_seq_len: int, batch_size: int, seed: int = 0, shuffle: bool = True, rank: int = 0,
                world_size: int = 1, packing: bool = False, where: str = "data.train",
                group_by_length: bool = False) -> BatchLoader:
    """``build_loader`` without a session: every setting given (tests and tools use it).

    ``group_by_length`` (map-style, unpacked, shuffled only; `validate` refuses the rest) batches
    rows of similar length, measured once from the tokenized store.

    Every rank reads and tokenizes the whole dataset, so shuffling and packing agree across ranks
    without communication; each then keeps its own share of every global batch.
    """
    parts = sources(dataset, make, where)
    common = dict(collate=collate, batch_size=batch_size, seed=seed, shuffle=shuffle, rank=rank,
                  world_size=world_size, skipped=make.skipped)
    if dataset.streaming:
        if getattr(make, "split_long", False):  # a stream resumes at a row: a row's later pieces would be lost
            raise PosttuneError(f"{where}: a streamed dataset cannot keep long rows in pieces (split_long): a "
                                "checkpoint between a row's pieces would lose the rest; use a map-style dataset")

        def open_stream(start_row: int) -> Iterator[list[Sample]]:
            groups = streamed_groups(dataset, parts, start_row, seed, where)
            return pack((s for group in groups for s in group), max_seq_len) if packing else groups

        return BatchLoader(open_stream=open_stream, **common)
    if len(parts) == 1:
        store = SampleStore.build(guarded(parts[0][0], where), make)
    else:
        store = SampleStore.build((row for rows, part in parts for row in guarded(rows, part.where)), _Mixed(parts))
    if len(store) == 0:
        raise PosttuneError(f"{where}: no usable samples in {_paths(dataset)} ({make.skipped.bad_rows} bad rows "
                            f"skipped, {make.skipped.untrained} with no token to train on: no response or "
                            f"assistant turn to learn, or all of it past max_seq_len={max_seq_len})")
    if packing:
        packed = list(pack(range(len(store)), max_seq_len, length=store.length))
        loader = BatchLoader(num_items=len(packed), get_item=lambda i: [store[j] for j in packed[i]], **common)
    else:
        lengths = store.group_lengths() if group_by_length and shuffle else None
        loader = BatchLoader(num_items=len(store), get_item=store.group, lengths=lengths, **common)
    loader.samples, loader.packed = store, packing
    if len(parts) > 1:  # each dataset's kept rows, for the banner
        firsts = torch.tensor([part.first_row for _, part in parts[1:]])
        kept = torch.bincount(torch.bucketize(store.rows, firsts, right=True), minlength=len(parts))
        loader.shares = [(part.where, int(n)) for (_, part), n in zip(parts, kept)]
    return loader


def prompt_loader(session: Any, dataset: DatasetConfig, split: str) -> BatchLoader:
    """Prompts to generate from (``PromptMaker`` with ``data.max_prompt_len``), batched by ``prompt_batch``.

    The prompts of a map-style dataset are kept as tokenized (they are short; rewards need each
    row's other fields too); a streaming one is read in order. Shuffling, sharding and resume are
    ``BatchLoader``'s, as for every other loader; ``data.group_by_length`` groups prompts by length.
    """
    from posttune.data.prompts import PromptMaker, prompt_batch
    from posttune.training.distributed import data_rank

    where, config = f"data.{split}", session.config
    make = PromptMaker(dataset_format(session, split), session.tokenizer, max_prompt_len=config.data.max_prompt_len,
                       skip_bad_rows=config.data.skip_bad_rows, column_map=dataset.column_map, where=where,
                       system_prompt=dataset.system_prompt)
    parts = sources(dataset, make, where)
    rank, world = data_rank(session)
    common = dict(collate=prompt_batch, batch_size=config.train.batch_size, seed=config.train.seed,
                  shuffle=shuffled(session, split), rank=rank, world_size=world, skipped=make.skipped)
    if dataset.streaming:
        return BatchLoader(open_stream=lambda start: streamed_groups(dataset, parts, start, config.train.seed, where),
                           **common)
    items = [item for rows, part in parts for item in part.groups(guarded(rows, part.where), start=part.first_row)]
    if not items:
        raise PosttuneError(f"{where}: no usable prompts in {_paths(dataset)} ({make.skipped.bad_rows} bad rows "
                            f"skipped, {make.skipped.untrained} empty)")
    lengths = (torch.tensor([max(len(sample) for sample in item) for item in items])
               if config.data.group_by_length and split == "train" else None)  # similar prompts generate together
    return BatchLoader(num_items=len(items), get_item=items.__getitem__, lengths=lengths, **common)


def sources(dataset: DatasetConfig, make: Any, where: str) -> list[tuple[Any, Any]]:
    """``(rows, maker)`` for each dataset a section reads: ``make`` itself for one dataset; for a mixture
    (``data.train`` as a list), ``make.for_source`` per source, reading its own format, columns and system
    prompt, its rows numbered on from the previous source's, so every row of the mixture has its own number."""
    parts, first_row = [], 0
    for at, source in dataset_sources(dataset, where):
        maker = make
        if dataset.sources:
            if not hasattr(make, "for_source"):
                raise PosttuneError(f"{where}: a list of datasets needs a maker that can read each (SampleMaker's "
                                    f"for_source); this method's {type(make).__name__} reads one dataset")
            fmt = get_registry().get("dataset_format", source.format)
            maker = make.for_source(source, fmt, at, first_row)
        rows = load_rows(source, where=at, skip_bad_rows=getattr(make, "skip_bad_rows", False), skipped=make.skipped)
        if source.holdout is not None:
            rows = holdout_rows(rows, *source.holdout, where=at)
        check_columns(rows, source.column_map, at)
        parts.append((rows, maker))
        if dataset.sources and not dataset.streaming:  # a stream's rows are numbered as they are drawn
            first_row += len(rows)
    return parts


def holdout_rows(rows: Any, share: float, seed: int, held: bool, *, where: str) -> Any:
    """``data.validation_split``: the ``share`` of ``rows`` drawn at random with ``seed`` (``held``), or the rest,
    each in the file's order. The draw depends only on the row count and the seed, so the training and the
    validation loaders, every rank and a resumed run all agree on it."""
    count = len(rows)
    size = round(share * count)
    if not 0 < size < count:
        raise PosttuneError(f"{where}: data.validation_split {share} of {count} rows leaves "
                            f"{'no row to validate on' if size == 0 else 'no row to train on'}")
    chosen = set(random.Random(seed).sample(range(count), size))
    return rows.select([i for i in range(count) if (i in chosen) == held])


def streamed_groups(dataset: DatasetConfig, parts: list[tuple[Any, Any]], start_row: int, seed: int,
                    where: str) -> Iterator[Any]:
    """The sample groups of a streamed section from its row ``start_row`` on (``BatchLoader``'s resume point).

    One dataset: its rows in order, skipped to ``start_row``. A mixture: its datasets interleaved, each next
    row drawn from one chosen at random (seeded by ``seed``, the same every epoch) in proportion to its
    ``weight``, until one runs out (as ``datasets.interleave_datasets`` stops by default, so no dataset is
    read twice in an epoch); rows are numbered in the order drawn, and a resume draws again from the start,
    reading the rows before ``start_row`` without tokenizing them.
    """
    if len(parts) == 1:
        ((rows, make),) = parts
        shard = rows.skip(start_row) if start_row else rows
        yield from make.groups(guarded(shard, where, start_row, getattr(rows, "posttune_explain", None)),
                               start=start_row)
        return
    weights = [1.0 if source.weight is None else source.weight for _, source in dataset_sources(dataset, "")]
    streams = [iter(guarded(rows, maker.where)) for rows, maker in parts]
    read, choose, end = [0] * len(parts), random.Random(seed), object()
    for index in itertools.count():
        k = choose.choices(range(len(parts)), weights)[0]
        row = next(streams[k], end)
        if row is end:
            return
        if index >= start_row:
            maker = parts[k][1]
            maker.first_row = index - read[k]  # its errors name the row of its own dataset
            yield from maker.groups([row], start=index)
        read[k] += 1


class _Mixed:
    """One ``make(row, index)`` over a mixture's rows read one source after another: the source's own maker."""

    def __init__(self, parts: list[tuple[Any, Any]]):
        self.makers = [maker for _, maker in parts]
        self.starts = [maker.first_row for maker in self.makers]

    def __call__(self, row: Any, index: int) -> Any:
        return self.makers[bisect.bisect_right(self.starts, index) - 1](row, index)


def _paths(dataset: DatasetConfig) -> str:
    return ", ".join(repr(source.path) for _, source in dataset_sources(dataset, ""))


def pair_loader(session: Any, dataset: DatasetConfig, split: str, *,
                collate: Callable[[list[list[Sample]]], dict[str, Any]] | None = None,
                maker: Callable[..., Any] | None = None) -> BatchLoader:
    """Preference pairs (``PairMaker`` with the run's data settings), batched by ``pair_batch`` (the chosen
    rows, then the rejected) unless ``collate`` is given: what preference methods read. ``maker``: a
    ``PairMaker`` subclass (or a partial of one) built with the same settings, for rows of a method's own."""
    from posttune.data.collate import pad_id, pair_batch
    from posttune.data.preference import PairMaker

    config = session.config.data
    make = (maker or PairMaker)(dataset_format(session, split), session.tokenizer, max_seq_len=config.max_seq_len,
                                max_prompt_len=config.max_prompt_len, skip_bad_rows=config.skip_bad_rows,
                                column_map=dataset.column_map, where=f"data.{split}",
                                system_prompt=dataset.system_prompt)
    if collate is None:
        pad = pad_id(session.tokenizer)

        def collate(rows: list[list[Sample]]) -> dict[str, Any]:
            return pair_batch(rows, pad_id=pad, pad_to_multiple_of=config.pad_to_multiple_of)

    return build_loader(session, dataset, split, make=make, collate=collate)


def pair_tokens(config: Any, *, padding_free: bool) -> tuple[int, str]:
    """The tokens of one forward over ``pair_batch``'s rows, for `posttune plan`'s memory estimate: the worst case.

    The chosen and then the rejected responses of ``batch_size`` pairs, each cut to ``max_seq_len``:
    padded, ``[2 x batch_size, width]`` with ``width`` the longest rounded up to ``data.pad_to_multiple_of``;
    padding-free, one row of all of them, its length rounded up. Twice SFT's rows either way.
    """
    width, multiple, rows = config.data.max_seq_len, config.data.pad_to_multiple_of, 2 * config.train.batch_size
    how = f"2 x batch_size {config.train.batch_size} x max_seq_len {width}"
    if padding_free:
        tokens = rows * width
        if multiple is not None and tokens % multiple:
            tokens = -(-tokens // multiple) * multiple
            how += f" end to end, rounded up to {tokens} by pad_to_multiple_of {multiple}"
    else:
        if multiple is not None and width % multiple:
            width = -(-width // multiple) * multiple
            how += f" rounded up to {width} by pad_to_multiple_of {multiple}"
        tokens = rows * width
    return tokens, how + ": chosen and rejected in one forward, every row full: the worst case"


def dataset_format(session: Any, split: str) -> Any:
    """The registered ``DatasetFormat`` the config names for ``split`` (resolved before launch)."""
    return session.plan.datasets[split].descriptor
