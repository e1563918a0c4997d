"""``data.validation_split``: a share of the training rows, drawn at random with ``train.seed``, held out as the
validation set (axolotl's ``val_set_size``): the two sets are disjoint and together every row, the draw is the
same in every loader and run with the same seed, and the run evaluates on it."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from run_support import compose_run, sft_config, write

from posttune.data.build import holdout_rows
from posttune.errors import PosttuneError


def numbered(count: int) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"n": i} for i in range(count)])


@pytest.mark.parametrize("share, count, held", [(0.19, 10, 2), (0.25, 10, 2), (0.05, 100, 5), (0.33, 10, 3),
                                              (0.5, 3, 2)])
def test_the_held_out_share_is_rounded_to_the_nearest_row(share, count, held):
    """``round(share x rows)`` rows (0.19 of 10: 2), as documented; Python rounds a half to even (0.25 of 10: 2)."""
    assert len(holdout_rows(numbered(count), share, 0, True, where="data.train")) == held


def test_the_held_out_rows_and_the_rest_are_disjoint_every_row_once_and_seeded():
    rows = numbered(40)
    held = list(holdout_rows(rows, 0.25, 7, True, where="data.train")["n"])
    rest = list(holdout_rows(rows, 0.25, 7, False, where="data.train")["n"])
    assert len(held) == 10 and len(rest) == 30
    assert sorted([*held, *rest]) == list(range(40)) and held == sorted(held) and rest == sorted(rest)  # file order
    assert held == list(holdout_rows(numbered(40), 0.25, 7, True, where="data.train")["n"])  # the same draw again
    assert held != list(holdout_rows(rows, 0.25, 8, True, where="data.train")["n"])  # another seed, another draw
    assert held != list(range(30, 40)) and held != list(range(10))  # drawn at random, not a slice
    with pytest.raises(PosttuneError, match="data.train: data.validation_split 0.01 of 40 rows leaves no row to "
                                            "validate on"):
        holdout_rows(rows, 0.01, 7, True, where="data.train")


def test_a_run_trains_on_the_rest_and_evaluates_on_the_held_out_rows(llama_sft, posttune_cli, tmp_path):
    config = sft_config(tmp_path, rows=20, data={"validation_split": 0.25}, train={"max_steps": 2, "eval_every": 2})
    session = compose_run(config)
    assert session.train_data.num_items == 15 and session.validation_data.num_items == 5
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    steps = [json.loads(line) for line in (Path(config["checkpoint"]["output_dir"]) / "metrics.jsonl")
             .read_text().splitlines()]
    assert "val_loss" in steps[-1]


def test_a_list_of_datasets_holds_out_the_same_share_of_each(llama_sft, posttune_cli, tmp_path):
    """axolotl's ``val_set_size`` over several ``datasets:``: each source gives its share (refused before)."""
    config = sft_config(tmp_path, rows=20, train={"max_steps": 2, "eval_every": 2})
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": f"Reverse: {w}", "input": "", "output": w[::-1]}) + "\n"
                              for w in ("ABC", "XYZ", "QWER", "LMNO", "PQ", "RSTU", "VW", "KLM")))
    config["data"] = {**config["data"], "validation_split": 0.25,
                      "train": [config["data"]["train"], {"path": str(alpaca), "format": "alpaca"}]}
    session = compose_run(config)
    assert session.train_data.num_items == 15 + 6 and session.validation_data.num_items == 5 + 2
    result = posttune_cli("train", str(write(tmp_path, config)))
    assert result.exit_code == 0, result.stderr
    steps = [json.loads(line) for line in (Path(config["checkpoint"]["output_dir"]) / "metrics.jsonl")
             .read_text().splitlines()]
    assert "val_loss" in steps[-1]


@pytest.mark.parametrize(("data", "message"), [
    ({"validation_split": 1.5}, "data.validation_split: expected a number > 0 and < 1, or null (data.validation, if "
                                "any, is the validation set), got 1.5"),
    ({"validation_split": 0.1, "validation": {"path": "x.jsonl"}},
     "data.validation_split: data.validation is given too; keep one"),
])
def test_impossible_splits_are_refused_by_validate(llama_sft, posttune_cli, tmp_path, data, message):
    config = sft_config(tmp_path, data=data)
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2 and result.stderr == f"posttune: error: config: {message}\n", result.stderr


def test_a_streamed_training_set_is_refused(llama_sft, posttune_cli, tmp_path):
    config = sft_config(tmp_path, data={"validation_split": 0.1}, train={"max_steps": 2})
    config["data"]["train"] = {**config["data"]["train"], "streaming": True}
    result = posttune_cli("validate", str(write(tmp_path, config)))
    assert result.exit_code == 2
    assert result.stderr == ("posttune: error: config: data.validation_split: data.train is streamed (its rows are "
                             "not all read first); give data.validation (a split may be sliced: split: "
                             "train[95%:])\n"), result.stderr
