"""`data.shuffle: false`: the training rows in the order read, every epoch alike (a curriculum), for the loaders
every first-party method builds (SFT's own, the toolkit's `build_loader` and `prompt_loader`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import datasets
import pytest
import torch
from posttune.config import validate
from posttune.config.schema import DataConfig, DatasetConfig, TrainConfig
from posttune.data import prompt_loader
from posttune.errors import ConfigError
from posttune.plugins import new_plugin_set
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer
from posttune_sft import SFTConfig
from posttune_sft import data as sft_data

ROWS = 24


@pytest.fixture
def tokenizer(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return load_tokenizer(save_tiny_tokenizer(tmp_path / "tok", template="chatml"))


def session(tokenizer, fmt: str, shuffle: bool) -> SimpleNamespace:
    config = SimpleNamespace(data=DataConfig(train=DatasetConfig("x"), shuffle=shuffle, max_seq_len=64),
                             train=TrainConfig(batch_size=5, seed=0))
    descriptor = new_plugin_set().registry.get("dataset_format", fmt)
    return SimpleNamespace(config=config, plan=SimpleNamespace(datasets={"train": SimpleNamespace(
        descriptor=descriptor)}), tokenizer=tokenizer, mesh=None, method_config=SFTConfig())


def epochs(loader, count: int = 2) -> list[list[int]]:
    """The dataset rows each epoch trains on, in order: prompt batches name their rows; SFT's padding-free batches
    do not, so its rows are read from the order of its tokenized store (each item one row), and the batches'
    tokens checked to be those rows' tokens, end to end, in that order."""
    batches = [_epoch(loader, epoch) for epoch in range(count)]
    if "rows" in batches[0][0]:
        return [[int(row) for batch in epoch for row in batch["rows"]] for epoch in batches]
    orders = [[int(loader.samples.rows[i]) for i in loader.order(epoch)] for epoch in range(count)]
    for epoch, order in zip(batches, orders):
        trained = torch.cat([batch["input_ids"].reshape(-1) for batch in epoch])
        expected = torch.cat([sample.ids for row in order for sample in loader.samples.group(row)])
        assert torch.equal(trained[trained != pad_id(loader)], expected[expected != pad_id(loader)])
    return orders


def pad_id(loader) -> int:
    return loader.collate.keywords["pad_id"]


def _epoch(loader, epoch: int):
    loader.set_epoch(epoch)
    return list(loader)


@pytest.mark.parametrize("fmt, build", [("prompt", prompt_loader), ("completion", sft_data)])
def test_unshuffled_training_rows_come_in_file_order_every_epoch(tokenizer, tmp_path, fmt, build):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}?", "completion": f"A{i}", "answer": "x"}) + "\n"
                            for i in range(ROWS)))
    orders = {shuffle: epochs(build(session(tokenizer, fmt, shuffle), DatasetConfig(str(path), format=fmt), "train"))
              for shuffle in (False, True)}
    assert orders[False] == [list(range(ROWS))] * 2
    assert all(sorted(epoch) == list(range(ROWS)) and epoch != list(range(ROWS)) for epoch in orders[True])
    assert orders[True][0] != orders[True][1]  # a shuffled run draws each epoch anew


def test_grouping_needs_a_shuffled_order():
    config = {"model": {"family": "llama", "size": "tiny"}, "method": "sft",
              "data": {"train": {"path": "d.jsonl"}, "shuffle": False}}
    assert not validate(config).data.shuffle
    with pytest.raises(ConfigError) as error:
        validate({**config, "data": {**config["data"], "group_by_length": True}})
    assert str(error.value) == ("config: data.group_by_length: groups a shuffled order, but data.shuffle is false "
                                "(the rows in the order read); keep one")
