"""``posttune.train``: the run `posttune train` makes, from Python (a script or a notebook cell): a config file or a
mapping, the command's overrides, its checks and one-line errors as exceptions, the summary returned; a second
run in the same process trains afresh."""

from __future__ import annotations

import copy
import json
import re
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


def test_a_sweep_s_own_draws_go_on_across_runs(llama_sft, tmp_path):
    """A run seeds Python's and torch's generators from train.seed; the caller's states come back after it, so a
    random search drew the same hyper-parameters on every trial after the first before (a sweep driver's report).
    The trial's grid values may be numpy numbers and paths ``Path``s, its overrides a list, and the driver may hold
    ``torch.no_grad()`` (it raised "element 0 of tensors does not require grad" after setup before)."""
    import random

    import numpy
    import torch

    random.seed(12345)
    torch.manual_seed(12345)
    expected = [(random.random(), torch.rand(1).item()) for _ in range(2)]
    random.seed(12345)
    torch.manual_seed(12345)
    drawn, summaries = [], []
    for trial in range(2):
        drawn.append((random.random(), torch.rand(1).item()))
        config = sft_config(tmp_path, train={"max_steps": numpy.int64(2), "lr": numpy.float32(1e-3)})
        config["checkpoint"]["output_dir"] = tmp_path / f"trial-{trial}"
        with torch.no_grad():
            summaries.append(posttune.train(config, ["train.log_every=1"]))
    assert drawn == expected
    assert [s["final_step"] for s in summaries] == [2, 2]
    assert summaries[0]["train_loss"] == summaries[1]["train_loss"] == losses(summaries[0]["output_dir"])[-1]
    for odd, shown in ((["train.lr=1e-3", 3], "3"), (["train.lr=1e-3", 0], "0"), ([None], "None"), (5, "5"),
                       ({"train.lr": 1e-3}, "{'train.lr': 0.001}"), (b"train.lr=1", "b'train.lr=1'")):
        with pytest.raises(TypeError, match=rf"^posttune.train: an override is a 'key=value' string, got "
                                            rf"{re.escape(shown)}$"):
            posttune.train(config, odd)
