"""The SFT data pipeline: loading, tokenizing with pre-shifted labels, batching, resumable loading."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from posttune.config.schema import DataConfig, DatasetConfig
from posttune.data import IGNORE_INDEX
from posttune_sft import sft_loader as build_sft_loader
from posttune.errors import ConfigError, PosttuneError
from posttune.plugins import new_plugin_set
from posttune.tiny_tokenizer import save_tiny_tokenizer
from posttune.tokenizer import load_tokenizer

ALPACA = [{"instruction": f"What is {i} + {i}?", "input": "" if i % 2 else "Be brief.",
           "output": f"The answer is {2 * i}." + " Sure." * (i % 4)} for i in range(13)]
CHAT = [[{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Hello, world!"}, {"role": "assistant", "content": "How are you today?"}],
        [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Thank you."},
         {"role": "assistant", "content": "You are welcome."}]]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}

pytestmark = pytest.mark.usefixtures("datasets_cache")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """chatml style: its pad id (0) differs from eos and never occurs in text, so padding is easy to strip."""
    return load_tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), template="chatml"))


@pytest.fixture(scope="module")
def formats():
    registry = new_plugin_set().registry
    return {name: registry.get("dataset_format", name) for name in ("alpaca", "chat", "text")}


def write(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a jsonl, json, csv or parquet file (by extension)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        frame = datasets.Dataset.from_list(rows)
        frame.to_csv(str(path), index=False) if path.suffix == ".csv" else frame.to_parquet(str(path))
    return path


def loader_for(path, tokenizer, formats, *, fmt="alpaca", batch_size=4, seed=0, shuffle=True, rank=0,
               world_size=1, train_on_input=False, streaming=False, column_map=None, packing=False, split_long=False,
               **data):
    dataset = DatasetConfig(path=str(path), format=fmt, streaming=streaming, column_map=column_map or {})
    config = DataConfig(train=dataset, **{"max_seq_len": 128, **data})
    return build_sft_loader(dataset, data=config, fmt=formats[fmt], tokenizer=tokenizer, batch_size=batch_size,
                            seed=seed, shuffle=shuffle, train_on_input=train_on_input, packing=packing,
                            padding_free=False, rank=rank, world_size=world_size, split_long=split_long)


def unpadded(batch, pad_id=0) -> list[tuple[list[int], list[int]]]:
    """Per row: (ids, labels) without the right padding (the chatml pad token never occurs in text)."""
    out = []
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        length = len(ids)
        while length and ids[length - 1] == pad_id:
            assert labels[length - 1] == IGNORE_INDEX
            length -= 1
        out.append((ids[:length], labels[:length]))
    return out


def all_batches(loader):
    return [{k: v.clone() for k, v in batch.items()} for batch in loader]


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def expected_sample(tokenizer, messages, max_seq_len=128):
    ids, trained = tokenizer.tokenize_messages(messages, max_seq_len=max_seq_len)
    labels = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
    return ids, labels


def alpaca_messages(row):
    prompt = f"{row['instruction']}\n\n{row['input']}" if row["input"] else row["instruction"]
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


# -- loading and tokenizing -----------------------------------------------------------------------

@pytest.mark.parametrize("ext", ["jsonl", "json", "csv", "parquet"])
def test_alpaca_rows_from_each_file_type_tokenize_with_the_chat_template(ext, tmp_path, tokenizer, formats):
    path = write(tmp_path / f"alpaca.{ext}", ALPACA[:3])
    (batch,) = all_batches(loader_for(path, tokenizer, formats, shuffle=False))
    assert batch.keys() == {"input_ids", "labels", "real_tokens", "num_tokens"}
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert int(batch["real_tokens"].sum()) == int(batch["num_tokens"])
    rows = [row for row, _ in zip(ALPACA, range(3))]
    for (ids, labels), row in zip(unpadded(batch), rows):
        assert (ids, labels) == expected_sample(tokenizer, alpaca_messages(row))
    assert int(batch["num_tokens"]) == sum(len(ids) for ids, _ in unpadded(batch))  # padding not counted


def test_csv_cells_are_read_as_the_text_written(tmp_path, tokenizer, formats):
    """pandas' guesses made "None", "N/A" and "nan" nulls (a "missing field") and "007" the number 7.0."""
    rows = [{"instruction": "nan", "input": "", "output": "None"}, {"instruction": "What is 6*7?", "input": "N/A",
                                                                    "output": "007"}]
    path = tmp_path / "na.csv"
    path.write_text("instruction,input,output\nnan,,None\nWhat is 6*7?,N/A,007\n")
    (batch,) = all_batches(loader_for(path, tokenizer, formats, shuffle=False))
    assert [ids for ids, _ in unpadded(batch)] == [expected_sample(tokenizer, alpaca_messages(row))[0] for row in rows]
    marked = tmp_path / "marked.csv"  # saved with a byte-order mark (Excel's "CSV UTF-8")
    marked.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    (again,) = all_batches(loader_for(marked, tokenizer, formats, shuffle=False))
    assert torch.equal(again["input_ids"], batch["input_ids"])


def test_a_utf8_bom_before_the_first_row_is_no_part_of_it(tmp_path, tokenizer, formats):
    """A JSON Lines file saved with a byte-order mark (Windows editors): refused by the checks before, and its first
    row dropped as invalid with skip_bad_rows."""
    plain = write(tmp_path / "plain.jsonl", ALPACA[:3])
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    for skip in (False, True):
        first, second = (all_batches(loader_for(p, tokenizer, formats, shuffle=False, skip_bad_rows=skip))
                         for p in (plain, marked))
        assert_same_batches(first, second)


def test_labels_are_the_assistant_tokens_shifted_by_one(tmp_path, tokenizer, formats):
    path = write(tmp_path / "chat.jsonl", [{"messages": CHAT[1]}])
    (batch,) = all_batches(loader_for(path, tokenizer, formats, fmt="chat"))
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    _, trained = tokenizer.tokenize_messages(CHAT[1])
    assert labels[-1] == IGNORE_INDEX
    for t in range(len(ids) - 1):
        assert labels[t] == (ids[t + 1] if trained[t + 1] else IGNORE_INDEX)
    targets = [label for label in labels if label != IGNORE_INDEX]
    assert tokenizer.decode(targets) == "Paris.<|im_end|>You are welcome.<|im_end|>"


def test_train_on_input_trains_every_next_token(tmp_path, tokenizer, formats):
    path = write(tmp_path / "chat.jsonl", [{"messages": CHAT[0]}])
    (batch,) = all_batches(loader_for(path, tokenizer, formats, fmt="chat", train_on_input=True))
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    assert labels == ids[1:] + [IGNORE_INDEX]


def test_chat_messages_and_sharegpt_conversations_give_the_same_samples(tmp_path, tokenizer, formats):
    openai = write(tmp_path / "a" / "chat.jsonl", [{"messages": m} for m in CHAT])
    sharegpt = write(tmp_path / "b" / "chat.json", [
        {"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in chat]}
        for chat in CHAT])
    first, second = (all_batches(loader_for(p, tokenizer, formats, fmt="chat", shuffle=False))
                     for p in (openai, sharegpt))
    assert_same_batches(first, second)
    assert [ids for ids, _ in unpadded(first[0])] == [tokenizer.tokenize_messages(c)[0] for c in CHAT]


def test_text_rows_train_on_every_token_and_end_with_eos(tmp_path, tokenizer, formats):
    path = write(tmp_path / "text.csv", [{"text": "The quick brown fox."}])
    (batch,) = all_batches(loader_for(path, tokenizer, formats, fmt="text"))
    ids = tokenizer.encode("The quick brown fox.") + [tokenizer.eos_id]
    assert batch["input_ids"][0].tolist() == ids
    assert batch["labels"][0].tolist() == ids[1:] + [IGNORE_INDEX]


def test_text_that_already_ends_with_eos_gets_no_second_one(tmp_path, tokenizer, formats):
    """TRL's rule: EOS is appended unless the last id is EOS (the text wrote it, or the tokenizer's post-processor
    added it: `$A </s>`); it was appended twice."""
    eos_text = tokenizer.special_tokens["eos_token"]
    path = write(tmp_path / "text.jsonl", [{"text": "The quick brown fox." + eos_text}])
    (batch,) = all_batches(loader_for(path, tokenizer, formats, fmt="text"))
    assert batch["input_ids"][0].tolist() == tokenizer.encode("The quick brown fox.") + [tokenizer.eos_id]


def test_a_folder_of_files_loads_them_all_in_name_order(tmp_path, tokenizer, formats):
    write(tmp_path / "data" / "part-1.jsonl", ALPACA[:2])
    write(tmp_path / "data" / "part-2.jsonl", ALPACA[2:5])
    loader = loader_for(tmp_path / "data", tokenizer, formats, batch_size=8, shuffle=False)
    (batch,) = all_batches(loader)
    assert [ids for ids, _ in unpadded(batch)] == [
        expected_sample(tokenizer, alpaca_messages(row))[0] for row in ALPACA[:5]]


def test_column_map_renames_dataset_columns_to_format_fields(tmp_path, tokenizer, formats):
    rows = [{"question": r["instruction"], "input": r["input"], "answer": r["output"]} for r in ALPACA[:2]]
    path = write(tmp_path / "qa.jsonl", rows)
    loader = loader_for(path, tokenizer, formats, shuffle=False,
                        column_map={"instruction": "question", "output": "answer"})
    assert [ids for ids, _ in unpadded(next(iter(loader)))] == [
        expected_sample(tokenizer, alpaca_messages(row))[0] for row in ALPACA[:2]]
    with pytest.raises(ConfigError, match=r"data.train.column_map.output: the dataset has no column 'reply'"):
        loader_for(path, tokenizer, formats, column_map={"instruction": "question", "output": "reply"})


def test_a_hub_dataset_that_cannot_be_loaded_is_one_line_naming_the_field(monkeypatch, tokenizer, formats):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)  # datasets >= 2.21
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)  # the older releases' switch
    with pytest.raises(ConfigError, match=r"^config: data.train.path: could not load 'someone/no-such-data' \(.*\)"):
        loader_for("someone/no-such-data", tokenizer, formats)


def test_a_folder_whose_files_have_other_columns_names_them(tmp_path, tokenizer, formats):
    """datasets reads a folder as one table and says only "An error occurred while generating the dataset"."""
    folder = tmp_path / "parts"
    write(folder / "a.jsonl", ALPACA[:2])
    write(folder / "b.jsonl", [{**row, "id": i} for i, row in enumerate(ALPACA[2:4])])
    with pytest.raises(ConfigError) as refused:
        loader_for(folder, tokenizer, formats)
    message = str(refused.value)
    assert message.startswith(f"config: data.train.path: the files of '{folder}' do not share their columns (")
    assert "id" in message and message.endswith("give them the same columns, or list each as its own dataset (a "
                                                "mixture)")


def test_a_column_mismatch_raised_as_the_context_is_named_too(tmp_path, tokenizer, formats, monkeypatch):
    """datasets before 4.7 (the floor is 2.19) raises its generic error while handling the cast error, so the
    mismatch is only the generic error's ``__context__``, not its ``__cause__``."""
    import datasets
    from datasets.exceptions import DatasetGenerationError
    from datasets.table import CastError

    def load_dataset(*args, **kwargs):
        try:
            raise CastError("cast", table_column_names=["instruction", "id"], requested_column_names=["instruction"])
        except CastError:
            raise DatasetGenerationError("An error occurred while generating the dataset")  # noqa: B904

    folder = tmp_path / "parts"
    write(folder / "a.jsonl", ALPACA[:2])
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(ConfigError, match=r"do not share their columns \(instruction in one, instruction, id in "):
        loader_for(folder, tokenizer, formats)


def test_a_missing_local_file_names_the_config_field(tmp_path, tokenizer, formats):
    with pytest.raises(PosttuneError, match=r"^config: data.train.path: no such file or directory .*nope.jsonl"):
        loader_for(tmp_path / "nope.jsonl", tokenizer, formats)


# -- bad rows, truncation --------------------------------------------------------------------------

def test_a_bad_row_names_its_index_and_the_missing_field(tmp_path, tokenizer, formats):
    rows = [dict(r) for r in ALPACA[:5]]
    del rows[3]["output"]
    path = write(tmp_path / "alpaca.jsonl", rows)
    with pytest.raises(PosttuneError, match=r"^data.train: row 3: missing field 'output'"):
        loader_for(path, tokenizer, formats)


def test_a_row_the_format_rejects_reports_why(tmp_path, tokenizer, formats):
    path = write(tmp_path / "chat.jsonl", [{"messages": CHAT[0]}, {"messages": []}])
    with pytest.raises(PosttuneError, match=r"^data.train: row 1: field 'messages' must be a non-empty list"):
        loader_for(path, tokenizer, formats, fmt="chat")


@pytest.mark.parametrize("streaming", [False, True])
def test_skip_bad_rows_skips_and_counts_them(streaming, tmp_path, tokenizer, formats):
    rows = [dict(r) for r in ALPACA[:6]]
    del rows[1]["output"]
    rows[4]["instruction"] = None
    path = write(tmp_path / "alpaca.jsonl", rows)
    loader = loader_for(path, tokenizer, formats, shuffle=False, streaming=streaming, skip_bad_rows=True,
                        batch_size=8)
    (batch,) = all_batches(loader)
    assert [ids for ids, _ in unpadded(batch)] == [
        expected_sample(tokenizer, alpaca_messages(rows[i]))[0] for i in (0, 2, 3, 5)]
    assert (loader.skipped.bad_rows, loader.skipped.untrained) == (2, 0)
    # which, and why (the summary's)
    assert loader.skipped.first_bad == "data.train: row 1: missing field 'output' (absent or null)"
    assert "first_bad" not in loader.skipped.state_dict()  # a checkpoint's counts stay numbers
    all_batches(loader)  # a second epoch reads the rows again without counting them twice
    assert loader.skipped.total == 2


@pytest.mark.parametrize("streaming", [False, True])
def test_a_line_that_is_no_json_skipped_is_named_and_leaves_no_cache_behind(streaming, tmp_path, tokenizer,
                                                                            formats, monkeypatch):
    """A line dropped before `datasets` reads the file (not JSON, not UTF-8) is the first skipped one the summary
    names; the cleaned copy's Arrow cache stays with the copy, not in datasets' cache (a new entry each run)."""
    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    path = write(tmp_path / "alpaca.jsonl", ALPACA[:4])
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:20]  # cut short: invalid JSON
    path.write_text("\n".join(lines) + "\n")
    loader = loader_for(path, tokenizer, formats, shuffle=False, streaming=streaming, skip_bad_rows=True,
                        batch_size=8)
    (batch,) = all_batches(loader)
    assert len(unpadded(batch)) == 3 and loader.skipped.bad_rows == 1
    assert loader.skipped.first_bad.startswith(f"data.train: {path}: line 3: invalid JSON: ")
    assert not any(cache.rglob("*.arrow")), sorted(cache.rglob("*"))


def test_truncation_and_samples_left_with_nothing_to_train_on(tmp_path, tokenizer, formats):
    long_prompt = {"instruction": "Hello, world! " * 20, "input": "", "output": "Paris."}
    path = write(tmp_path / "alpaca.jsonl", [ALPACA[0], long_prompt, ALPACA[1]])
    loader = loader_for(path, tokenizer, formats, shuffle=False, max_seq_len=56)
    (batch,) = all_batches(loader)
    assert batch["input_ids"].shape == (2, 56)  # ALPACA[0] has 59 tokens: cut to 56
    assert [ids for ids, _ in unpadded(batch)] == [
        expected_sample(tokenizer, alpaca_messages(row), max_seq_len=56)[0] for row in (ALPACA[0], ALPACA[1])]
    assert (loader.skipped.bad_rows, loader.skipped.untrained) == (0, 1)
    cut = sum(len(expected_sample(tokenizer, alpaca_messages(row))[0]) > 56 for row in (ALPACA[0], ALPACA[1]))
    assert loader.skipped.truncated == cut == 1  # kept but cut (the row left with nothing is not counted twice)
    from posttune.training.run_report import describe_data

    assert describe_data(loader).endswith("(1 row skipped) (1 sample cut to data.max_seq_len)")


@pytest.mark.parametrize("packing", [False, True])
def test_split_long_samples_train_every_token_once_in_pieces(packing, tmp_path, tokenizer, formats):
    """``method.long_samples: split``: a document past max_seq_len is its pieces, in order; each piece's last label
    is the next piece's first token, so the labels of all pieces are the whole document's, each once."""
    texts = ["word " * 70, "short one", "   \n\t ", "", "x " * 24]
    path = write(tmp_path / "text.jsonl", [{"text": text} for text in texts])
    loader = loader_for(path, tokenizer, formats, fmt="text", shuffle=False, packing=packing, split_long=True,
                        max_seq_len=16, batch_size=64)
    (batch,) = all_batches(loader)
    if packing:  # each row's documents, as the document ids mark them
        got = [([i for i, d in zip(ids, docs) if d == doc], [t for t, d in zip(labels, docs) if d == doc])
               for ids, labels, docs in zip(*(batch[k].tolist() for k in ("input_ids", "labels", "document_ids")))
               for doc in dict.fromkeys(docs)]
        got = [(ids, labels) for ids, labels in got if set(ids) != {tokenizer.pad_id}]
    else:
        got = unpadded(batch)
    assert all(0 < len(ids) <= 16 for ids, _ in got)
    whole = [tokenizer.encode(text) + [tokenizer.eos_id] for text in texts if text.strip()]  # blank: no sample
    assert [t for _, labels in got for t in labels if t != IGNORE_INDEX] == [t for ids in whole for t in ids[1:]]
    pieces = [(ids[i:i + 16], [*ids[1:], IGNORE_INDEX][i:i + 16]) for ids in whole for i in range(0, len(ids), 16)]
    assert got == [(ids, labels) for ids, labels in pieces if set(labels) != {IGNORE_INDEX}]  # a lone end: no piece
    assert len(whole[0]) > 16 and len(whole[2]) > 16  # both split; the blank rows are skipped as untrained
    assert (loader.skipped.split, loader.skipped.truncated, loader.skipped.untrained) == (2, 0, 2)
    from posttune.training.run_report import describe_data

    assert describe_data(loader).endswith("(2 rows skipped) (2 samples split into pieces of data.max_seq_len)")


def test_a_streamed_dataset_refuses_long_samples_in_pieces(tmp_path, tokenizer, formats):
    """A stream resumes at the row after the last one read: a checkpoint between a row's pieces would lose the
    rest. SFT's validate refuses the config; the toolkit refuses a plugin's own loader alike."""
    path = write(tmp_path / "text.jsonl", [{"text": "word " * 70}])
    with pytest.raises(PosttuneError, match="data.train: a streamed dataset cannot keep long rows in pieces"):
        loader_for(path, tokenizer, formats, fmt="text", streaming=True, split_long=True, max_seq_len=16)


# -- batching --------------------------------------------------------------------------------------

def test_padding_collate_pads_ids_with_the_pad_id_and_labels_with_ignore(tmp_path, tokenizer, formats):
    path = write(tmp_path / "alpaca.jsonl", ALPACA[:2])
    (batch,) = all_batches(loader_for(path, tokenizer, formats, shuffle=False))
    short = len(expected_sample(tokenizer, alpaca_messages(ALPACA[1]))[0])
    assert batch["input_ids"].shape[1] > short
    assert (batch["input_ids"][1, short:] == tokenizer.pad_id).all()
    assert (batch["labels"][1, short - 1:] == IGNORE_INDEX).all()


def test_a_folder_saved_by_datasets_save_to_disk_loads_as_its_rows(tmp_path, tokenizer, formats):
    """``Dataset.save_to_disk`` and ``DatasetDict.save_to_disk`` folders (Arrow files, not data files) read with
    ``load_from_disk``: a DatasetDict's split by name, a slice as datasets reads one; a missing split is named."""
    from posttune.data.loading import load_rows

    expected = all_batches(loader_for(write(tmp_path / "rows.jsonl", ALPACA[:3]), tokenizer, formats, shuffle=False))
    datasets.Dataset.from_list(ALPACA[:3]).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA[:3]),
                          "test": datasets.Dataset.from_list(ALPACA[3:4])}).save_to_disk(str(tmp_path / "both"))
    for folder in ("one", "both"):
        (batch,) = all_batches(loader_for(tmp_path / folder, tokenizer, formats, shuffle=False))
        assert batch["input_ids"].equal(expected[0]["input_ids"]) and batch["labels"].equal(expected[0]["labels"])
    assert load_rows(DatasetConfig(path=str(tmp_path / "both"), split="test"))[0] == ALPACA[3]
    assert len(load_rows(DatasetConfig(path=str(tmp_path / "one"), split="train[1:]"))) == 2
    with pytest.raises(ConfigError, match=r"data.train.split: .*both' holds the splits train, test, not 'valid'"):
        load_rows(DatasetConfig(path=str(tmp_path / "both"), split="valid"))


def test_packing_fills_rows_of_max_seq_len_with_document_ids(tmp_path, tokenizer, formats):
    path = write(tmp_path / "alpaca.jsonl", ALPACA)
    samples = [expected_sample(tokenizer, alpaca_messages(row), max_seq_len=160) for row in ALPACA]
    batches = all_batches(loader_for(path, tokenizer, formats, shuffle=False, packing=True, max_seq_len=160,
                                     batch_size=64))
    (batch,) = batches
    assert batch.keys() == {"input_ids", "labels", "document_ids", "real_tokens", "num_tokens"}
    assert batch["input_ids"].shape[1] == 160 and batch["input_ids"].shape[0] < len(ALPACA)
    assert int(batch["real_tokens"].sum()) == int(batch["num_tokens"])  # the rows' tails are padding
    assert int(batch["num_tokens"]) == sum(len(ids) for ids, _ in samples)
    unpacked = []
    for ids, labels, docs in zip(*(batch[k].tolist() for k in ("input_ids", "labels", "document_ids"))):
        assert docs == sorted(docs) and docs[0] == 0
        count = max(docs)
        for doc in range(count):
            span = [t for t, d in enumerate(docs) if d == doc]
            unpacked.append(([ids[t] for t in span], [labels[t] for t in span]))
            assert labels[span[-1]] == IGNORE_INDEX  # no target across the document boundary
        tail = [t for t, d in enumerate(docs) if d == count]  # the padding (or the last document)
        if ids[tail[0]] == tokenizer.pad_id and all(labels[t] == IGNORE_INDEX for t in tail):
            continue
        unpacked.append(([ids[t] for t in tail], [labels[t] for t in tail]))
    assert unpacked == samples


# -- order, sharding, resume ----------------------------------------------------------------------

def test_shuffle_order_depends_on_seed_and_epoch_only(tmp_path, tokenizer, formats):
    path = write(tmp_path / "alpaca.jsonl", ALPACA)
    first, again, other_seed = (loader_for(path, tokenizer, formats, seed=s) for s in (1, 1, 2))
    assert first.order(0) == again.order(0)
    assert first.order(0) != other_seed.order(0)
    assert first.order(0) != first.order(1)
    assert sorted(first.order(0)) == list(range(len(ALPACA)))
    epoch0 = all_batches(first)
    assert_same_batches(epoch0, all_batches(again))
    assert first.epoch == 1  # iterating to the end moves to the next epoch
    epoch1 = all_batches(first)
    assert_same_batches(epoch1, all_batches(again))
    assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(epoch0, epoch1))


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_rank_shards_are_disjoint_and_cover_every_global_batch(streaming, tmp_path, tokenizer, formats):
    path = write(tmp_path / "alpaca.jsonl", ALPACA)  # 13 samples, global batch 2 x 3 = 6: last holds 1
    single = all_batches(loader_for(path, tokenizer, formats, batch_size=6, seed=3, streaming=streaming))
    ranks = [all_batches(loader_for(path, tokenizer, formats, batch_size=2, seed=3, rank=r, world_size=3,
                                    streaming=streaming)) for r in range(3)]
    assert {len(batches) for batches in ranks} == {len(single)} == {3}
    for step, whole in enumerate(single):
        shares = [sample for r in range(3) for sample in unpadded(ranks[r][step])
                  if any(label != IGNORE_INDEX for label in sample[1])]
        assert sorted(shares) == sorted(unpadded(whole))
    placeholder = ranks[2][-1]  # rank 2 has nothing in the last global batch: no targets at all
    assert (placeholder["labels"] == IGNORE_INDEX).all()


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(streaming, packing, tmp_path, tokenizer, formats):
    rows = [dict(r) for r in ALPACA]
    del rows[5]["output"]
    path = write(tmp_path / "alpaca.jsonl", rows)
    make = lambda: loader_for(path, tokenizer, formats, batch_size=2, seed=7, streaming=streaming,  # noqa: E731
                              packing=packing, max_seq_len=128, skip_bad_rows=True)
    uninterrupted = make()
    expected = all_batches(uninterrupted) + all_batches(uninterrupted)  # two epochs
    interrupted = make()
    taken = []
    for batch in interrupted:
        taken.append({k: v.clone() for k, v in batch.items()})
        if len(taken) == 2:
            break
    state = json.loads(json.dumps(interrupted.state_dict()))  # plain data, survives a checkpoint
    resumed = make()
    resumed.load_state_dict(state)
    rest = all_batches(resumed)
    assert resumed.epoch == 1
    assert_same_batches(taken + rest + all_batches(resumed), expected)
    assert resumed.skipped.state_dict() == uninterrupted.skipped.state_dict()


def test_streaming_yields_the_same_batches_as_map_style_in_order(tmp_path, tokenizer, formats):
    path = write(tmp_path / "alpaca.parquet", ALPACA)
    streamed = loader_for(path, tokenizer, formats, streaming=True, batch_size=3)
    mapped = loader_for(path, tokenizer, formats, shuffle=False, batch_size=3)
    assert_same_batches(all_batches(streamed), all_batches(mapped))
    assert len(mapped) == 5
    with pytest.raises(TypeError):
        len(streamed)


def test_resuming_with_another_global_batch_size_is_refused(tmp_path, tokenizer, formats):
    path = write(tmp_path / "alpaca.jsonl", ALPACA)
    state = loader_for(path, tokenizer, formats, batch_size=2).state_dict()
    with pytest.raises(PosttuneError) as refused:
        loader_for(path, tokenizer, formats, batch_size=4).load_state_dict(state)
    assert str(refused.value) == ("cannot resume the data position: the checkpoint's global batch is 2 rows "
                                  "(train.batch_size x data-parallel ranks) and this run's 4; set train.batch_size=2 "
                                  "to continue it on 1 data-parallel rank")


def test_rows_with_no_assistant_turn_are_named_as_such_not_as_too_long(tmp_path, tokenizer, formats):
    """A chat without an assistant turn has nothing to train on at any length: the message says so."""
    path = write(tmp_path / "users.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "user", "content": "again"}]}] * 3)
    with pytest.raises(PosttuneError) as refused:
        loader_for(path, tokenizer, formats, fmt="chat")
    assert str(refused.value).endswith("(0 bad rows skipped, 3 with no token to train on: no response or assistant "
                                       "turn to learn, or all of it past max_seq_len=128)")


def test_the_tokenized_store_shares_its_arrays_memory():
    """ids and labels as int32 arrays, 8 bytes a token: they were copied into tensors, both held at once at the
    peak (16 bytes a token measured, 8.2 without the copy, in a fresh process)."""
    from array import array

    from posttune.data.samples import _tensor

    values = array("i", range(1000))
    tensor = _tensor(values, torch.int32)
    assert tensor.data_ptr() == values.buffer_info()[0] and tensor.tolist() == list(range(1000))
    assert _tensor(array("i"), torch.int32).numel() == 0


def test_a_datasets_cache_that_cannot_be_written_is_named_not_the_data(tmp_path, tokenizer, formats, monkeypatch):
    """HF_DATASETS_CACHE (or HF_HOME) under a file: the error used to blame data.train.path, whose file is fine."""
    import datasets

    path = write(tmp_path / "rows.jsonl", [{"instruction": "a", "output": "b"}])
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "afile" / "cache")
    with pytest.raises(PosttuneError) as caught:
        loader_for(path, tokenizer, formats)
    assert str(caught.value).startswith("data.train: datasets' cache cannot be written (NotADirectoryError: ")
    assert str(caught.value).endswith("HF_DATASETS_CACHE (or HF_HOME, XDG_CACHE_HOME) must name a writable folder")
