"""Undecodable, empty or misshapen data files and configs: one line naming the file and line, exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from run_support import reversal_rows, sft_config

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_sft
from posttune.config.schema import DatasetConfig
from posttune.data.loading import load_rows
from posttune.data.samples import SkipCounts
from posttune.errors import ConfigError

ROW = json.dumps(reversal_rows(1)[0]).encode()


@pytest.fixture
def llama_sft(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


def train_on(tmp_path: Path, content: bytes, name: str, posttune_cli, *overrides: str, **sections):
    """`posttune train` of a tiny run whose training data is ``content`` written to ``name``."""
    config = sft_config(tmp_path, train={"max_steps": 1, "device": "cpu"}, **sections)
    file = tmp_path / name
    file.write_bytes(content)
    config["data"]["train"]["path"] = str(file)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return posttune_cli("train", str(path), *overrides), file


def one_line(result) -> str:
    assert result.exit_code == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


def test_non_utf8_jsonl_names_the_file_and_line(llama_sft, posttune_cli, tmp_path):
    result, file = train_on(tmp_path, ROW + b"\n" + b'{"messages": "caf\xe9"}\n' + ROW + b"\n", "train.jsonl",
                            posttune_cli)
    assert one_line(result) == (f"posttune: error: config: data.train.path: {file}: line 2: not UTF-8 text; save the "
                                f"file as UTF-8 (or set data.skip_bad_rows: true to skip such rows)\n")


def test_skip_bad_rows_skips_and_counts_an_undecodable_line(llama_sft, posttune_cli, tmp_path):
    result, _ = train_on(tmp_path, ROW + b"\n" + b"\xff\xfe garbage\n" + ROW + b"\n", "train.jsonl", posttune_cli,
                         data={"skip_bad_rows": True})
    assert result.exit_code == 0, result.stderr
    assert "data: skipped 1 bad row(s)" in result.stdout


def test_non_utf8_json_list_names_the_file(llama_sft, posttune_cli, tmp_path):
    result, file = train_on(tmp_path, b"[\n" + ROW + b",\n" + b'{"messages": "\xff"}\n]', "train.json", posttune_cli,
                            data={"skip_bad_rows": True})
    assert one_line(result) == (f"posttune: error: config: data.train.path: {file}: line 3: not UTF-8 text; save the "
                                f"file as UTF-8\n")


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_an_empty_data_file_is_named(llama_sft, posttune_cli, tmp_path, content):
    result, file = train_on(tmp_path, content, "train.jsonl", posttune_cli)
    assert one_line(result) == f"posttune: error: config: data.train.path: {file}: the file is empty (no rows)\n"


@pytest.mark.parametrize("text", ['{"data": [ROW, ROW]}', '{\n  "data": [\n    ROW\n  ]\n}\n'])
def test_a_json_object_instead_of_a_list_of_rows_is_named(llama_sft, posttune_cli, tmp_path, text):
    result, file = train_on(tmp_path, text.replace("ROW", ROW.decode()).encode(), "train.json", posttune_cli)
    assert one_line(result).startswith(f"posttune: error: config: data.train.path: {file}: holds one JSON object ")
    assert "(keys: data), not a list of rows" in result.stderr


@pytest.mark.parametrize("line, problem", [
    (b'{"messages": oops}', "invalid JSON: Expecting value (column 14)"),
    (b"[1, 2]", "expected a JSON object (one row), got a list"),
])
def test_an_invalid_json_line_is_named(llama_sft, posttune_cli, tmp_path, line, problem):
    result, file = train_on(tmp_path, ROW + b"\n" + line + b"\n", "train.jsonl", posttune_cli)
    assert one_line(result) == f"posttune: error: config: data.train.path: {file}: line 2: {problem}\n"


def test_an_invalid_line_in_a_streamed_file_is_one_line(llama_sft, posttune_cli, tmp_path):
    result, _ = train_on(tmp_path, (ROW + b"\n") * 3 + b"{nope\n", "train.jsonl", posttune_cli,
                         "data.train.streaming=true")
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]  # after the trainer's progress bar: the stream fails mid-run
    # the file and line, as a map-style read says them (pyarrow's own said "after 0 row(s) ... in row 3")
    assert last == f"posttune: error: data.train: {tmp_path / 'train.jsonl'}: line 4: invalid JSON: Expecting " \
                   "property name enclosed in double quotes (column 2)"


def test_load_rows_counts_skipped_invalid_lines(tmp_path):
    file = tmp_path / "rows.jsonl"
    file.write_bytes(b'{"text": "a"}\n{"text": \xff}\n{nope\n\n{"text": "b"}\n')
    skipped = SkipCounts()
    rows = load_rows(DatasetConfig(str(file)), skip_bad_rows=True, skipped=skipped)
    assert [row["text"] for row in rows] == ["a", "b"] and skipped.bad_rows == 2
    with pytest.raises(ConfigError, match=r"rows.jsonl: line 2: not UTF-8 text"):
        load_rows(DatasetConfig(str(file)))


def test_undecodable_text_lines_are_named(tmp_path):
    file = tmp_path / "rows.txt"
    file.write_bytes(b"hello\nw\xf6rld\n")
    with pytest.raises(ConfigError, match=r"rows.txt: line 2: not UTF-8 text; save the file as UTF-8 \(or set"):
        load_rows(DatasetConfig(str(file), format="text"))
    skipped = SkipCounts()
    assert list(load_rows(DatasetConfig(str(file), format="text"), skip_bad_rows=True, skipped=skipped)) == [
        {"text": "hello"}]
    assert (skipped.bad_rows, skipped.first_bad) == (1, f"data.train: {file}: line 2: not UTF-8 text")


# ---- configs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    (b"model: {path: x}\nmethod: caf\xe9\n", "{path}:2: not UTF-8 text (a YAML config is text; save it as UTF-8)"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "{path}:1: not UTF-8 text (a YAML config is text; save it as UTF-8)"),
    (b"model: {path: x}\nmethod: sft\x00\x01\n", "{path}:2: invalid YAML: control character 0x00 (is this a binary "
                                                 "file?)"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "{path}:1: invalid YAML: control character 0x7f (is this a binary file?)"),
])
def test_undecodable_or_binary_yaml_is_one_line(posttune_cli, tmp_path, content, message):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    result = posttune_cli("validate", str(path))
    assert one_line(result) == f"posttune: error: {message.format(path=path)}\n"


@pytest.mark.parametrize("content, problem", [
    (b'null\n{"text": "a"}\n', "line 1: expected a JSON object (one row), got null"),  # pyarrow segfaults on it
    (b"[]", "holds no rows (an empty list, or only empty objects)"),
    (b"{}\n{}\n", "holds no rows with any field (only empty objects)"),
])
def test_json_files_without_rows_are_named(tmp_path, content, problem):
    file = tmp_path / "rows.json"
    file.write_bytes(content)
    with pytest.raises(ConfigError) as error:
        load_rows(DatasetConfig(str(file)))
    assert str(error.value) == f"config: data.train.path: {file}: {problem}"


def test_a_self_referencing_or_exploding_yaml_is_one_line(posttune_cli, tmp_path):
    looped = tmp_path / "loop.yaml"
    looped.write_text("model: {family: llama, size: tiny, build_overrides: &a {x: *a}}\nmethod: sft\n")
    assert one_line(posttune_cli("validate", str(looped))) == (
        f"posttune: error: {looped}: invalid YAML: an anchor is used inside itself (&a ... *a); a config is a tree\n")
    levels = ["a0: &a0 [" + ", ".join(["x"] * 10) + "]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text("\n".join(levels) + "\nmodel: {family: llama, size: tiny}\nmethod: sft\n")
    assert one_line(posttune_cli("validate", str(laughs))) == (
        f"posttune: error: {laughs}: invalid YAML: its aliases (*name) expand to more than 100,000 values (a string "
        "counts one per 64 characters)\n")
    # one 10 kB string aliased 10,000 times (a 50 kB file that expanded to 100 MB in config.yaml before)
    strings = tmp_path / "strings.yaml"
    strings.write_text("model: {family: llama, size: tiny}\nmethod: sft\ntokenizer:\n  chat_template_kwargs:\n"
                       "    a: &s " + "x" * 10_000 + "\n    b: [" + ", ".join(["*s"] * 10_000) + "]\n")
    assert one_line(posttune_cli("validate", str(strings))) == (
        f"posttune: error: {strings}: invalid YAML: its aliases (*name) expand to more than 100,000 values (a string "
        "counts one per 64 characters)\n")


def test_a_row_nested_too_deeply_is_one_line_not_a_traceback(tmp_path):
    """json's RecursionError (and Arrow's reader, which may crash on such a row) never meets it: named before."""
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    file = tmp_path / "rows.jsonl"
    file.write_bytes(deep + b'{"text": "a"}\n')
    with pytest.raises(ConfigError) as error:
        load_rows(DatasetConfig(str(file)))
    assert str(error.value) == (f"config: data.train.path: {file}: line 1: nested too deeply to read (thousands of "
                                "levels)")
    skipped = SkipCounts()
    rows = load_rows(DatasetConfig(str(file)), skip_bad_rows=True, skipped=skipped)
    assert list(rows) == [{"text": "a"}] and skipped.bad_rows == 1

