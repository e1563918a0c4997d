"""``posttune.train``: the run `posttune train` makes, from Python (a script or a notebook cell): a config file or a
mapping, the command's overrides, its checks and one-line errors as exceptions, the summary returned; a second
run in the same process trains afresh."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from run_support import sft_config, write

import posttune
from posttune.errors import ConfigError


def losses(out: str) -> list[float]:
    return [record["loss"] for record in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())
            if "loss" in record]


def test_a_mapping_trains_and_returns_the_summary_and_a_second_run_trains_afresh(llama_sft, posttune_cli, tmp_path):
    config = sft_config(tmp_path, train={"max_steps": 3})
    given = copy.deepcopy(config)
    first = posttune.train(config)
    assert config == given  # the caller's mapping is not changed
    assert first["status"] == "finished" and first["final_step"] == 3 and first["output_dir"] == str(tmp_path / "out")
    second = posttune.train(config, f"checkpoint.output_dir={tmp_path / 'again'}")
    assert second["final_step"] == 3 and losses(second["output_dir"]) == losses(first["output_dir"])
    cli = posttune_cli("train", str(write(tmp_path, config)), f"checkpoint.output_dir={tmp_path / 'cli'}")
    assert cli.exit_code == 0, cli.stderr
    assert losses(str(tmp_path / "cli")) == losses(first["output_dir"])  # the command's run, step for step


def test_a_mistake_raises_the_commands_line(llama_sft, posttune_cli, tmp_path):
    config = sft_config(tmp_path, train={"max_steps": 1, "learning_rate": 1e-4})
    with pytest.raises(ConfigError) as caught:
        posttune.train(config)
    assert str(caught.value) == "config: train.learning_rate: unknown key; learning_rate is train.lr here"
    cli = posttune_cli("train", str(write(tmp_path, config)))
    assert cli.stderr == f"posttune: error: {caught.value}\n"
    assert not (tmp_path / "out").exists()  # refused before the output directory was claimed
