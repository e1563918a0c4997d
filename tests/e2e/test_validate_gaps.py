"""What `posttune validate` used to call valid and `train` refused seconds later: each is one line now."""

from __future__ import annotations

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


def without_train_path(tmp_path) -> dict:
    config = sft_config(tmp_path)
    del config["data"]["train"]["path"]
    return config


@pytest.mark.parametrize(("make", "field", "words"), [
    (lambda tmp: sft_config(tmp, train={"scheduler": "cosin"}), "train.scheduler", "did you mean 'cosine'"),
    (lambda tmp: sft_config(tmp, train={"optimizer": "adamw8bit"}), "train.optimizer",
     "memory: [adamw_8bit]"),
    (without_train_path, "data.train.path", ""),
    (alpaca_rows_as_chat, "data.train.format", "cannot read the first row"),
], ids=["scheduler", "low-bit-optimizer", "missing-path", "format-vs-rows"])
def test_validate_refuses_in_one_line_what_train_would(llama_sft, posttune_cli, tmp_path, make, field, words):
    result = validate(posttune_cli, tmp_path, make(tmp_path))
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.stdout
    assert len(lines) == 1 and field in lines[0] and words in lines[0], lines


def test_a_format_that_reads_the_rows_is_valid(llama_sft, posttune_cli, tmp_path):
    result = validate(posttune_cli, tmp_path, sft_config(tmp_path))
    assert result.exit_code == 0, result.stderr
