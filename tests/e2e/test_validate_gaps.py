"""What `posttune validate` used to call valid and `train` refused seconds later: each is one line now."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from run_support import sft_config


def validate(posttune_cli, tmp_path, config: dict):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return posttune_cli("validate", str(path))


def alpaca_rows_as_chat(tmp_path) -> dict:
    """The chat-format run, its data swapped for alpaca rows (no `messages` column)."""
    config = sft_config(tmp_path)
    rows = tmp_path / "alpaca.jsonl"
    rows.write_text('{"instruction": "Reverse: AB", "input": "", "output": "BA"}\n')
    config["data"]["train"]["path"] = str(rows)
    return config


def support_csv(tmp_path, format_: str = "chat", column_map: dict | None = None, text: str = "") -> dict:
    """A question/answer CSV (commas, quotes and a newline inside cells), read with ``format_``."""
    config = sft_config(tmp_path)
    rows = tmp_path / "support.csv"
    rows.write_text(text or 'question,answer\n"Where, exactly, is my ""invoice""?","Under Billing.\nThen Invoices."\n',
                    encoding="utf-8")
    config["data"]["train"] = {"path": str(rows), "format": format_, **({"column_map": column_map} if column_map
                                                                         else {})}
    return config


def documents_parquet(tmp_path, column_map: dict | None = None, rows: list | None = None) -> dict:
    """Documents in a Parquet file's ``content`` column, read with format ``text`` (which reads ``text``)."""
    import pyarrow
    import pyarrow.parquet

    config = sft_config(tmp_path)
    table = pyarrow.table({"content": ["A first document.", "A second."] if rows is None else rows},
                          schema=pyarrow.schema([("content", pyarrow.string())]))
    pyarrow.parquet.write_table(table, tmp_path / "documents.parquet")
    config["data"]["train"] = {"path": str(tmp_path / "documents.parquet"), "format": "text",
                               **({"column_map": column_map} if column_map else {})}
    return config


def without_train_path(tmp_path) -> dict:
    config = sft_config(tmp_path)
    del config["data"]["train"]["path"]
    return config


def saved_adapter(tmp_path, rank: int = 4):
    """A folder that looks like a saved LoRA adapter to adapter_config.json readers (validate reads no weights)."""
    folder = tmp_path / f"adapter-r{rank}"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def missing_file(tmp_path, split: str) -> dict:
    config = sft_config(tmp_path)
    config["data"][split] = {"path": str(tmp_path / "nowhere" / f"{split}.jsonl"), "format": "chat"}
    return config


def empty_folder(tmp_path) -> dict:
    config = sft_config(tmp_path)
    (tmp_path / "empty").mkdir()
    config["data"]["validation"] = {"path": str(tmp_path / "empty"), "format": "chat"}
    return config


def train_file(tmp_path, content: bytes, **options) -> dict:
    """The run, its train file holding ``content``."""
    config = sft_config(tmp_path, **options)
    (tmp_path / "rows.jsonl").write_bytes(content)
    config["data"]["train"]["path"] = str(tmp_path / "rows.jsonl")
    return config


def column_map(tmp_path, mapping: dict) -> dict:
    config = sft_config(tmp_path)
    config["data"]["train"]["column_map"] = mapping
    return config


def local_split(tmp_path, split: str) -> dict:
    config = sft_config(tmp_path)
    config["data"]["train"]["split"] = split
    return config


def starting_from(tmp_path, folder) -> dict:
    return sft_config(tmp_path, adapter={"rank": 4, "alpha": 8, "init_from": str(folder)})


@pytest.mark.parametrize(("make", "field", "words"), [
    (lambda tmp: sft_config(tmp, train={"scheduler": "cosin"}), "train.scheduler", "did you mean 'cosine'"),
    (lambda tmp: sft_config(tmp, train={"optimizer": "adamw8bit"}), "train.optimizer",
     "memory: [adamw_8bit]"),
    (without_train_path, "data.train.path", ""),
    (lambda tmp: missing_file(tmp, "train"), "data.train.path", "no such file or directory"),
    (lambda tmp: missing_file(tmp, "validation"), "data.validation.path", "no such file or directory"),
    (empty_folder, "data.validation.path", "holds no json/jsonl/parquet/csv/txt files"),
    (lambda tmp: sft_config(tmp, tokenizer={"path": str(tmp / "nowhere")}), "tokenizer.path", "no such folder"),
    (lambda tmp: sft_config(tmp, tokenizer={"path": str(tmp)}), "tokenizer.path", "has no tokenizer.json"),
    (alpaca_rows_as_chat, "data.train.format", "cannot read the first row"),
    (support_csv, "data.train.format", "cannot read the first row of"),  # validate read only .jsonl rows
    (lambda tmp: support_csv(tmp, "alpaca"), "data.train.format", "the row has 'question', 'answer'"),
    (lambda tmp: support_csv(tmp, "alpaca", {"instruction": "Question", "output": "answer"}),
     "data.train.column_map.instruction", "the dataset has no column 'Question' (columns: question, answer)"),
    (lambda tmp: support_csv(tmp, "alpaca", text="question,answer\n"), "data.train.path",
     "support.csv: the file has no rows under its header"),
    (lambda tmp: train_file(tmp, b"\n  \n"), "data.train.path", "rows.jsonl: the file is empty (no rows)"),
    (lambda tmp: train_file(tmp, b"\n{'messages': []}\n"), "data.train.path",
     "rows.jsonl: line 2: invalid JSON: Expecting property name enclosed in double quotes (column 2)"),
    (lambda tmp: train_file(tmp, b'\xff\xfe{"a": 1}\n'), "data.train.path",
     "rows.jsonl: line 1: not UTF-8 text; save the file as UTF-8"),
    (lambda tmp: train_file(tmp, b"[1, 2]\n"), "data.train.path",
     "line 1: expected a JSON object (one row), got a list"),
    (lambda tmp: train_file(tmp, b"", data={"skip_bad_rows": True}), "data.train.path", "the file is empty"),
    (lambda tmp: column_map(tmp, {"messages": "msgs"}), "data.train.column_map.messages",
     "the dataset has no column 'msgs' (columns: messages)"),
    (lambda tmp: local_split(tmp, "test"), "data.train.split",
     "'test': local files are read as one split, 'train' (slices such as train[:90%] work)"),
    (lambda tmp: {**local_split(tmp, "train"), "data": {**local_split(tmp, "train")["data"], "train": {
        **local_split(tmp, "train")["data"]["train"], "subset": "main"}}}, "data.train.subset",
     "'main': local files have no subsets (a hub dataset's configuration name); point path at that subset's own "
     "files and drop it (data.train.subset=null)"),
    (lambda tmp: {**sft_config(tmp), "data": {**sft_config(tmp)["data"], "train": [
        sft_config(tmp)["data"]["train"], {**sft_config(tmp)["data"]["train"], "subset": "main"}]}},
     "data.train[1].subset", "own files and drop it (data.train.1.subset=null)"),  # the command line's spelling
    (lambda tmp: starting_from(tmp, tmp / "nowhere"), "adapter.init_from", "nowhere: no such adapter directory (no "
     "adapter_config.json there)"),
    (lambda tmp: starting_from(tmp, saved_adapter(tmp, rank=8)), "adapter.init_from",
     "rank 8 (saved) vs 4 (adapter.rank)"),
    (documents_parquet, "data.train.format", "'text' cannot read the first row of"),  # validate read no Parquet
    (lambda tmp: train_file(tmp, b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content":'
                                 b' null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '
                                 b'"{oops"}}]}]}\n'), "data.train.format",
     "is a string but not JSON (expected an object); the row has 'messages'); fix the row, or choose the format "
     "that matches the data"),
    (lambda tmp: documents_parquet(tmp, rows=[]), "data.train.path", "documents.parquet: the file has no rows"),
], ids=["scheduler", "low-bit-optimizer", "missing-path", "missing-train-file", "missing-validation-file",
        "empty-data-folder", "missing-tokenizer", "no-tokenizer-json", "format-vs-rows", "csv-format-vs-rows",
        "csv-unmapped-columns", "csv-missing-column", "csv-header-only", "empty-file", "invalid-json", "not-utf8",
        "not-an-object", "empty-file-skipping-bad-rows", "missing-column", "local-split-name", "local-subset",
        "mixture-local-subset",
        "init-from-missing",
        "init-from-other-rank", "parquet-format-vs-rows", "parquet-no-rows", "bad-value-in-first-row"])
def test_validate_refuses_in_one_line_what_train_would(llama_sft, posttune_cli, tmp_path, make, field, words):
    result = validate(posttune_cli, tmp_path, make(tmp_path))
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.stdout
    assert len(lines) == 1 and field in lines[0] and words in lines[0], lines


def test_a_format_that_reads_the_rows_is_valid(llama_sft, posttune_cli, tmp_path):
    result = validate(posttune_cli, tmp_path, sft_config(tmp_path))
    assert result.exit_code == 0, result.stderr
    mapped = support_csv(tmp_path, "alpaca", {"instruction": "question", "output": "answer"})
    result = validate(posttune_cli, tmp_path, mapped)
    assert result.exit_code == 0, result.stderr
    result = validate(posttune_cli, tmp_path, documents_parquet(tmp_path, {"text": "content"}))
    assert result.exit_code == 0, result.stderr


def test_a_column_the_first_row_lacks_names_the_rows_fields_not_skip_bad_rows(llama_sft, posttune_cli, tmp_path):
    """The loader's error when a file's columns are named otherwise (a .json file: validate peeks only at .jsonl
    and .csv rows): it advised skip_bad_rows, which skipped every row, then failed with no usable samples."""
    config = support_csv(tmp_path, "alpaca")
    rows = tmp_path / "support.json"
    rows.write_text(json.dumps([{"question": "Where is my invoice?", "answer": "Under Billing."}] * 3))
    config["data"]["train"]["path"] = str(rows)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("preview", str(path))
    assert (result.exit_code, result.stderr) == (2, "posttune: error: data.train: row 0: missing field 'instruction' "
                                                    "(the row's fields: question, answer; data.train.column_map: "
                                                    "{instruction: <one of them>} names the column to read)\n")


def test_a_slice_of_a_local_file_is_read(llama_sft, tmp_path):
    from posttune.config.schema import DatasetConfig
    from posttune.data import load_rows

    path = sft_config(tmp_path)["data"]["train"]["path"]
    whole = load_rows(DatasetConfig(path=path, format="chat"))
    assert len(load_rows(DatasetConfig(path=path, format="chat", split="train[:25%]"))) == len(whole) // 4


def test_a_bad_first_line_is_left_to_the_loader_when_bad_rows_are_skipped(llama_sft, posttune_cli, tmp_path):
    config = sft_config(tmp_path)
    rows = b"not json\n" + Path(config["data"]["train"]["path"]).read_bytes()
    result = validate(posttune_cli, tmp_path, train_file(tmp_path, rows, data={"skip_bad_rows": True}))
    assert result.exit_code == 0, result.stderr


def test_an_adapter_of_the_same_shape_to_start_from_is_valid(llama_sft, posttune_cli, tmp_path):
    result = validate(posttune_cli, tmp_path, starting_from(tmp_path, saved_adapter(tmp_path, rank=4)))
    assert result.exit_code == 0, result.stderr


def test_plan_without_the_hub_still_plans_and_says_the_estimate_is_unavailable(llama_sft, posttune_cli, monkeypatch):
    """A hub id not in the cache, offline: the plan's stages print and the estimate says why it is missing (exit
    0); only a run needs the weights."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = posttune_cli("plan", "llama-demo-reverse", "model.path=someone/not-cached-0.5B")
    assert result.exit_code == 0, result.stderr
    assert "memory estimate: not available (someone/not-cached-0.5B: " in result.stdout
