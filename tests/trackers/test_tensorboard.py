"""posttune-tensorboard: what a run logs, read back with TensorBoard's own event reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import posttune_tensorboard
import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from tracking_support import metrics, series, tracked_config


@pytest.fixture
def tensorboard(register_plugin):
    register_plugin(posttune_tensorboard, distribution="posttune-tensorboard", version="0.1.0")


def events(log_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalars(accumulator: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def as_float32(pairs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """TensorBoard keeps scalars as float32: the logged values, rounded as it rounds them."""
    return [(step, float(np.float32(value))) for step, value in pairs]


def test_event_files_hold_every_metric_of_metrics_jsonl(tensorboard, train, tmp_path):
    out = train(tracked_config(tmp_path, ["tensorboard"]))
    records = metrics(out)
    logged = events(out / "tensorboard")
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
        assert scalars(logged, key) == as_float32(series(records, key)), key
    assert [step for step, _ in scalars(logged, "loss")] == [1, 2, 3]
    assert [step for step, _ in scalars(logged, "val_loss")] == [2]
    config = yaml.safe_load(logged.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode())
    assert config == yaml.safe_load((out / "config.yaml").read_text())
    summary = yaml.safe_load(logged.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode())
    assert summary == json.loads((out / "summary.json").read_text())


def test_the_config_is_recorded_as_hyper_parameters(tensorboard, train, tmp_path):
    out = train(tracked_config(tmp_path, ["tensorboard"]))
    content = events(out / "tensorboard").PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = session.session_start_info.hparams
    assert hparams["train.lr"].number_value == pytest.approx(1e-3)
    assert hparams["method.name"].string_value == "sft"
    assert hparams["logging"].string_value == '["tensorboard"]'
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [info.name.tag for info in experiment.metric_infos] == ["loss", "val_loss"]


def test_a_resumed_run_appends_and_hides_what_the_killed_run_logged_past_its_checkpoint(tensorboard, train,
                                                                                        tmp_path):
    path = tracked_config(tmp_path, ["tensorboard"], steps=2, checkpoint={"save_every": 1})
    out = train(path)
    # As a run killed after step 2 but resumed from its step-1 checkpoint: step 2 is trained (and logged) again.
    train(path, "train.max_steps=3", f"checkpoint.resume={out / 'checkpoints' / 'step-00000001'}")
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]  # metrics.jsonl was trimmed to step 1, then went on
    assert scalars(events(out / "tensorboard"), "loss") == as_float32(series(records, "loss"))
    assert len(events(out / "tensorboard").Tensors("config/text_summary")) == 1  # the first session's, kept


def test_a_fresh_run_in_a_reused_directory_hides_the_old_events(tensorboard, train, tmp_path):
    path = tracked_config(tmp_path, ["tensorboard"])
    out = train(path)
    train(path, "checkpoint.overwrite=true", "train.lr=0.01", "train.max_steps=2")
    assert scalars(events(out / "tensorboard"), "loss") == as_float32(series(metrics(out), "loss"))
    assert [step for step, _ in scalars(events(out / "tensorboard"), "loss")] == [1, 2]


def test_a_misspelt_tracker_is_refused_before_launch_with_its_install_line(tensorboard, llama_sft, posttune_cli,
                                                                          tmp_path):
    result = posttune_cli("validate", str(tracked_config(tmp_path, ["tensorboard", "wandbb"])))
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == ("posttune: error: config: logging[1]: no metric logger 'wandbb' is installed (installed: "
                             "tensorboard) (did you mean 'wandb'?) — pip install posttune-wandb\n")
