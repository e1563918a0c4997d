"""The data toolkit every method builds its loaders from (docs/architecture.md, "Data").

    from posttune.plugin import SampleMaker, build_loader, dataset_format, padded_batch, pad_id

    def data(session, dataset, split):                       # a method's ``data`` callback
        make = SampleMaker(dataset_format(session, split), session.tokenizer,
                           max_seq_len=session.config.data.max_seq_len, where=f"data.{split}")
        return build_loader(session, dataset, split, make=make,
                            collate=partial(padded_batch, pad_id=pad_id(session.tokenizer)))

Stages, one file each: `loading` (local files or hub names through `datasets.load_dataset`,
``column_map``), `samples` (the registered format's transform, the tokenizer's chat template with
the prompt masked, truncation, **pre-shifted labels**: ``labels[:, t]`` is the target of position
t, so methods never shift), `preference` (pairs of samples sharing a prompt), `prompts` (prompts to
generate from, their rows' fields kept), `packing` (greedy rows of ``max_seq_len``), `collate`
(padding, packed rows with ``document_ids``, stacked pairs), `loader` (shuffled per epoch, sharded
per rank, resumable mid-epoch bitwise), `build` (all of it in one call).
"""

from posttune.data.build import (build_loader, dataset_format, make_loader, pair_loader, pair_tokens, prompt_loader,
                                 shuffled)
from posttune.data.collate import (documents_as_rows, flat_batch, pad_id, packed_batch, padded_batch, pair_batch,
                                   rows_as_documents)
from posttune.data.loader import BatchLoader
from posttune.data.loading import load_rows
from posttune.data.preference import PairMaker, PreferencePair, as_messages, preference_pair
from posttune.data.prompts import PromptMaker, PromptRow, prompt_batch, prompt_row
from posttune.data.samples import IGNORE_INDEX, SampleMaker, SkipCounts

__all__ = [
    "IGNORE_INDEX", "BatchLoader", "PairMaker", "PreferencePair", "PromptMaker", "PromptRow", "SampleMaker",
    "SkipCounts", "as_messages", "build_loader", "dataset_format", "documents_as_rows", "flat_batch", "load_rows",
    "make_loader", "pad_id", "packed_batch", "padded_batch", "pair_batch", "pair_loader", "pair_tokens",
    "preference_pair", "prompt_batch", "prompt_loader", "prompt_row", "rows_as_documents", "shuffled",
]
