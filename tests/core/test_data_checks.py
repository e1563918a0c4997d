"""The path and first-row rules of ``posttune.config.data_checks``, which validate and the loader share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttune.config import data_checks
from posttune.errors import ConfigError


def refused(call, *args) -> str:
    with pytest.raises(ConfigError) as error:
        call(*args)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_folder_mixing_file_types_is_refused_naming_the_field(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.csv").write_text("text\nb\n")
    assert refused(data_checks.local_files, tmp_path, "data.train[1]") == (
        f"config: data.train[1].path: {tmp_path} mixes file types (csv, json); keep one type per folder")


def test_json_and_jsonl_files_are_one_type(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.json").write_text('{"text": "b"}\n')
    assert data_checks.local_files(tmp_path, "data.train") == ("json", [str(tmp_path / "a.jsonl"),
                                                                         str(tmp_path / "b.json")])


def test_hidden_files_and_folders_of_a_data_folder_are_not_read(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "old.csv").write_text("text\nb\n")  # e.g. a tool's cache: not the run's rows
    (tmp_path / ".hidden.jsonl").write_text('{"text": "c"}\n')
    assert data_checks.local_files(tmp_path, "data.train") == ("json", [str(tmp_path / "rows.jsonl")])


def test_a_file_of_an_unknown_type_is_refused_naming_the_field(tmp_path):
    (tmp_path / "rows").write_text('{"text": "a"}\n')
    assert refused(data_checks.local_files, tmp_path / "rows", "data.validation") == (
        "config: data.validation.path: cannot read extension-less files (expected one of json, jsonl, parquet, csv, "
        "txt)")


@pytest.mark.parametrize("marker", ["state.json", "dataset_dict.json"])
def test_folders_save_to_disk_wrote_are_read_as_saved_datasets(tmp_path, marker):
    (tmp_path / marker).write_text("{}")
    assert data_checks.saved_by_datasets(tmp_path)
    assert not data_checks.saved_by_datasets(tmp_path / marker)  # a file named so is data, not a saved dataset


def test_a_missing_relative_data_file_is_refused_not_taken_for_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dataset = SimpleNamespace(path="rows.jsonl")  # a valid hub name's spelling, but a data file's extension
    assert refused(data_checks.local_path, dataset, "data.train") == (
        f"config: data.train.path: no such file or directory 'rows.jsonl' (relative to the working directory "
        f"{tmp_path})")
    assert data_checks.local_path(SimpleNamespace(path="owner/rows"), "data.train") is None  # a hub dataset


@pytest.mark.parametrize("split, read", [("train", "train"), ("train[:90%]", "train[:90%]"),
                                         ("train[95%:]", "train[95%:]")])
def test_a_local_split_keeps_its_slice(split, read):
    assert data_checks.local_split(split, "data.train") == read


def test_a_csv_files_byte_order_mark_is_not_part_of_its_first_column(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_bytes("\ufeffquestion,answer\nWhere?,Here.\n".encode())  # as Excel saves "CSV UTF-8"
    assert data_checks.first_csv_row(path, "data.train.path") == {"question": "Where?", "answer": "Here."}


def test_a_jsonl_files_byte_order_mark_is_read_past(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes('\ufeff{"text": "a"}\n'.encode())
    assert data_checks.first_jsonl_row(path, "data.train.path") == {"text": "a"}


def test_a_csv_rows_cells_past_its_header_are_left_out(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("text\na,extra\n")
    assert data_checks.first_csv_row(path, "data.train.path") == {"text": "a"}


def _reads_messages(row):
    return {"messages": row["messages"]}  # a KeyError when the row has none: another format's row


def _plan(tmp_path, *, skip_bad_rows: bool):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"instruction": "Reverse: AB", "output": "BA"}\n{"messages": []}\n')
    dataset = SimpleNamespace(path=str(path), format="chat", column_map={})
    fmt = SimpleNamespace(descriptor=SimpleNamespace(transform=_reads_messages))
    return SimpleNamespace(config=SimpleNamespace(data=SimpleNamespace(skip_bad_rows=skip_bad_rows)),
                           sources={"data.train": (dataset, fmt)})


def test_a_first_row_the_format_cannot_read_is_refused_unless_bad_rows_are_skipped(tmp_path):
    message = refused(data_checks.check_first_rows, _plan(tmp_path, skip_bad_rows=False))
    assert message.startswith("config: data.train.format: 'chat' cannot read the first row of ")
    assert data_checks.check_first_rows(_plan(tmp_path, skip_bad_rows=True)) is None  # the run skips that row


def test_preference_pairs_of_chat_messages_need_a_chat_template():
    from posttune.data.preference import PreferencePair

    turn = [{"role": "user", "content": "hi"}]
    assert data_checks._messages_in(PreferencePair(prompt=turn, chosen=turn, rejected=turn))
    assert data_checks._messages_in(PreferencePair(prompt="Say hi.", chosen=turn, rejected=turn))
    assert not data_checks._messages_in(PreferencePair(prompt="Say hi.", chosen=" hi", rejected=" no"))
