"""`BatchLoader`: deterministic, shardable, resumable micro-batches for one epoch at a time.

Methods build their loaders from it (the SFT, DPO and template plugins do). An *item* is one
row of a batch: a single sample (padding), a packed row of samples, or a preference pair. Items
are grouped into *global batches* of ``batch_size * world_size``; rank ``r`` takes items
``r, r + world_size, ...`` of each, so ranks hold disjoint shares that together cover the epoch,
and every rank yields the same number of micro-batches (an empty share of the last global batch
becomes a placeholder batch without targets, see `collate.py`).

Order: a map-style dataset is shuffled per epoch by a `torch.Generator` seeded from
(seed, epoch), the same on every rank; a streaming dataset is read in order. Given item
``lengths``, a shuffled order is length-grouped (`grouping.py`) from the same generator.

Resume: ``position`` counts the global batches consumed in ``epoch``. A map-style loader
recomputes the epoch's permutation and skips them; a streaming loader restarts the dataset at
``rows`` (the first row after the last sample it handed out: with greedy packing that is also
the start of the unfinished packed row), so the remaining batches equal the uninterrupted
run's, bitwise, without re-tokenizing what was consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from posttune.data.grouping import grouped_order
from posttune.data.samples import Sample, SkipCounts
from posttune.errors import PosttuneError

Item = list[Sample]
T = TypeVar("T")
Batch = dict[str, torch.Tensor]


class BatchLoader:
    """Iterate micro-batches of one epoch; ``set_epoch``, ``state_dict``/``load_state_dict`` to resume.

    Give either ``num_items`` and ``get_item`` (map-style) or ``open_stream(start_row)`` (streaming).
    Iterating to the end advances to the next epoch, so ``for e in range(loader.epoch, epochs):
    loader.set_epoch(e); for batch in loader: ...`` also works right after ``load_state_dict``.
    """

    def __init__(self, *, collate: Callable[[list[Item]], Batch], batch_size: int, seed: int = 0,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1, num_items: int | None = None,
                 get_item: Callable[[int], Item] | None = None,
                 open_stream: Callable[[int], Iterator[Item]] | None = None, skipped: SkipCounts | None = None,
                 lengths: torch.Tensor | None = None, prefetch: bool = True):
        if (open_stream is None) == (get_item is None or num_items is None):
            raise ValueError("give either num_items and get_item (map-style) or open_stream (streaming)")
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.collate, self.batch_size, self.seed = collate, batch_size, seed
        self.shuffle = shuffle and open_stream is None  # a stream is consumed in order
        self.rank, self.world_size = rank, world_size
        self.num_items, self.get_item, self.open_stream = num_items, get_item, open_stream
        self.skipped = skipped if skipped is not None else SkipCounts()
        if lengths is not None and (open_stream is not None or len(lengths) != num_items):
            raise ValueError("lengths: one per item, for a map-style loader only")
        self.lengths = lengths  # per item, for length-grouped batches (data.group_by_length)
        self.prefetch = prefetch  # collate the next batch on a background thread (``prefetched``)
        self.epoch, self.position, self.rows = 0, 0, 0
        self.samples: Any = None  # the tokenized samples its items come from, where known (the start banner)
        self.packed = False  # an item is a packed row of several samples

    @property
    def grouped(self) -> bool:
        """Whether the epoch order is length-grouped (only a shuffled order is)."""
        return self.shuffle and self.lengths is not None

    @property
    def streaming(self) -> bool:
        return self.open_stream is not None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank (the same on every rank)."""
        if self.num_items is None:
            raise TypeError("a streaming BatchLoader has no len(): the number of batches is known only at the end")
        return -(-self.num_items // self.global_batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch (e.g. just restored) is left where it is."""
        if epoch != self.epoch:
            self.epoch, self.position, self.rows = epoch, 0, 0

    def __iter__(self) -> Iterator[Batch]:
        shares = self._stream_shares() if self.streaming else self._map_shares()
        collated = ((self.collate(share), rows) for share, rows in shares)
        for batch, rows in prefetched(collated) if self.prefetch else collated:
            # before yielding: a checkpoint taken now must not replay this batch (nor skip the
            # one prefetched behind it, whose position is counted only when it is handed out)
            self.position += 1
            self.rows = rows
            yield batch
        self.set_epoch(self.epoch + 1)

    def order(self, epoch: int | None = None) -> list[int]:
        """The item order of an epoch (map-style): a permutation from (seed, epoch), or 0..n-1."""
        assert self.num_items is not None
        if not self.shuffle:
            return list(range(self.num_items))
        epoch = self.epoch if epoch is None else epoch
        generator = torch.Generator().manual_seed(_mix(self.seed, epoch))
        if self.grouped:
            return grouped_order(self.lengths, self.global_batch_size, generator)
        return torch.randperm(self.num_items, generator=generator).tolist()

    def _map_shares(self) -> Iterator[tuple[list[Item], int]]:
        """(this rank's share of each remaining global batch, rows: 0 for a map-style loader)."""
        assert self.get_item is not None
        order, size = self.order(), self.global_batch_size
        for start in range(self.position * size, len(order), size):
            yield [self.get_item(i) for i in order[start:start + size][self.rank::self.world_size]], 0

    def _stream_shares(self) -> Iterator[tuple[list[Item], int]]:
        """(this rank's share, the first dataset row after the global batch) for each global batch."""
        assert self.open_stream is not None
        group: list[Item] = []
        for item in self.open_stream(self.rows):
            group.append(item)
            if len(group) == self.global_batch_size:
                yield group[self.rank::self.world_size], group[-1][-1].row + 1
                group = []
        if group:
            yield group[self.rank::self.world_size], group[-1][-1].row + 1

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: plain ints, for the resumable checkpoint."""
        return {"epoch": self.epoch, "position": self.position, "rows": self.rows, **self._identity(),
                "skipped": self.skipped.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was saved; refuses a state that would not mean the same batches."""
        for key, mine in self._identity().items():
            saved = state.get(key, _ABSENT.get(key))
            if saved != mine and key == "global_batch_size" and isinstance(saved, int):
                raise PosttuneError(other_global_batch(saved, mine, self.world_size))
            if saved != mine:
                raise PosttuneError(f"cannot resume the data position: the checkpoint has {key}={saved}, "
                                    f"this run has {mine} (data.train's rows, packing, long samples' split, "
                                    "batch size x ranks, seed, data.shuffle or group_by_length changed: resume with "
                                    "the checkpoint's, or start a new run from its model)")
        self.epoch, self.position, self.rows = int(state["epoch"]), int(state["position"]), int(state["rows"])
        for key, value in state.get("skipped", {}).items():
            setattr(self.skipped, key, int(value))

    def _identity(self) -> dict[str, Any]:
        """What must not change between saving and resuming for a position to mean the same batches."""
        return {"streaming": self.streaming, "num_items": self.num_items, "global_batch_size": self.global_batch_size,
                "seed": self.seed if self.shuffle else None, "group_by_length": self.grouped}


#: identity keys newer than some checkpoints, and what their absence means
_ABSENT = {"group_by_length": False}


_END = object()


def prefetched(items: Iterator[T]) -> Iterator[T]:
    """``items`` in order, the next one produced on a worker thread while the caller uses this one.

    Reading, tokenizing and collating the next batch overlap the training step's compute (torch
    releases the GIL in its kernels). Only one item is ever ahead, and ``items`` is advanced by
    the worker alone, so order and side effects are those of a plain loop; an exception in the
    worker is raised here, at the item it concerns. Leaving early waits for the item in flight.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttune-prefetch") as worker:
        ahead = worker.submit(next, items, _END)
        while True:
            item = ahead.result()
            if item is _END:
                return
            ahead = worker.submit(next, items, _END)
            yield item


def _mix(seed: int, epoch: int) -> int:
    """One generator seed per (seed, epoch): distinct pairs give distinct seeds for any realistic values."""
    return (seed * 1_000_003 + epoch) % (2**63)


def other_global_batch(saved: int, mine: int, ranks: int) -> str:
    """Why a checkpoint's data position cannot be read with this run's global batch, and the batch size that reads
    it (the position counts global batches: train.batch_size x data-parallel ranks)."""
    where = f"{ranks} data-parallel rank{'s' if ranks != 1 else ''}"
    fits = (f"set train.batch_size={saved // ranks} to continue it on {where}" if saved % ranks == 0
            else f"it does not divide over {where}")
    return (f"cannot resume the data position: the checkpoint's global batch is {saved} rows (train.batch_size x "
            f"data-parallel ranks) and this run's {mine}; {fits}")
