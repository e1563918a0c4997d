"""The SFT data pipeline: dataset config -> rows -> samples -> micro-batches (DESIGN §7).

    from posttune.data import build_sft_loader

    loader = build_sft_loader(config.data.train, data=config.data, fmt=registry.get("dataset_format", name),
                              tokenizer=tokenizer, batch_size=config.train.batch_size, seed=config.train.seed,
                              train_on_input=False, rank=rank, world_size=world_size)
    for epoch in range(loader.epoch, config.train.epochs):
        loader.set_epoch(epoch)
        for batch in loader:           # {"input_ids", "labels"[, "document_ids"]}: LongTensor [b, s]
            logits = model(batch["input_ids"], document_ids=batch.get("document_ids"))
            loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
    checkpoint["data"] = loader.state_dict()   # later: loader.load_state_dict(checkpoint["data"])
    print(loader.skipped.total)                # rows left out (bad rows, nothing to train on)

Stages, one file each: `loading` (local files or hub names through `datasets.load_dataset`,
``column_map``), `samples` (the registered format's transform, the tokenizer's chat template with
the prompt masked, truncation, **pre-shifted labels**: ``labels[:, t]`` is the target of position
t, so methods never shift), `packing` (greedy rows of ``max_seq_len``), `collate` (padding or
packed rows with ``document_ids``), `loader` (shuffled per epoch, sharded per rank, resumable
mid-epoch bitwise).
"""

from posttune.data.loader import SFTLoader
from posttune.data.samples import IGNORE_INDEX, Sample, SkipCounts
from posttune.data.sft import build_sft_loader

__all__ = ["IGNORE_INDEX", "SFTLoader", "Sample", "SkipCounts", "build_sft_loader"]
