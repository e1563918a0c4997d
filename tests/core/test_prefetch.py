"""The loader collates the next batch on a worker thread: same batches, same resume positions."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from posttune.data.loader import BatchLoader, prefetched


def loader(*, prefetch: bool, count: int = 10, collate=None, streaming: bool = False) -> BatchLoader:
    """Items are their own indices; a batch is the list of them."""
    collate = collate or (lambda share: [item[0] for item in share])
    common = dict(collate=collate, batch_size=3, seed=5, prefetch=prefetch)
    if streaming:
        def open_stream(start_row: int):
            return ([SimpleNamespace(row=row, index=row)] for row in range(start_row, count))

        return BatchLoader(open_stream=open_stream, **common)
    return BatchLoader(num_items=count, get_item=lambda i: [i], **common)


def test_prefetched_keeps_order_and_runs_the_items_on_one_worker_thread():
    threads = []

    def items():
        for i in range(5):
            threads.append(threading.get_ident())
            yield i

    assert list(prefetched(items())) == [0, 1, 2, 3, 4]
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident()


@pytest.mark.parametrize("streaming", [False, True])
def test_batches_and_positions_equal_the_plain_loop(streaming):
    plain, ahead = loader(prefetch=False, streaming=streaming), loader(prefetch=True, streaming=streaming)
    for _ in range(2):  # two epochs
        for got, expected in zip(ahead, plain, strict=True):
            assert [item.index if streaming else item for item in got] == \
                   [item.index if streaming else item for item in expected]
            # a checkpoint taken now records the batches handed out, not the one collated ahead
            assert ahead.state_dict() == plain.state_dict()


@pytest.mark.parametrize("streaming", [False, True])
def test_a_checkpoint_taken_mid_epoch_resumes_to_the_same_remaining_batches(streaming):
    def rest(source: BatchLoader) -> list:
        return [[item.index if streaming else item for item in batch] for batch in source]

    first = loader(prefetch=True, streaming=streaming)
    batches = iter(first)
    next(batches), next(batches)
    saved = first.state_dict()
    uninterrupted = rest_of(batches, streaming)
    resumed = loader(prefetch=True, streaming=streaming)
    resumed.load_state_dict(saved)
    assert rest(resumed) == uninterrupted and len(uninterrupted) == 2


def rest_of(batches, streaming: bool) -> list:
    return [[item.index if streaming else item for item in batch] for batch in batches]


def test_an_error_in_the_worker_is_raised_at_the_batch_it_concerns():
    def collate(share):
        if share[0][0] >= 6:
            raise ValueError("row 6 is bad")
        return [item[0] for item in share]

    source = BatchLoader(collate=collate, batch_size=3, shuffle=False, num_items=10, get_item=lambda i: [i])
    seen = []
    with pytest.raises(ValueError, match="row 6 is bad"):
        for batch in source:
            seen.append(batch)
    assert seen == [[0, 1, 2], [3, 4, 5]]


def test_leaving_early_stops_the_worker():
    before = threading.active_count()
    for _ in range(20):
        for _batch in loader(prefetch=True, count=30):
            break
    assert threading.active_count() <= before


def test_a_data_position_of_another_dataset_is_refused_naming_what_may_have_changed():
    """Packing, a split of long samples or another file change the item count: all listed, with the way out."""
    from posttune.errors import PosttuneError

    saved = loader(prefetch=False, count=10).state_dict()
    with pytest.raises(PosttuneError) as caught:
        loader(prefetch=False, count=9).load_state_dict(saved)
    assert str(caught.value) == ("cannot resume the data position: the checkpoint has num_items=10, this run has 9 "
                                 "(data.train's rows, packing, long samples' split, batch size x ranks, seed, "
                                 "data.shuffle or group_by_length changed: resume with the checkpoint's, or start a "
                                 "new run from its model)")
