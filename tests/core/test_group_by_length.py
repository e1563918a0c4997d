"""`data.group_by_length` and `data.pad_to_multiple_of`: a length-grouped epoch order that is still a
seeded, rank-consistent, resumable shuffle, and padding rounded up without changing the targets."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import datasets
import pytest
import torch
from posttune.config import validate
from posttune.config.schema import DataConfig, DatasetConfig, TrainConfig
from posttune.data import IGNORE_INDEX, padded_batch, pair_batch, prompt_loader
from posttune.data.loader import BatchLoader
from posttune.data.samples import Sample, SampleStore
from posttune.errors import ConfigError, PosttuneError
from posttune.plugins import new_plugin_set
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer

BASE = {"model": {"family": "llama", "size": "tiny"}, "method": "sft", "data": {"train": {"path": "d.jsonl"}}}


def mixed_lengths(count: int, seed: int = 0) -> torch.Tensor:
    """Lengths spread from a few tokens to a long sample, as chat data has them."""
    rng = random.Random(seed)
    return torch.tensor([rng.randint(4, 512) for _ in range(count)])


def loader(lengths: torch.Tensor | None, count: int, *, batch_size: int = 4, rank: int = 0, world_size: int = 1,
           seed: int = 3, shuffle: bool = True) -> BatchLoader:
    """Items are their own indices and a batch is the list of them, so orders are easy to read."""
    return BatchLoader(collate=lambda share: [item[0] for item in share], batch_size=batch_size, seed=seed,
                       shuffle=shuffle, rank=rank, world_size=world_size, num_items=count,
                       get_item=lambda i: [i], lengths=lengths)


def padding(batches: list[list[int]], lengths: torch.Tensor) -> float:
    """Mean padding tokens per row when each batch pads to its longest row."""
    pads = [int(lengths[batch].max()) - int(lengths[i]) for batch in batches for i in batch]
    return sum(pads) / len(pads)


@pytest.mark.parametrize("count, batch_size", [(1000, 4), (203, 4), (7, 8), (1, 1)])
def test_grouped_epoch_is_a_permutation_with_only_the_last_batch_short(count, batch_size):
    batches = list(loader(mixed_lengths(count), count, batch_size=batch_size))
    assert sorted(i for batch in batches for i in batch) == list(range(count))
    assert all(len(batch) == batch_size for batch in batches[:-1])
    assert len(batches) == len(loader(None, count, batch_size=batch_size))


def test_grouped_batches_pad_far_less_than_the_plain_shuffle():
    lengths = mixed_lengths(2000)
    grouped = padding(list(loader(lengths, 2000, batch_size=8)), lengths)
    plain = padding(list(loader(None, 2000, batch_size=8)), lengths)
    assert grouped < 0.2 * plain, (grouped, plain)


def test_grouped_batch_order_stays_shuffled():
    """Not sorted longest-first across the epoch: the global batches are shuffled after grouping."""
    lengths = mixed_lengths(2000)
    longest = [int(lengths[batch].max()) for batch in loader(lengths, 2000, batch_size=8)]
    assert longest != sorted(longest, reverse=True) and longest != sorted(longest)


def test_ranks_take_disjoint_shares_of_the_same_global_batches():
    lengths = mixed_lengths(203)
    whole = list(loader(lengths, 203, batch_size=6))
    shares = [list(loader(lengths, 203, batch_size=3, rank=rank, world_size=2)) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == len(whole)
    for batch, first, second in zip(whole, *shares, strict=True):
        assert not set(first) & set(second)
        assert first == batch[0::2] and second == batch[1::2]


def test_each_epoch_has_its_own_grouped_order_and_a_seed_repeats_it():
    lengths = mixed_lengths(300)
    one = loader(lengths, 300)
    first, second = list(one), list(one)  # iterating to the end advances the epoch
    assert one.epoch == 2 and first != second
    assert list(loader(lengths, 300)) == first
    assert list(loader(lengths, 300, seed=4)) != first


def test_mid_epoch_state_resumes_with_exactly_the_remaining_batches():
    lengths = mixed_lengths(300)
    straight = loader(lengths, 300)
    straight.set_epoch(1)
    expected = list(straight)
    interrupted = loader(lengths, 300)
    interrupted.set_epoch(1)
    batches = iter(interrupted)
    done = [next(batches) for _ in range(11)]
    state = interrupted.state_dict()
    resumed = loader(lengths, 300)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and done + list(resumed) == expected


def test_resume_refuses_a_changed_group_by_length_and_accepts_an_older_plain_state():
    lengths = mixed_lengths(40)
    grouped_state = loader(lengths, 40).state_dict()
    with pytest.raises(PosttuneError, match="group_by_length=True, this run has False"):
        loader(None, 40).load_state_dict(grouped_state)
    older = {key: value for key, value in loader(None, 40).state_dict().items() if key != "group_by_length"}
    loader(None, 40).load_state_dict(older)  # written before the option existed: a plain shuffle
    with pytest.raises(PosttuneError, match="group_by_length=False, this run has True"):
        loader(lengths, 40).load_state_dict(older)


def test_an_unshuffled_loader_ignores_lengths():
    """Validation batches stay in dataset order: grouping only reorders a shuffled epoch."""
    assert loader(mixed_lengths(10), 10, shuffle=False).order() == list(range(10))


def test_store_group_lengths_are_each_rows_longest_sample_without_retokenizing():
    made = {0: ([1, 2, 3], [1, 2, 3]), 1: None, 2: [([1], [1]), ([1, 2, 3, 4, 5], [1] * 5)], 3: [([7] * 4, [7] * 4)]}
    store = SampleStore.build([{}] * 4, lambda row, index: made[index])
    assert store.group_lengths().tolist() == [3, 5, 4]
    assert store.group_lengths().tolist() == [max(len(s) for s in store.group(i)) for i in range(len(store))]


def sample(length: int, row: int = 0) -> Sample:
    ids = torch.arange(1, length + 1)
    return Sample(ids, ids.clone(), row)


def test_pad_to_multiple_of_rounds_the_width_up_with_untargeted_padding():
    rows = [[sample(5)], [sample(70)]]
    plain, rounded = padded_batch(rows, pad_id=0), padded_batch(rows, pad_id=0, pad_to_multiple_of=64)
    assert plain["input_ids"].shape == (2, 70) and rounded["input_ids"].shape == (2, 128)
    assert torch.equal(rounded["input_ids"][:, :70], plain["input_ids"])
    assert torch.equal(rounded["labels"][:, :70], plain["labels"])
    assert (rounded["input_ids"][:, 70:] == 0).all() and (rounded["labels"][:, 70:] == IGNORE_INDEX).all()
    assert rounded["num_tokens"] == plain["num_tokens"] == 75
    assert padded_batch(rows, pad_id=0, pad_to_multiple_of=70)["input_ids"].shape == (2, 70)  # already a multiple


def test_pair_batch_pads_chosen_and_rejected_to_the_same_multiple():
    batch = pair_batch([[sample(3, 0), sample(9, 0)], [sample(4, 1), sample(2, 1)]], pad_id=0, pad_to_multiple_of=8)
    assert batch["input_ids"].shape == (4, 16)
    assert (batch["labels"][:, 9:] == IGNORE_INDEX).all()
    assert pair_batch([], pad_id=0, pad_to_multiple_of=8)["input_ids"].shape == (2, 8)  # placeholder pair


def with_data(**values) -> dict:
    return {**BASE, "data": {**BASE["data"], **values}}


@pytest.mark.parametrize("data, message", [
    ({"group_by_length": True, "train": {"path": "d.jsonl", "streaming": True}},
     "data.group_by_length: needs a map-style dataset (the whole epoch to sort), but data.train is streaming; "
     "set streaming: false or drop it"),
    ({"pad_to_multiple_of": 0},
     "data.pad_to_multiple_of: expected a positive integer, or null (pad to the longest row only), got 0"),
])
def test_settings_that_cannot_apply_are_refused_in_one_line(data, message):
    with pytest.raises(ConfigError) as error:
        validate(with_data(**data))
    assert str(error.value) == f"config: {message}"
    assert "\n" not in str(error.value)


def test_grouping_a_map_style_unpacked_dataset_validates():
    config = validate(with_data(group_by_length=True, pad_to_multiple_of=64))
    assert config.data.group_by_length and config.data.pad_to_multiple_of == 64


def test_prompts_are_grouped_by_their_tokenized_length(tmp_path, monkeypatch):
    """GRPO's prompt loader: prompts of similar length generate together (less left padding)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": "Why? " * (1 + i % 7), "answer": "x"}) + "\n" for i in range(30)))
    tokenizer = load_tokenizer(save_tiny_tokenizer(tmp_path / "tok", template="chatml"))
    fmt = new_plugin_set().registry.get("dataset_format", "prompt")
    loaders = {}
    for grouped in (False, True):
        config = SimpleNamespace(data=DataConfig(train=DatasetConfig("x"), group_by_length=grouped),
                                 train=TrainConfig(batch_size=5, seed=0))
        session = SimpleNamespace(config=config, plan=SimpleNamespace(datasets={"train": SimpleNamespace(
            descriptor=fmt)}), tokenizer=tokenizer, mesh=None)
        loaders[grouped] = prompt_loader(session, DatasetConfig(str(path), format="prompt"), "train")
    assert loaders[False].lengths is None and loaders[True].grouped
    spread = {grouped: sum(max(map(len, b["prompt_ids"])) - min(map(len, b["prompt_ids"])) for b in loader)
              for grouped, loader in loaders.items()}
    assert spread[True] < spread[False]
    assert sorted(int(r) for b in loaders[True] for r in b["rows"]) == list(range(30))
