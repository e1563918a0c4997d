"""Length-grouped epoch order: batches of similar lengths, still shuffled (``data.group_by_length``).

Right padding costs compute on every padding token; a batch pads to its longest item, so a
random batch of mixed lengths wastes most of its width. Packing removes padding but changes what
a row is (several samples, document ids); grouping keeps one item per row and only changes which
items share a batch. The scheme is the usual one (HF's ``LengthGroupedSampler``): cut the epoch's
shuffled permutation into mega-batches of ``MEGA_BATCHES`` global batches, sort each by length
(longest first), split it into global batches, then shuffle the order of the full global batches.
Items within a batch stay random across the dataset's neighbourhood of similar lengths, and the
batch order is as random as before.

Everything comes from one ``torch.Generator`` seeded from (seed, epoch), and the sort is stable,
so every rank computes the same order and a resumed run recomputes it exactly.
"""

from __future__ import annotations

import torch

#: global batches per mega-batch: larger groups tighter, smaller keeps the order more random
MEGA_BATCHES = 50


def grouped_order(lengths: torch.Tensor, global_batch: int, generator: torch.Generator) -> list[int]:
    """A permutation of ``range(len(lengths))`` whose consecutive ``global_batch`` slices hold similar lengths.

    Only the epoch's last global batch can be short, and it stays last: `BatchLoader` slices the
    order by ``global_batch``, so a short batch anywhere else would shift every later batch.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    permutation = torch.randperm(lengths.numel(), generator=generator)
    mega = MEGA_BATCHES * global_batch
    ordered = []
    for start in range(0, permutation.numel(), mega):
        chunk = permutation[start:start + mega]
        ranks = torch.sort(lengths[chunk], descending=True, stable=True).indices
        ordered.append(chunk[ranks])
    order = torch.cat(ordered) if ordered else permutation
    full = order.numel() // global_batch
    batches = order[:full * global_batch].view(full, global_batch)
    shuffled = batches[torch.randperm(full, generator=generator)].reshape(-1)
    return torch.cat([shuffled, order[full * global_batch:]]).tolist()
